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

SequenceTable::~SequenceTable() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, seq] : sequences_) seq->model->Close(seq.get());
  sequences_.clear();
}

void SequenceTable::Touch(Sequence* seq) {
  seq->deadline_ns.store(SteadyNowNs() + seq->lease_ms.load() * 1000000);
}

absl::StatusOr<std::shared_ptr<Sequence>> SequenceTable::Open(ModelCache* model,
                                                              const std::string& salt,
                                                              absl::Span<const int32_t> tokens,
                                                              int64_t lease_ms) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int64_t>(sequences_.size()) >= max_sequences_) {
      return absl::ResourceExhaustedError(absl::StrCat("max_sequences (", max_sequences_,
                                                       ") sequences are open; close some first"));
    }
    do {
      id = RandomId64();
    } while (sequences_.count(id) != 0);
  }
  std::shared_ptr<Sequence> seq = model->Open(id, salt, tokens);
  seq->lease_ms.store(lease_ms);
  Touch(seq.get());
  std::lock_guard<std::mutex> lock(mu_);
  sequences_.emplace(id, seq);
  return seq;
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

absl::StatusOr<std::string> SequenceTable::Salt(uint64_t id) const {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = Get(id);
  if (!seq.ok()) return seq.status();
  return (*seq)->salt;
}

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
  }
  const int64_t len = seq->model->Length(seq.get());
  seq->model->Close(seq.get());
  return len;
}

absl::StatusOr<int64_t> SequenceTable::Renew(uint64_t id, int64_t lease_ms) {
  absl::StatusOr<std::shared_ptr<Sequence>> seq = Get(id);
  if (!seq.ok()) return seq.status();
  if (lease_ms != 0) {
    absl::StatusOr<int64_t> lease = leases_.Grant(lease_ms);
    if (!lease.ok()) return lease.status();
    (*seq)->lease_ms.store(*lease);
  }
  Touch(seq->get());
  return (*seq)->lease_ms.load();
}

int SequenceTable::Expire(int64_t now_ns) {
  std::vector<std::shared_ptr<Sequence>> expired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sequences_.begin(); it != sequences_.end();) {
      if (it->second->deadline_ns.load() < now_ns) {
        expired.push_back(it->second);
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
