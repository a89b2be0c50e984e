// ModelCache: everything kvcd holds for one model profile — its page stores (one per page
// format: the BF16 window and, when the history is stored differently, the history
// format), its radix tree (namespaced by tenant) and its sequences' pages — and the
// operations on them. It decides which pages exist and where they go; what a page holds
// and how it is written, checked, read and attended is the formats' business
// (server/formats), run by the backend.
//
// Callers (CacheEngine) validate request shapes first; ModelCache re-checks only what
// depends on its state. Every operation either fully succeeds or changes nothing that
// was stored (pages allocated for a failed call are returned to the pool).
//
// The sequence write paths (Append, Attend's fused append and its undo, DemotePages) are
// defined in sequence_writes.cc; Commit and Fork in sequence_sessions.cc; the reads (Fetch,
// FetchStored, StoredBytes, FetchStoredToDevice, Length) in sequence_reads.cc; page
// ownership and reference counts are PageOwners' (page_owners.h); allocation, eviction,
// Put/PushPages, Open/Close and pins in model_cache.cc.
//
// Thread safety: all methods are thread-safe. Lock order: Sequence::mu before mu_.
// Attention runs holding only the sequences' locks: their pages are pinned or private,
// so eviction cannot free them.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/backends/backend.h"
#include "server/cache/block_observer.h"
#include "server/cache/page_owners.h"
#include "server/cache/radix_tree.h"
#include "server/cache/sequence.h"
#include "server/formats/format_registry.h"
#include "server/formats/model_spec.h"
#include "server/formats/page_format.h"
#include "server/formats/page_pool.h"

namespace kvcd {

// Engine-wide counters (monotonic), shared by all models; read by Stats and /metrics.
struct CacheCounters {
  std::atomic<uint64_t> hit_tokens{0};   // tokens found cached (Put, OpenSequence)
  std::atomic<uint64_t> miss_tokens{0};  // tokens looked up and not cached
  // Of hit_tokens, those served by pages a commit inserted (the rest: Put / PushPages).
  std::atomic<uint64_t> hit_tokens_committed{0};
  std::atomic<uint64_t> inserted_pages{0};
  std::atomic<uint64_t> evicted_pages{0};
  std::atomic<uint64_t> evicted_pages_committed{0};  // of evicted_pages, committed ones
  std::atomic<uint64_t> forks{0};                    // sequences forked
  std::atomic<uint64_t> demoted_pages{0};
  std::atomic<uint64_t> expired_leases{0};
  std::atomic<uint64_t> expired_buffers{0};  // CUDA IPC buffers dropped by lease expiry
  std::atomic<uint64_t> attention_calls{0};
};

struct PoolSnapshot {
  std::string format;
  int64_t page_bytes = 0;
  int32_t pages_total = 0;
  int32_t pages_used = 0;
};

// The pages one tenant holds in each pool (the order of ModelSnapshot::pools), and the
// most its memory share lets it hold there (INT64_MAX: no limit).
struct TenantPagesSnapshot {
  std::string tenant;
  std::vector<int64_t> pages;
  std::vector<int64_t> limit;
};

struct ModelSnapshot {
  std::vector<PoolSnapshot> pools;
  std::vector<TenantPagesSnapshot> tenants;  // tenants holding pages, by name
  int64_t cached_tokens = 0;
  int64_t committed_pages = 0;  // tree pages a commit inserted
  int64_t pinned_pages = 0;
  int64_t active_sequences = 0;
  std::string codec;
  double bf16_bytes_per_token = 0;     // sink and recent segments (as stored)
  double history_bytes_per_token = 0;  // history segment
  double history_bits_per_element = 0;
  double compression_ratio = 1;  // dense BF16 bytes of pooled tokens / bytes in use
  uint64_t demoted_pages = 0;
};

struct PutResult {
  int64_t cached_tokens = 0;
  int64_t inserted_tokens = 0;
  int64_t ignored_tokens = 0;
};

class ModelCache {
 public:
  // Creates the model's formats for `backend` and allocates their pools (once). The codec
  // and formats come from the factory of spec.history_format (LoadModelCodec in
  // server/formats/format_registry.h: codec_blob, else spec.codec_file, else what the spec
  // names): INVALID_ARGUMENT naming the model and codec_blob or codec_file when the codec
  // does not load or match the spec; INVALID_ARGUMENT if memory_bytes holds no page;
  // UNIMPLEMENTED for a history format the backend cannot store. RESOURCE_EXHAUSTED, before
  // anything is allocated, if the pools would really take (Backend::PoolAllocationBytes,
  // rounding included) more than allocation_limit bytes; the message says the limit is
  // `limit_what` (default: the unassigned memory_budget).
  static absl::StatusOr<std::unique_ptr<ModelCache>> Create(
      const ModelSpec& spec, Backend* backend, double high_watermark, double low_watermark,
      CacheCounters* counters, const std::string& codec_blob = "",
      uint64_t allocation_limit = UINT64_MAX, const std::string& limit_what = "");
  // The same with the codec already loaded (LoadModelCodec(spec, ...)): a caller that holds
  // a lock parses the codec file before taking it.
  static absl::StatusOr<std::unique_ptr<ModelCache>> Create(
      const ModelSpec& spec, Backend* backend, double high_watermark, double low_watermark,
      CacheCounters* counters, std::unique_ptr<const ModelCodec> codec,
      uint64_t allocation_limit = UINT64_MAX, const std::string& limit_what = "");
  ~ModelCache();

  // Bytes the pools really hold (each pool's size rounded by the backend).
  uint64_t allocated_bytes() const { return allocated_bytes_; }

  // Memory shares: every page is owned by the tenant (cache_salt) whose Put, PushPages,
  // Append or fused append created it. A tenant may hold at most floor(share * pages) of
  // each pool, share = share_of(tenant) (>= 1: no limit). A tenant that would go past its
  // share evicts only its own unpinned pages, and when those are too few the call fails
  // RESOURCE_EXHAUSTED naming the tenant, its share and its usage, having evicted nothing;
  // below its share it evicts by LRU over every tenant. Without a function every share is
  // 1. REQUIRES: called before the cache is shared with other threads.
  using MemoryShareFn = std::function<double(const std::string& tenant)>;
  void set_memory_shares(MemoryShareFn share_of) { share_of_ = std::move(share_of); }

  const ModelSpec& spec() const { return spec_; }

  // Tells `observer` of every full page entering or leaving this model's tree, named by
  // its block hash (block_observer.h); nullptr: nobody. REQUIRES: called before the cache is
  // shared with other threads.
  void set_block_observer(BlockObserver* observer);
  // Tells `to` that every page of the tree entered (one observer that lost track: a
  // restarted index, a lost membership).
  void ReplayBlocks(BlockObserver* to);
  // The history format as the cluster names blocks (bf16, int2-oscar, int2-transform, fsq).
  std::string BlockFormat() const;

  // Stores the full pages of a prompt. k, v: [num_layers][tokens.size() - kv_first][kv][d]
  // hold tokens [kv_first, tokens.size()); tokens [0, kv_first) must already be cached
  // (FAILED_PRECONDITION otherwise). RESOURCE_EXHAUSTED when the pools cannot hold the
  // new pages even after eviction. x: the residuals of the same tokens
  // ([num_layers][tokens][C]), REQUIRED for FSQ models (null otherwise).
  absl::StatusOr<PutResult> Put(const std::string& salt, absl::Span<const int32_t> tokens,
                                int64_t kv_first, const RowSource& k, const RowSource& v,
                                const RowSource* x = nullptr);

  struct StoredPageIn {
    std::string format;
    absl::string_view data;  // [num_layers][page-layer bytes]
  };
  // Stores pages already in the model's storage format for tokens [first_page * page_size,
  // (first_page + pages.size()) * page_size); the prefix before them must be cached
  // (FAILED_PRECONDITION). INVALID_ARGUMENT for a wrong format, size or invalid value.
  absl::StatusOr<PutResult> PushPages(const std::string& salt, absl::Span<const int32_t> tokens,
                                      int64_t first_page, absl::Span<const StoredPageIn> pages);

  // PushPages from device memory (CUDA IPC mapping or NCCL staging): `src` holds num_pages
  // pages back to back, page i in the format stored at position first_page + i. Every
  // page is checked on the device before anything is allocated: INVALID_ARGUMENT and
  // nothing stored otherwise.
  absl::StatusOr<PutResult> PushDevicePages(const std::string& salt,
                                            absl::Span<const int32_t> tokens, int64_t first_page,
                                            int64_t num_pages, const uint8_t* src);
  // Bytes (all layers) of the page stored at position page_index of a prefix, and the
  // largest page of any format.
  int64_t StoredPageBytes(int64_t page_index) const;
  int64_t MaxPageBytes() const;

  // Page-aligned longest cached prefix, in tokens (no pinning); with committed_tokens,
  // also how many of them are in pages a commit inserted.
  int64_t Match(const std::string& salt, absl::Span<const int32_t> tokens,
                int64_t* committed_tokens = nullptr);

  // Creates a sequence on the longest cached prefix of `tokens` (pinned).
  std::shared_ptr<Sequence> Open(uint64_t id, const std::string& salt,
                                 absl::Span<const int32_t> tokens);

  // Releases pins and private pages. Idempotent.
  void Close(Sequence* seq);

  struct CommitResult {
    int64_t committed_tokens = 0;    // page-aligned tokens of the sequence in the tree now
    int64_t inserted_pages = 0;      // pages this call added to the tree
    int64_t deduplicated_pages = 0;  // full pages the tree held already
    int64_t length = 0;              // the sequence's length
  };
  // Inserts the sequence's full pages into the tree under its salt (origin kCommit), keyed
  // by its token ids; docs/sessions.md. Pages it holds from the tree stay as they are;
  // an own page whose chunk the tree already holds is freed and the sequence uses the
  // tree's page; other own pages in the store StoreForPage names move to the tree; an own
  // BF16 window page at a history position enters as a history-format copy made by the
  // format's Demote, the sequence keeping its BF16 page (Sequence::window_copies). The
  // partial last page stays the sequence's. Afterwards pages [0, committed) are pinned
  // tree pages. With `close`, the sequence is then closed in the same critical section.
  // NOT_FOUND if the sequence is closed; FAILED_PRECONDITION naming the layers while a
  // per-layer token is pending; RESOURCE_EXHAUSTED when the copies do not fit (nothing
  // changed then).
  absl::StatusOr<CommitResult> Commit(Sequence* seq, bool close = false);

  // A new sequence `id` sharing every full page of `src` (the tree's pinned once more,
  // its own reference-counted) with a copy of its partial last page. NOT_FOUND if `src`
  // is closed, FAILED_PRECONDITION naming the layers while a per-layer token is pending,
  // RESOURCE_EXHAUSTED if the partial page cannot be had (nothing changed then).
  absl::StatusOr<std::shared_ptr<Sequence>> Fork(uint64_t id, Sequence* src);

  // A prefix pin (PinPrefix): the longest cached page-aligned prefix of `tokens`, pinned
  // in the tree so that eviction skips it (and its ancestors) until UnpinPrefix(node).
  struct PinnedPrefix {
    RadixTree::Node* node = nullptr;
    int64_t tokens = 0;
    int64_t pages = 0;
  };
  // NOT_FOUND naming the model and salt when not one page of `tokens` is cached. Before
  // pinning, `admit(pages)` is asked (the tenant's quota); its error is returned and nothing
  // is pinned. Runs under the cache's lock: `admit` must not call back into this cache.
  absl::StatusOr<PinnedPrefix> PinPrefix(const std::string& salt, absl::Span<const int32_t> tokens,
                                         const std::function<absl::Status(int64_t pages)>& admit);
  // Releases a pin of PinPrefix; its pages are ordinary LRU pages again.
  void UnpinPrefix(RadixTree::Node* node);

  // Appends n tokens (all layers). FAILED_PRECONDITION if the sequence is closed or a
  // per-layer token is pending; RESOURCE_EXHAUSTED if no page is available.
  // x: residuals [num_layers][n][C], REQUIRED for FSQ models (null otherwise).
  absl::StatusOr<int64_t> Append(Sequence* seq, absl::Span<const int32_t> tokens,
                                 const RowSource& k, const RowSource& v,
                                 const RowSource* x = nullptr);

  // A new token of the fused append: its rows at one layer. k, v hold the batch's rows
  // ([B][num_kv_heads][head_dim], host or device); sequence b's are token b.
  struct NewTokens {
    absl::Span<const int32_t> tokens;  // [B] token ids; empty = no append
    RowSource k, v;
    const RowSource* x = nullptr;  // FSQ models: residuals [B][C] (REQUIRED there)
  };
  // Queries and results in device memory (CUDA IPC) instead of host arrays.
  struct DeviceIo {
    const void* q = nullptr;
    bool q_bf16 = false;
    float* o = nullptr;
    float* lse = nullptr;
  };
  // Attention of one layer for a batch of distinct open sequences of this model.
  // New tokens' device rows (on_device, check_finite) are checked by the store kernel: when
  // every sequence holds fault words the call does not wait for it (a NaN/±Inf row is
  // stored as zeros and sets the sequence's Sequence::device_fault, and the call's outputs
  // for that sequence are NaN); otherwise the store is synchronous and a bad row fails the
  // call with INVALID_ARGUMENT, its fresh pages freed.
  // q: [B][num_q_heads][head_dim] float; o: [B][num_q_heads][head_dim]; lse: [B][num_q_heads].
  // With new tokens, each sequence first receives its token at this layer.
  // With `device` set, q / o / lse are unused.
  absl::Status Attend(int32_t layer, absl::Span<Sequence* const> seqs, const float* q,
                      float softmax_scale, const NewTokens& new_tokens, float* o, float* lse,
                      std::vector<int64_t>* lengths, const DeviceIo* device = nullptr);

  // BF16 K/V of tokens [first, first + n) of a sequence, [num_layers][n][kv][d] each, in
  // the original (unrotated) space; pages of other formats are expanded.
  absl::Status Fetch(Sequence* seq, int64_t first, int64_t n, uint16_t* k_out, uint16_t* v_out,
                     std::vector<std::string>* page_formats);
  struct StoredPageCopy {
    std::string format;
    int64_t first_token = 0;
    int32_t num_tokens = 0;
    int64_t bytes = 0;  // of the page, all layers
    std::string data;   // [num_layers][page-layer bytes] (FetchStored)
  };
  // The pages covering tokens [first, first + n), as stored. REQUIRES: first page-aligned.
  absl::Status FetchStored(Sequence* seq, int64_t first, int64_t n,
                           std::vector<StoredPageCopy>* pages);

  // Bytes of the pages covering tokens [first, first + n) as they are stored now.
  absl::StatusOr<int64_t> StoredBytes(Sequence* seq, int64_t first, int64_t n);

  // The same pages copied back to back into device memory `dst` (pages[i].data stays
  // empty); the copy is queued on the device before the sequence is unlocked.
  absl::Status FetchStoredToDevice(Sequence* seq, int64_t first, int64_t n, uint8_t* dst,
                                   int64_t dst_bytes, std::vector<StoredPageCopy>* pages);

  // Length of a sequence (committed tokens).
  int64_t Length(Sequence* seq);

  ModelSnapshot Snapshot() const;

 private:
  // The per-token fault targets of a pipelined fused append (see Attend); false when the
  // rows (k, v and, for FSQ models, the residuals x, null otherwise) need no device check
  // or a sequence holds no fault words.
  static bool PipelinedFaults(absl::Span<Sequence* const> seqs, int32_t layer, const RowSource& k,
                              const RowSource& v, const RowSource* x,
                              std::vector<kernels::DeviceFault>* faults);

  // One format's pages: the format (created by the backend) and its pool.
  struct PageStore {
    std::unique_ptr<PageFormat> format;
    std::unique_ptr<PagePool> pool;
    uint8_t* memory = nullptr;
    uint64_t bytes = 0;
  };
  static constexpr int32_t kWindow = 0;  // stores_[0]: the BF16 window format

  ModelCache(const ModelSpec& spec, Backend* backend, double high, double low,
             CacheCounters* counters);

  // The store of the history; the window store when the history has no format of its own.
  int32_t HistoryStore() const { return static_cast<int32_t>(stores_.size()) - 1; }
  bool DemotesHistory() const { return HistoryStore() != kWindow; }
  // The store that holds page `page_index` of a prefix (sink pages stay in the window).
  int32_t StoreForPage(int64_t page_index) const;
  const PageFormat& FormatOf(const PageRef& r) const { return *stores_[r.pool].format; }
  const PagePool& PoolOf(const PageRef& r) const { return *stores_[r.pool].pool; }

  // Writes fresh pages: `first_page` is the prefix position of pages[0]; all pages belong
  // to one store.
  using PageWriter =
      std::function<absl::Status(int64_t first_page, int32_t store, absl::Span<const int32_t>)>;
  // The common path of Put and PushPages: pins the cached prefix of the first full_pages
  // pages (at least required_pages of them must be cached), allocates the missing pages in
  // their stores, lets `write` fill each run of one store, then publishes them. A failing
  // write frees the new pages and publishes nothing.
  absl::StatusOr<PutResult> StorePrefix(const std::string& salt, absl::Span<const int32_t> tokens,
                                        int64_t full_pages, int64_t required_pages,
                                        const PageWriter& write);
  // Pages one call needs in one store for one tenant.
  struct TenantNeed {
    const std::string* tenant;
    int64_t pages;
  };
  // OK if the needs can be had in store `store` (free pages, the tenants' own pages for a
  // tenant that would pass its share, else unpinned pages of anyone, LRU); RESOURCE_EXHAUSTED
  // otherwise. Evicts nothing. The needs are met in the order AllocateLocked meets them:
  // tenants that would pass their share first (each evicts only its own pages), then the
  // others.
  absl::Status CheckFitsLocked(int32_t store, absl::Span<const TenantNeed> needs) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stores the codes of `rows` (every layer, or one) in store `store` when its format keeps
  // residual codes; INVALID_ARGUMENT when it does and x is null.
  absl::Status WriteCodes(int32_t store, const RowSource* x, absl::Span<const RowSlot> rows,
                          int32_t layer) const;
  // Allocates the needs' pages in store `store` (appended to *out in the order of `needs`)
  // and records their owners, evicting as CheckFitsLocked describes; when they cannot be
  // had, fails before evicting anything.
  absl::Status AllocateLocked(int32_t store, absl::Span<const TenantNeed> needs,
                              std::vector<PageRef>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AllocateLocked(int32_t store, const std::string& tenant, int64_t n,
                              std::vector<PageRef>* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const TenantNeed need{&tenant, n};
    return AllocateLocked(store, absl::MakeConstSpan(&need, 1), out);
  }
  // Returns pages to their pools and their owners' counts.
  // Drops one reference to each page; a page goes back to its pool (and its owner's
  // count) when its last holder lets it go.
  void FreeLocked(absl::Span<const PageRef> pages) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pages only `seq` holds references to among its pages (not the tree's): pages
  // [shared_pages, end) and its live window copies.
  static std::vector<PageRef> OwnPages(const Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Close's work, with both locks held.
  void CloseLocked(Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq->mu, mu_);
  // OK if `seq` is open and no per-layer token is pending (`what` names the call).
  static absl::Status CheckWhole(const Sequence& seq, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Brings each pool under the low watermark once it is over the high one, after a Put of
  // `tenant`: evicting only the tenant's pages where it is at its share.
  void EvictToWatermarksLocked(const std::string& tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts unpinned pages (LRU; only `tenant`'s when set) while want_more().
  void EvictLocked(const std::function<bool()>& want_more, const std::string* tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pages of store `store` that `tenant` holds, and the most its share lets it hold.
  int64_t HeldLocked(const std::string& tenant, int32_t store) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t ShareLimit(const std::string& tenant, int32_t store) const;
  // A demotion not final yet: page `index` of a sequence now refers to `history`, and its
  // `window` page is kept until the caller commits (frees it) or reverts (puts it back).
  // from_tree: `history` is the tree's copy of a committed window page (Sequence::
  // window_copies), not a fresh page: reverting does not free it.
  struct Demotion {
    int64_t index;
    PageRef window, history;
    bool from_tree = false;
  };
  // Demotes every private window page of `seq` that has left the recent window. With
  // `deferred`, the window pages are kept and listed there (and not counted yet).
  void DemotePages(Sequence* seq, std::vector<Demotion>* deferred = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq->mu);
  std::vector<AttentionSegment> Segments(const Sequence& seq, int64_t len) const;
  // OK if tokens [first, first + n) of an open sequence can be read.
  absl::Status CheckReadable(const Sequence& seq, int64_t first, int64_t n) const;
  // Reads the pages covering [first, first + n) back to back into dst (host or device; with
  // dst null, only the sizes), one ReadPages per run of same-store pages; appends their
  // descriptions to *pages, the first read error to *status; returns the bytes.
  int64_t ReadRuns(const Sequence& seq, int64_t first, int64_t n, uint8_t* dst, bool dst_on_device,
                   std::vector<StoredPageCopy>* pages, absl::Status* status) const;
  // The same pages read back to back into host memory.
  absl::StatusOr<std::string> ReadToHost(const Sequence& seq, int64_t first, int64_t n,
                                         std::vector<StoredPageCopy>* pages) const;

  const ModelSpec spec_;
  Backend* const backend_;
  const double high_watermark_;
  const double low_watermark_;
  CacheCounters* const counters_;
  std::string codec_description_;  // Snapshot().codec (the model's ModelCodec)
  std::vector<PageStore> stores_;
  uint64_t allocated_bytes_ = 0;  // set once by Create
  std::atomic<uint64_t> demoted_pages_{0};

  MemoryShareFn share_of_;                   // null: no shares
  std::unique_ptr<BlockNamer> block_namer_;  // set_block_observer

  mutable std::mutex mu_;
  RadixTree tree_ ABSL_GUARDED_BY(mu_);
  // Who owns and holds each page (created by Create, one entry per store).
  std::unique_ptr<PageOwners> owners_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> open_sequences_{0};
};

}  // namespace kvcd
