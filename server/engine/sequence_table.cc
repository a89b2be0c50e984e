#include "server/engine/sequence_table.h"

#include "absl/strings/str_cat.h"
#include "common/random_id.h"

namespace kvcd {

absl::StatusOr<int64_t> LeasePolicy::Grant(int64_t requested_ms) const {
  if (requested_ms == 0) return default_ms;
  if (requested_ms < 10 || requested_ms > max_ms) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ms is ", requested_ms, ", expected 0 (default) or 10..", max_ms));
  }
  return requested_ms;
}

SequenceTable::SequenceTable(LeasePolicy leases, int64_t max_sequences, TenantLedger* ledger)
    : leases_(leases),
      max_sequences_(max_sequences),
      own_ledger_(ledger == nullptr ? std::make_unique<TenantLedger>() : nullptr),
      ledger_(ledger == nullptr ? own_ledger_.get() : ledger) {}

SequenceTable::~SequenceTable() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, seq] : sequences_) seq->model->Close(seq.get());
  sequences_.clear();
  pages_.clear();
}

void SequenceTable::Touch(Sequence* seq) {
  seq->deadline_ns.store(SteadyNowNs() + seq->lease_ms.load() * 1000000);
}

namespace {

int64_t PagesOf(ModelCache* model, Sequence* seq) {
  const int64_t ps = model->spec().page_size;
  return (model->Length(seq) + ps - 1) / ps;
}

}  // namespace

absl::StatusOr<int64_t> SequenceTable::GrantLease(const std::string& tenant,
                                                  int64_t requested_ms) const {
  absl::StatusOr<int64_t> lease = leases_.Grant(requested_ms);
  if (!lease.ok()) return lease;
  return ledger_->CapLease(tenant, *lease);
}

absl::StatusOr<uint64_t> SequenceTable::Reserve(const std::string& salt) {
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<int64_t>(sequences_.size()) + opening_ >= max_sequences_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("max_sequences (", max_sequences_, ") sequences are open; close some first"));
  }
  // The tenant's slot is taken while the prefix is pinned.
  if (absl::Status s = ledger_->TakeSequence(salt); !s.ok()) return s;
  ++opening_;
  uint64_t id;
  do {
    id = RandomId64();
  } while (sequences_.count(id) != 0);
  return id;
}

void SequenceTable::Refuse(const std::string& salt) {
  std::lock_guard<std::mutex> lock(mu_);
  --opening_;
  ledger_->ReleaseSequence(salt, 0);
}

absl::Status SequenceTable::Admit(const std::shared_ptr<Sequence>& seq, int64_t lease_ms) {
  const int64_t pages = PagesOf(seq->model, seq.get());
  seq->lease_ms.store(lease_ms);
  Touch(seq.get());
  std::unique_lock<std::mutex> lock(mu_);
  --opening_;
  if (absl::Status s = ledger_->PinPages(seq->salt, pages, "the matched prefix"); !s.ok()) {
    ledger_->ReleaseSequence(seq->salt, 0);
    lock.unlock();
    seq->model->Close(seq.get());
    return s;
  }
  pages_[seq->id] = pages;
  sequences_.emplace(seq->id, seq);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Open(ModelCache* model,
                                                              const std::string& salt,
                                                              absl::Span<const int32_t> tokens,
                                                              int64_t lease_ms) {
  absl::StatusOr<uint64_t> id = Reserve(salt);
  if (!id.ok()) return id.status();
  std::shared_ptr<Sequence> seq = model->Open(*id, salt, tokens);
  if (absl::Status s = Admit(seq, lease_ms); !s.ok()) return s;
  return seq;
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Fork(Sequence& src, int64_t lease_ms) {
  absl::StatusOr<uint64_t> id = Reserve(src.salt);
  if (!id.ok()) return id.status();
  // The fork's pages count against max_pinned_pages before any page is taken for it (its
  // partial page may evict), so that a refused fork changes nothing.
  const int64_t pages = PagesOf(src.model, &src);
  if (absl::Status s = ledger_->PinPages(src.salt, pages, "the fork's pages"); !s.ok()) {
    Refuse(src.salt);
    return s;
  }
  absl::StatusOr<std::shared_ptr<Sequence>> seq = src.model->Fork(*id, &src);
  if (!seq.ok()) {
    ledger_->AdjustPinned(src.salt, -pages);
    Refuse(src.salt);
    return seq.status();
  }
  const int64_t held = PagesOf(src.model, seq->get());  // the source may have grown meanwhile
  (*seq)->lease_ms.store(lease_ms);
  Touch(seq->get());
  std::lock_guard<std::mutex> lock(mu_);
  --opening_;
  ledger_->AdjustPinned(src.salt, held - pages);
  pages_[*id] = held;
  sequences_.emplace(*id, *seq);
  return seq;
}

absl::Status SequenceTable::ReserveTokens(Sequence& seq, int64_t tokens) {
  const int64_t ps = seq.model->spec().page_size;
  const int64_t total_pages = (seq.model->Length(&seq) + tokens + ps - 1) / ps;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pages_.find(seq.id);
  if (it == pages_.end()) return absl::OkStatus();  // closed meanwhile: the call will say so
  const int64_t growth = total_pages - it->second;
  if (growth <= 0) return absl::OkStatus();
  if (absl::Status s = ledger_->PinPages(seq.salt, growth, "this call"); !s.ok()) return s;
  it->second = total_pages;
  return absl::OkStatus();
}

void SequenceTable::Settle(Sequence& seq) {
  const int64_t total_pages = PagesOf(seq.model, &seq);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pages_.find(seq.id);
  if (it == pages_.end()) return;
  ledger_->AdjustPinned(seq.salt, total_pages - it->second);
  it->second = total_pages;
}

void SequenceTable::ReleaseLocked(const Sequence& seq) {
  auto p = pages_.find(seq.id);
  ledger_->ReleaseSequence(seq.salt, p != pages_.end() ? p->second : 0);
  if (p != pages_.end()) pages_.erase(p);
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Get(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(
        absl::StrCat("sequence ", id, " is not open (never opened, closed, or its lease expired)"));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Find(uint64_t id) {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = Get(id);
  if (seq.ok()) Touch(seq->get());
  return seq;
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Use(uint64_t id,
                                                             const FoundSequences& found,
                                                             size_t i) {
  if (i < found.size() && found[i] != nullptr && found[i]->id == id) {
    Touch(found[i].get());
    return found[i];
  }
  return Find(id);
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Peek(uint64_t id) const { return Get(id); }

absl::StatusOr<int64_t> SequenceTable::Close(uint64_t id) {
  std::shared_ptr<Sequence> seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sequences_.find(id);
    if (it == sequences_.end()) {
      return absl::NotFoundError(absl::StrCat("sequence ", id, " is not open"));
    }
    seq = it->second;
    sequences_.erase(it);
    ReleaseLocked(*seq);
  }
  const int64_t len = seq->model->Length(seq.get());
  seq->model->Close(seq.get());
  return len;
}

absl::StatusOr<int64_t> SequenceTable::Renew(uint64_t id, int64_t lease_ms) {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = Get(id);
  if (!seq.ok()) return seq.status();
  return Renew(**seq, lease_ms);
}

absl::StatusOr<int64_t> SequenceTable::Renew(Sequence& seq, int64_t lease_ms) {
  if (lease_ms != 0) {
    absl::StatusOr<int64_t> lease = GrantLease(seq.salt, lease_ms);
    if (!lease.ok()) return lease.status();
    seq.lease_ms.store(*lease);
  }
  Touch(&seq);
  return seq.lease_ms.load();
}

int SequenceTable::Expire(int64_t now_ns) {
  std::vector<std::shared_ptr<Sequence>> expired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sequences_.begin(); it != sequences_.end();) {
      if (it->second->deadline_ns.load() < now_ns) {
        expired.push_back(it->second);
        ReleaseLocked(*it->second);
        it = sequences_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& seq : expired) seq->model->Close(seq.get());
  return static_cast<int>(expired.size());
}

int64_t SequenceTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(sequences_.size());
}

}  // namespace kvcd
