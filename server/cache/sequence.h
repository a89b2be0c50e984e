// Sequence: one decode stream's state, three-segment layout (docs/architecture.md "The cache").
//
// Page i holds tokens [i*page_size, (i+1)*page_size) of every layer. Pages
// [0, shared_pages) are the tree's: the prefix the sequence was opened on or has since
// committed (docs/sessions.md), pinned at `pinned` while the sequence lives; the rest are
// its own. One exception below shared_pages: a page the sequence committed while it was
// still in its BF16 recent window at a history position entered the tree as a
// history-format copy (listed in window_copies), and the sequence keeps its own BF16 page
// there until the page leaves the window, when it takes the tree's copy instead of
// demoting (the two are the same bytes: the copy was made by the same Demote).
// Own pages in the sink (i < sink_pages) and in the recent window stay BF16; a full own
// page whose tokens have all left the recent window is demoted to the history format.
// Own pages are reference-counted by ModelCache: a fork (ForkSequence) shares every full
// own page of its source; the partial last page is never shared. Nothing writes a full
// page, so sharing needs no copy on write.
//
// Per-layer lengths allow the per-layer decode loop: AttentionDecode with k_new/v_new
// appends one token at one layer; the token is committed (length() grows) once every
// layer holds it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "server/backends/device_fault_words.h"
#include "server/cache/radix_tree.h"

namespace kvcd {

class ModelCache;

struct Sequence {
  Sequence(uint64_t id_in, ModelCache* model_in, std::string salt_in)
      : id(id_in), model(model_in), salt(std::move(salt_in)) {}

  const uint64_t id;
  ModelCache* const model;
  const std::string salt;

  std::mutex mu;  // serializes Append / AttentionDecode / Fetch / Close of this sequence
  bool closed ABSL_GUARDED_BY(mu) = false;
  RadixTree::Node* pinned ABSL_GUARDED_BY(mu) = nullptr;  // pinned prefix node, or null
  int64_t shared_pages ABSL_GUARDED_BY(mu) = 0;
  std::vector<PageRef> pages ABSL_GUARDED_BY(mu);
  // Pages below shared_pages whose tree page is a history-format copy of the sequence's
  // own BF16 window page: pages[index] is that own page while pages[index] != tree, and
  // the tree's page once it has left the recent window (the entry is stale then, and
  // dropped at the next commit).
  struct WindowCopy {
    int64_t index;
    PageRef tree;
  };
  std::vector<WindowCopy> window_copies ABSL_GUARDED_BY(mu);
  std::vector<int64_t> layer_len ABSL_GUARDED_BY(mu);  // tokens held per layer
  std::vector<int32_t> tokens ABSL_GUARDED_BY(mu);     // committed token ids
  int32_t pending_token ABSL_GUARDED_BY(mu) = 0;       // id of a partly appended token
  int64_t next_demote_page ABSL_GUARDED_BY(mu) = 0;    // pages below are final

  // Backends with a device: set when a pipelined call's kernel met a NaN/±Inf in this
  // sequence's device inputs (device_fault_words.h); from then on the sequence answers
  // INVALID_ARGUMENT. Set at Open (not held when none could be had), released at Close.
  DeviceFaultWords device_fault;

  // Lease: the sequence is reclaimed once now > deadline_ns (steady clock).
  std::atomic<int64_t> lease_ms{0};
  std::atomic<int64_t> deadline_ns{0};

  int64_t length() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return layer_len.empty() ? 0 : *std::min_element(layer_len.begin(), layer_len.end());
  }
};

// The open sequences a request names, in its order, as the check that ran before routing
// found them (server/rpc/authorizer.h), handed on so that the engine does not look them up
// a second time; empty: the engine looks them up itself.
using FoundSequences = std::vector<std::shared_ptr<Sequence>>;

}  // namespace kvcd
