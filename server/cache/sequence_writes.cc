// ModelCache's sequence write paths: Append, and AttentionDecode's fused append of one
// token per layer (ModelCache::Attend) with the undo that takes it back when the attention
// fails; plus the demotion of pages that aged out of the recent window, which both trigger.

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/phase_times.h"
#include "common/status_macros.h"
#include "server/cache/model_cache.h"

namespace kvcd {

void ModelCache::DemotePages(Sequence* seq, std::vector<Demotion>* deferred) {
  if (!DemotesHistory()) return;
  const int32_t ps = spec_.page_size;
  const int64_t len = seq->length();
  // Pages below shared_pages are the tree's, in their final store, except a committed
  // window page (Sequence::window_copies): it takes the tree's copy instead of demoting.
  const int64_t first =
      std::max<int64_t>(seq->next_demote_page, static_cast<int64_t>(spec_.sink_pages()));
  const PageStore& window = stores_[kWindow];
  const PageStore& history = stores_[HistoryStore()];
  int64_t i = first;
  // Page i is demoted once all its tokens are older than the recent window.
  for (; (i + 1) * ps <= len - spec_.recent_tokens; ++i) {
    const PageRef old = seq->pages[static_cast<size_t>(i)];
    if (old.pool != kWindow) continue;
    if (i < seq->shared_pages) {
      const auto w = std::find_if(seq->window_copies.begin(), seq->window_copies.end(),
                                  [&](const Sequence::WindowCopy& c) { return c.index == i; });
      if (w == seq->window_copies.end()) continue;  // not reached: the tree's pages are final
      seq->pages[static_cast<size_t>(i)] = w->tree;
      if (deferred != nullptr) {
        deferred->push_back({i, old, w->tree, /*from_tree=*/true});
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        FreeLocked({old});
      }
      demoted_pages_.fetch_add(1);
      counters_->demoted_pages.fetch_add(1);
      continue;
    }
    std::vector<PageRef> fresh;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!AllocateLocked(HistoryStore(), seq->salt, 1, &fresh).ok())
        break;  // full: stay, retry later
    }
    const absl::Status s =
        history.format->Demote(*window.pool, {old.page}, *history.pool, {fresh[0].page});
    if (!s.ok()) {  // keep the window page; the next append retries
      KVCD_LOG(WARNING) << "model '" << spec_.name
                        << "': demotion failed, page kept: " << s.message();
      std::lock_guard<std::mutex> lock(mu_);
      FreeLocked(fresh);
      break;
    }
    seq->pages[static_cast<size_t>(i)] = fresh[0];
    if (deferred != nullptr) {
      deferred->push_back({i, old, fresh[0]});
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      FreeLocked({old});
    }
    demoted_pages_.fetch_add(1);
    counters_->demoted_pages.fetch_add(1);
  }
  seq->next_demote_page = i;
}

absl::StatusOr<int64_t> ModelCache::Append(Sequence* seq, absl::Span<const int32_t> tokens,
                                           const RowSource& k, const RowSource& v,
                                           const RowSource* x) {
  const int32_t ps = spec_.page_size;
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  if (seq->closed) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq->id, " is closed"));
  }
  const int64_t len = seq->length();
  const auto [lo, hi] = std::minmax_element(seq->layer_len.begin(), seq->layer_len.end());
  if (*lo != *hi) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", seq->id, " has a token pending at some layers (per-layer decode loop): ",
        "send k_new/v_new for the remaining layers through AttentionDecode before Append"));
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t pages_needed = (len + n + ps - 1) / ps - static_cast<int64_t>(seq->pages.size());
  std::vector<PageRef> fresh;
  if (pages_needed > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (pages_needed > (1 << 30)) return absl::ResourceExhaustedError("append too large");
    KVCD_RETURN_IF_ERROR(AllocateLocked(kWindow, seq->salt, pages_needed, &fresh));
  }
  std::vector<RowSlot> slots;
  slots.reserve(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = len + t;
    const size_t page = static_cast<size_t>(pos / ps);
    const PageRef& r =
        page < seq->pages.size() ? seq->pages[page] : fresh[page - seq->pages.size()];
    slots.push_back({t, r.page, static_cast<int32_t>(pos % ps)});
  }
  const PageStore& window = stores_[kWindow];
  absl::Status written = window.format->WriteRows(k, v, slots, -1, *window.pool);
  if (written.ok()) written = WriteCodes(kWindow, x, slots, -1);
  if (!written.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    FreeLocked(fresh);
    return written;
  }
  seq->pages.insert(seq->pages.end(), fresh.begin(), fresh.end());
  for (auto& l : seq->layer_len) l += n;
  seq->tokens.insert(seq->tokens.end(), tokens.begin(), tokens.end());
  DemotePages(seq);
  return len + n;
}

std::vector<AttentionSegment> ModelCache::Segments(const Sequence& seq, int64_t len) const {
  // Consecutive pages of one store form one segment (sink | history | recent).
  std::vector<AttentionSegment> segs;
  const int32_t ps = spec_.page_size;
  const int64_t num_pages = (len + ps - 1) / ps;
  for (int64_t i = 0; i < num_pages; ++i) {
    const PageRef& r = seq.pages[static_cast<size_t>(i)];
    if (segs.empty() || segs.back().pool != &PoolOf(r)) {
      AttentionSegment s;
      s.format = &FormatOf(r);
      s.pool = &PoolOf(r);
      s.first_position = i * ps;
      segs.push_back(std::move(s));
    }
    AttentionSegment& s = segs.back();
    s.page_ids.push_back(r.page);
    s.token_end += std::min<int64_t>(ps, len - i * ps);  // only the last page is partial
  }
  return segs;
}

bool ModelCache::PipelinedFaults(absl::Span<Sequence* const> seqs, int32_t layer,
                                 const RowSource& k, const RowSource& v, const RowSource* x,
                                 std::vector<kernels::DeviceFault>* faults) {
  const bool device_rows = (k.on_device && k.check_finite) || (v.on_device && v.check_finite) ||
                           (x != nullptr && x->on_device && x->check_finite);
  if (!device_rows) return false;
  for (const Sequence* s : seqs) {
    if (!s->device_fault.held()) return false;  // checked synchronously then
  }
  faults->clear();
  for (const Sequence* s : seqs) faults->push_back(s->device_fault.AtLayer(layer));
  return true;
}

absl::Status ModelCache::Attend(int32_t layer, absl::Span<Sequence* const> seqs, const float* q,
                                float softmax_scale, const NewTokens& new_tokens, float* o,
                                float* lse, std::vector<int64_t>* lengths, const DeviceIo* device) {
  static const int kLock = PhaseTimes::Phase("daemon.cache.lock+check");
  static const int kStore = PhaseTimes::Phase("daemon.cache.append row (alloc+store+demote)");
  static const int kSegments = PhaseTimes::Phase("daemon.cache.page segments");
  static const int kBackend = PhaseTimes::Phase("daemon.cache.backend attend");
  PhaseLap lap;
  const int32_t ps = spec_.page_size;
  const bool append = !new_tokens.tokens.empty();
  // Lock in id order so concurrent batches sharing sequences cannot deadlock.
  std::vector<Sequence*> order(seqs.begin(), seqs.end());
  std::sort(order.begin(), order.end(),
            [](const Sequence* a, const Sequence* b) { return a->id < b->id; });
  std::vector<std::unique_lock<std::mutex>> locks;
  locks.reserve(order.size());
  for (Sequence* s : order) locks.emplace_back(s->mu);

  for (Sequence* s : seqs) {
    if (s->closed) {
      return absl::FailedPreconditionError(absl::StrCat("sequence ", s->id, " is closed"));
    }
    if (append && s->layer_len[layer] != s->length()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", s->id, ": layer ", layer, " already holds token ", s->layer_len[layer] - 1,
          "; send the other layers' k_new/v_new before the next token"));
    }
  }
  // What the append did to each sequence, to take it back if the attention fails.
  struct Undo {
    bool pushed_page = false;
    bool committed = false;
    int32_t pending_token = 0;
    int64_t next_demote_page = 0;
    std::vector<Demotion> demotions;
  };
  std::vector<Undo> undo(append ? seqs.size() : 0);
  lap.Mark(kLock);
  if (append) {
    // All-or-nothing: allocate every page the batch needs, then write every row.
    // A sequence at a page boundary needs a page, owned by its tenant.
    std::vector<TenantNeed> needs;
    for (Sequence* s : seqs) {
      if (s->layer_len[layer] == static_cast<int64_t>(s->pages.size()) * ps) {
        needs.push_back({&s->salt, 1});
      }
    }
    std::vector<PageRef> fresh;
    if (!needs.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      KVCD_RETURN_IF_ERROR(AllocateLocked(kWindow, needs, &fresh));
    }
    std::vector<RowSlot> slots;
    size_t next_fresh = 0;
    for (size_t b = 0; b < seqs.size(); ++b) {
      const Sequence* s = seqs[b];
      const int64_t pos = s->layer_len[layer];
      const size_t page = static_cast<size_t>(pos / ps);
      const PageRef& r = page < s->pages.size() ? s->pages[page] : fresh[next_fresh++];
      slots.push_back({static_cast<int64_t>(b), r.page, static_cast<int32_t>(pos % ps)});
    }
    // Device rows of a pipelined call: a NaN/±Inf marks its sequence (Sequence::device_fault)
    // instead of failing the call, which does not wait for its kernels.
    RowSource k = new_tokens.k, v = new_tokens.v;
    RowSource x = new_tokens.x != nullptr ? *new_tokens.x : RowSource{};
    std::vector<kernels::DeviceFault> faults;
    if (PipelinedFaults(seqs, layer, k, v, new_tokens.x, &faults)) {
      k.device_faults = v.device_faults = x.device_faults = faults.data();
      k.row_stream = v.row_stream = backend_->row_stream();
    }
    const PageStore& window = stores_[kWindow];
    absl::Status written = window.format->WriteRows(k, v, slots, layer, *window.pool);
    if (written.ok())
      written = WriteCodes(kWindow, new_tokens.x != nullptr ? &x : nullptr, slots, layer);
    if (!written.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      FreeLocked(fresh);
      return written;
    }
    // The rows are in place: the lengths grow, a completed token is committed and what aged
    // out of the recent window is demoted, all so that attention sees them; but until the
    // attention succeeded every step can be taken back (demoted pages keep their window
    // page): a failed launch leaves the sequences as they were (all-or-nothing).
    next_fresh = 0;
    for (size_t b = 0; b < seqs.size(); ++b) {
      Sequence* s = seqs[b];
      Undo& u = undo[b];
      u.pending_token = s->pending_token;
      u.next_demote_page = s->next_demote_page;
      if (s->layer_len[layer] == static_cast<int64_t>(s->pages.size()) * ps) {
        s->pages.push_back(fresh[next_fresh++]);
        u.pushed_page = true;
      }
      const int64_t before = s->length();
      if (std::all_of(s->layer_len.begin(), s->layer_len.end(),
                      [&](int64_t l) { return l == before; })) {
        s->pending_token = new_tokens.tokens[b];
      }
      ++s->layer_len[layer];
      if (s->length() > before) {  // the token is complete: commit it, demote what aged out
        s->tokens.push_back(s->pending_token);
        u.committed = true;
        DemotePages(s, &u.demotions);
      }
    }
  }

  lap.Mark(kStore);
  AttentionBatch batch;
  batch.layer = layer;
  batch.num_q_heads = spec_.num_q_heads;
  batch.num_kv_heads = spec_.num_kv_heads;
  batch.head_dim = spec_.head_dim;
  batch.page_size = ps;
  batch.softmax_scale = softmax_scale;
  batch.model_format = stores_[kWindow].format.get();
  const int64_t q_stride = int64_t{spec_.num_q_heads} * spec_.head_dim;
  lengths->clear();
  for (size_t b = 0; b < seqs.size(); ++b) {
    AttentionJob job;
    job.fault = seqs[b]->device_fault.AtLayer(layer);
    const int64_t len = seqs[b]->layer_len[layer];
    job.segments = Segments(*seqs[b], len);
    if (device == nullptr) {
      job.q = q + static_cast<int64_t>(b) * q_stride;
      job.o = o + static_cast<int64_t>(b) * q_stride;
      job.lse = lse + static_cast<int64_t>(b) * spec_.num_q_heads;
    }
    batch.jobs.push_back(std::move(job));
    lengths->push_back(len);
  }
  if (device != nullptr) {
    batch.device_q = device->q;
    batch.device_q_bf16 = device->q_bf16;
    batch.device_o = device->o;
    batch.device_lse = device->lse;
  }
  counters_->attention_calls.fetch_add(1, std::memory_order_relaxed);
  lap.Mark(kSegments);
  const absl::Status attended = backend_->Attend(batch);
  lap.Mark(kBackend);
  if (!append) return attended;
  std::vector<PageRef> to_free;
  if (attended.ok()) {  // final: the demoted pages' window copies go
    for (const Undo& u : undo) {
      for (const Demotion& d : u.demotions) to_free.push_back(d.window);
    }
    demoted_pages_.fetch_add(to_free.size());
    counters_->demoted_pages.fetch_add(to_free.size());
  } else {  // take the append back; its rows stay behind the lengths, where nothing reads them
    for (size_t b = seqs.size(); b-- > 0;) {
      Sequence* s = seqs[b];
      const Undo& u = undo[b];
      for (const Demotion& d : u.demotions) {
        s->pages[static_cast<size_t>(d.index)] = d.window;
        if (!d.from_tree) to_free.push_back(d.history);
      }
      s->next_demote_page = u.next_demote_page;
      if (u.committed) s->tokens.pop_back();
      s->pending_token = u.pending_token;
      --s->layer_len[layer];
      if (u.pushed_page) {
        to_free.push_back(s->pages.back());
        s->pages.pop_back();
      }
    }
  }
  if (!to_free.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    FreeLocked(to_free);
  }
  return attended;
}

}  // namespace kvcd
