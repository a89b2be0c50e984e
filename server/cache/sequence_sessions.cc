// ModelCache's session operations on a sequence (docs/sessions.md): Commit puts its full
// pages into the prefix cache, Fork starts a second sequence on the same pages.

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/backends/device_runtime.h"
#include "server/cache/model_cache.h"

namespace kvcd {

absl::Status ModelCache::CheckWhole(const Sequence& seq, const char* what) {
  if (seq.closed) {
    return absl::NotFoundError(absl::StrCat(
        "sequence ", seq.id, " is not open (never opened, closed, or its lease expired)"));
  }
  const auto [lo, hi] = std::minmax_element(seq.layer_len.begin(), seq.layer_len.end());
  if (lo != seq.layer_len.end() && *lo != *hi) {
    // Name the layers still waiting for the token.
    std::string missing;
    int32_t count = 0;
    for (size_t l = 0; l < seq.layer_len.size(); ++l) {
      if (seq.layer_len[l] != *lo) continue;
      if (count++ < 8) absl::StrAppend(&missing, missing.empty() ? "" : ", ", l);
    }
    if (count > 8) absl::StrAppend(&missing, " and ", count - 8, " more");
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", seq.id, " is in the middle of a per-layer decode step: token ", *hi - 1,
        " is not yet appended at layer ", missing, " (of ", seq.layer_len.size(),
        "); send k_new/v_new for those layers through AttentionDecode before the ", what));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelCache::CommitResult> ModelCache::Commit(Sequence* seq, bool close) {
  const int32_t ps = spec_.page_size;
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  KVCD_RETURN_IF_ERROR(CheckWhole(*seq, close ? "close with commit" : "commit"));
  const int64_t len = seq->length();
  const int64_t full = len / ps;
  const int64_t first = seq->shared_pages;
  CommitResult result;
  result.length = len;
  // The page the tree is to hold at each position: the tree's own below `first` (the
  // history-format twin for a live window copy), else the sequence's page, or a
  // history-format copy of it where the sequence holds a BF16 window page at a history
  // position (StoreForPage: the tree's invariant).
  std::vector<PageRef> tree_pages(seq->pages.begin(), seq->pages.begin() + full);
  for (const Sequence::WindowCopy& w : seq->window_copies) {
    tree_pages[static_cast<size_t>(w.index)] = w.tree;
  }
  std::vector<int64_t> copy_at;
  std::vector<int32_t> window_ids;
  for (int64_t i = first; i < full; ++i) {
    if (seq->pages[static_cast<size_t>(i)].pool != StoreForPage(i)) {
      copy_at.push_back(i);
      window_ids.push_back(seq->pages[static_cast<size_t>(i)].page);
    }
  }
  std::vector<PageRef> copies;
  if (!copy_at.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    KVCD_RETURN_IF_ERROR(
        AllocateLocked(HistoryStore(), seq->salt, static_cast<int64_t>(copy_at.size()), &copies));
  }
  if (!copies.empty()) {
    // Outside mu_: the copies are private until the tree gets them. The same re-encoding
    // DemotePages applies, so the tree holds what a later demotion of the page would.
    std::vector<int32_t> copy_ids;
    for (const PageRef& r : copies) copy_ids.push_back(r.page);
    const PageStore& history = stores_[HistoryStore()];
    const absl::Status s =
        history.format->Demote(*stores_[kWindow].pool, window_ids, *history.pool, copy_ids);
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      FreeLocked(copies);
      return absl::Status(s.code(), absl::StrCat("sequence ", seq->id,
                                                 ": the history-format copy of its window pages "
                                                 "failed; nothing was committed: ",
                                                 s.message()));
    }
    for (size_t k = 0; k < copy_at.size(); ++k) {
      tree_pages[static_cast<size_t>(copy_at[k])] = copies[k];
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  const auto tokens = absl::MakeConstSpan(seq->tokens).subspan(0, static_cast<size_t>(full * ps));
  // The chunks the tree holds already are a prefix of the path: [0, held) (at least the
  // pinned [0, first)); Insert adds [held, full).
  const int64_t held = tree_.Match(seq->salt, tokens).tokens / ps;
  const RadixTree::InsertResult ins =
      tree_.Insert(seq->salt, tokens, tree_pages, RadixTree::Origin::kCommit);
  // The tree's pages for the whole committed prefix, pinned for the sequence (its old pin
  // is on an ancestor, so nothing of it was evictable in between).
  const RadixTree::MatchResult m = tree_.MatchAndPin(seq->salt, tokens);
  tree_.Unpin(seq->pinned);
  seq->pinned = m.node;
  std::vector<PageRef> to_free;
  size_t next_copy = 0;
  for (int64_t i = first; i < full; ++i) {
    const PageRef tree = m.pages[static_cast<size_t>(i)];
    PageRef& own = seq->pages[static_cast<size_t>(i)];
    const bool dedup = i < held;
    result.deduplicated_pages += dedup ? 1 : 0;
    if (next_copy < copy_at.size() && copy_at[next_copy] == i) {
      // The sequence keeps its BF16 page for its window; the tree holds the copy, or its
      // own page where it had the chunk already (then the copy goes).
      const PageRef copy = copies[next_copy++];
      if (dedup) to_free.push_back(copy);
      seq->window_copies.push_back({i, tree});
    } else if (dedup) {
      // The tree had the chunk: the sequence uses the tree's page (same store, same
      // position) and lets go of its own (a fork may still hold it; it may even be the
      // tree's page already, when a fork's source committed it: then only the
      // sequence's reference goes).
      to_free.push_back(own);
      own = tree;
    }
    // else the tree took the page over, with the sequence's reference to it.
  }
  FreeLocked(to_free);
  seq->shared_pages = full;
  seq->window_copies.erase(std::remove_if(seq->window_copies.begin(), seq->window_copies.end(),
                                          [&](const Sequence::WindowCopy& w) {
                                            return seq->pages[static_cast<size_t>(w.index)] ==
                                                   w.tree;
                                          }),
                           seq->window_copies.end());
  result.committed_tokens = static_cast<int64_t>(m.pages.size()) * ps;
  result.inserted_pages = ins.new_pages;
  counters_->inserted_pages.fetch_add(static_cast<uint64_t>(ins.new_pages));
  if (close) {
    CloseLocked(seq);
  } else {
    EvictToWatermarksLocked(seq->salt);  // the committed prefix is pinned by the sequence
  }
  return result;
}

absl::StatusOr<std::shared_ptr<Sequence>> ModelCache::Fork(uint64_t id, Sequence* src) {
  const int32_t ps = spec_.page_size;
  std::lock_guard<std::mutex> src_lock(src->mu);
  KVCD_RETURN_IF_ERROR(CheckWhole(*src, "fork"));
  const int64_t len = src->length();
  const bool partial = len % ps != 0;
  std::vector<PageRef> fresh;
  if (partial) {
    const PageRef last = src->pages.back();
    {
      std::lock_guard<std::mutex> lock(mu_);
      KVCD_RETURN_IF_ERROR(AllocateLocked(last.pool, src->salt, 1, &fresh));
    }
    // The partial page is copied whole (its slots past the length are never read).
    const PagePool& pool = *stores_[last.pool].pool;
    std::string bytes(static_cast<size_t>(pool.page_bytes()), '\0');
    absl::Status s =
        backend_->ReadPages(pool, {last.page}, reinterpret_cast<uint8_t*>(bytes.data()), false);
    if (s.ok()) {
      s = backend_->WritePages(pool, {fresh[0].page},
                               reinterpret_cast<const uint8_t*>(bytes.data()), false);
    }
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      FreeLocked(fresh);
      return s;
    }
  }
  auto seq = std::make_shared<Sequence>(id, this, src->salt);
  if (DeviceRuntime* device = backend_->device(); device != nullptr) {
    if (auto words = device->AcquireFaultWords(); words.ok()) seq->device_fault = *words;
  }
  std::lock_guard<std::mutex> seq_lock(seq->mu);  // nobody else can see it yet
  std::lock_guard<std::mutex> lock(mu_);
  tree_.Pin(src->pinned);
  seq->pinned = src->pinned;
  seq->shared_pages = src->shared_pages;
  seq->pages = src->pages;
  seq->window_copies = src->window_copies;
  std::vector<PageRef> shared = OwnPages(*src);
  if (partial) {
    shared.erase(std::find(shared.begin(), shared.end(), src->pages.back()));
    seq->pages.back() = fresh[0];
  }
  for (const PageRef& r : shared) owners_->Share(r);
  seq->layer_len = src->layer_len;
  seq->tokens = src->tokens;
  seq->next_demote_page = src->next_demote_page;
  open_sequences_.fetch_add(1);
  counters_->forks.fetch_add(1);
  return seq;
}

}  // namespace kvcd
