// ModelCache: everything kvcd holds for one model profile — its page pools, its radix
// tree (namespaced by tenant), its sequences' pages — and the operations on them.
//
// Callers (CacheEngine) validate request shapes first; ModelCache re-checks only what
// depends on its state. Every operation either fully succeeds or changes nothing that
// was stored (pages allocated for a failed call are returned to the pool).
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
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/backends/backend.h"
#include "common/codec_profile.h"
#include "server/cache/model_spec.h"
#include "server/formats/page_pool.h"
#include "server/cache/radix_tree.h"
#include "server/cache/sequence.h"

namespace kvcd {

// Engine-wide counters (monotonic), shared by all models; read by Stats and /metrics.
struct CacheCounters {
  std::atomic<uint64_t> hit_tokens{0};   // tokens found cached (Put, OpenSequence)
  std::atomic<uint64_t> miss_tokens{0};  // tokens looked up and not cached
  std::atomic<uint64_t> inserted_pages{0};
  std::atomic<uint64_t> evicted_pages{0};
  std::atomic<uint64_t> demoted_pages{0};
  std::atomic<uint64_t> expired_leases{0};
  std::atomic<uint64_t> expired_buffers{0};  // CUDA IPC buffers dropped by lease expiry
  std::atomic<uint64_t> attention_calls{0};
};

// K or V rows of a request. Element (layer, token, head, i) is at
// data[layer*layer_stride + token*token_stride + head*head_dim + i], BF16 or F32.
struct KvRows {
  const void* data = nullptr;
  bool is_bf16 = true;
  int64_t layer_stride = 0;  // elements
  int64_t token_stride = 0;  // elements
  void CopyRowBf16(int64_t layer, int64_t token, int32_t head, int32_t head_dim,
                   uint16_t* out) const;
  void CopyRowFloat(int64_t layer, int64_t token, int32_t head, int32_t head_dim, float* out) const;
};

struct PoolSnapshot {
  std::string format;
  int64_t page_bytes = 0;
  int32_t pages_total = 0;
  int32_t pages_used = 0;
};

struct ModelSnapshot {
  std::vector<PoolSnapshot> pools;
  int64_t cached_tokens = 0;
  int64_t pinned_pages = 0;
  int64_t active_sequences = 0;
  std::string codec;
  double bf16_bytes_per_token = 0;     // sink and recent segments
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
  // Allocates the pools from `backend` (once). INVALID_ARGUMENT if memory_bytes holds
  // no page, UNIMPLEMENTED for a history format this build cannot store.
  // For int2-oscar, the rotations come from codec_blob (a codec file's bytes), else
  // spec.codec_file, else spec.codec ("identity" / "hadamard"), else Hadamard (logged,
  // and reported by Snapshot().codec).
  static absl::StatusOr<std::unique_ptr<ModelCache>> Create(const ModelSpec& spec, Backend* backend,
                                                            double high_watermark,
                                                            double low_watermark,
                                                            CacheCounters* counters,
                                                            const std::string& codec_blob = "");
  ~ModelCache();

  const ModelSpec& spec() const { return spec_; }

  // Stores the full pages of a prompt. k, v: [num_layers][tokens.size() - kv_first][kv][d]
  // hold tokens [kv_first, tokens.size()); tokens [0, kv_first) must already be cached
  // (FAILED_PRECONDITION otherwise). RESOURCE_EXHAUSTED when the pools cannot hold the
  // new pages even after eviction.
  absl::StatusOr<PutResult> Put(const std::string& salt, absl::Span<const int32_t> tokens,
                                int64_t kv_first, const KvRows& k, const KvRows& v);

  struct StoredPageIn {
    std::string format;
    absl::string_view data;  // [num_layers][page-layer bytes]
  };
  // Stores pages already in the model's storage format for tokens [first_page * page_size,
  // (first_page + pages.size()) * page_size); the prefix before them must be cached
  // (FAILED_PRECONDITION). INVALID_ARGUMENT for a wrong format, size or non-finite value.
  absl::StatusOr<PutResult> PushPages(const std::string& salt, absl::Span<const int32_t> tokens,
                                      int64_t first_page, absl::Span<const StoredPageIn> pages);

  // PushPages from device memory (CUDA IPC mapping or NCCL staging): `src` holds num_pages
  // pages back to back, page i in the format stored at position first_page + i. Every
  // page is checked on the device (finite BF16 values; finite FP16 INT2 parameters,
  // non-negative scales) before anything is published: INVALID_ARGUMENT and nothing stored
  // otherwise.
  absl::StatusOr<PutResult> PushDevicePages(const std::string& salt,
                                            absl::Span<const int32_t> tokens, int64_t first_page,
                                            int64_t num_pages, const uint8_t* src);
  // Format and bytes (all layers) of the page stored at position page_index of a prefix.
  const std::string& StoredFormat(int64_t page_index) const;
  int64_t StoredPageBytes(int64_t page_index) const;

  // Page-aligned longest cached prefix, in tokens (no pinning).
  int64_t Match(const std::string& salt, absl::Span<const int32_t> tokens);

  // Creates a sequence on the longest cached prefix of `tokens` (pinned).
  std::shared_ptr<Sequence> Open(uint64_t id, const std::string& salt,
                                 absl::Span<const int32_t> tokens);

  // Releases pins and private pages. Idempotent.
  void Close(Sequence* seq);

  // Appends n tokens (all layers). FAILED_PRECONDITION if the sequence is closed or a
  // per-layer token is pending; RESOURCE_EXHAUSTED if no page is available.
  absl::StatusOr<int64_t> Append(Sequence* seq, absl::Span<const int32_t> tokens, const KvRows& k,
                                 const KvRows& v);

  struct NewToken {
    int32_t token = 0;
    KvRows k, v;  // one token, one layer: [num_kv_heads][head_dim] (strides unused)
    // Device rows instead (CUDA IPC): [num_kv_heads][head_dim] each, BF16 or F32 as
    // k.is_bf16 says; stored by Backend::StoreRows without a host copy.
    const void* k_device = nullptr;
    const void* v_device = nullptr;
  };
  // Attention of one layer for a batch of distinct open sequences of this model.
  // q: [B][num_q_heads][head_dim] float; o: [B][num_q_heads][head_dim]; lse: [B][num_q_heads].
  // With new_tokens (size B), each sequence first receives its token at this layer.
  // With `device` set (CUDA IPC), q / o / lse are unused: the queries are read from and the
  // results written to device memory as AttentionBatch's device fields say.
  struct DeviceIo {
    const void* q = nullptr;
    bool q_bf16 = false;
    float* o = nullptr;
    float* lse = nullptr;
  };
  absl::Status Attend(int32_t layer, absl::Span<Sequence* const> seqs, const float* q,
                      float softmax_scale, absl::Span<const NewToken> new_tokens, float* o,
                      float* lse, std::vector<int64_t>* lengths,
                      const DeviceIo* device = nullptr);

  // BF16 K/V of tokens [first, first + n) of a sequence, [num_layers][n][kv][d] each, in
  // the original (unrotated) space; INT2 pages are expanded.
  absl::Status Fetch(Sequence* seq, int64_t first, int64_t n, uint16_t* k_out, uint16_t* v_out,
                     std::vector<std::string>* page_formats);
  struct StoredPageCopy {
    std::string format;
    int64_t first_token = 0;
    int32_t num_tokens = 0;
    std::string data;  // [num_layers][page-layer bytes]
  };
  // The pages covering tokens [first, first + n), as stored. REQUIRES: first page-aligned.
  absl::Status FetchStored(Sequence* seq, int64_t first, int64_t n,
                           std::vector<StoredPageCopy>* pages);

  // The same pages copied back to back into device memory `dst` (pages[i].data stays
  // empty); the copy is queued on the device before the sequence is unlocked.
  absl::Status FetchStoredToDevice(Sequence* seq, int64_t first, int64_t n, uint8_t* dst,
                                   int64_t dst_bytes, std::vector<StoredPageCopy>* pages);

  // Bytes of all layers of one page of `format` (0 = BF16, else history).
  int64_t PageBytes(int32_t pool) const { return pools_[pool]->page_bytes(); }
  bool compressed() const { return codec_ != nullptr; }

  // Length of a sequence (committed tokens).
  int64_t Length(Sequence* seq);

  ModelSnapshot Snapshot() const;

 private:
  ModelCache(const ModelSpec& spec, Backend* backend, double high, double low,
             CacheCounters* counters);

  int32_t HistoryPool() const { return static_cast<int32_t>(pools_.size()) - 1; }
  // The common path of Put and PushPages: pins the cached prefix of the first full_pages
  // pages (at least required_pages of them must be cached), allocates the missing pages in
  // their format, lets `write(page_index, page)` fill each, then publishes them.
  // A failing `check` (called after the writes) frees the new pages and publishes nothing.
  absl::StatusOr<PutResult> StorePrefix(const std::string& salt, absl::Span<const int32_t> tokens,
                                        int64_t full_pages, int64_t required_pages,
                                        const std::function<void(int64_t, const PageRef&)>& write,
                                        const std::function<absl::Status()>& check = nullptr);
  // The pool (0 = BF16, 1 = INT2) that stores page `page_index` of a prefix.
  int32_t PoolForPage(int64_t page_index) const;
  absl::Status CheckStoredPage(int64_t page_index, const std::string& format,
                               absl::string_view data) const;
  // Allocates n pages of pool `pool`, evicting LRU leaves if needed.
  absl::Status AllocateLocked(int32_t pool, int32_t n, std::vector<PageRef>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeLocked(absl::Span<const PageRef> pages) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictToWatermarksLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes token rows [src_token, src_token + count) of k/v (all layers, or one layer
  // when layer >= 0) into BF16 page `page` at in-page offset `slot`.
  void WriteBf16Rows(const PageRef& page, int32_t slot, const KvRows& k, const KvRows& v,
                     int64_t src_token, int32_t count, int32_t layer);
  // Row-store jobs for the device rows of one new token at (page, slot, layer).
  void QueueDeviceRows(const PageRef& page, int32_t slot, int32_t layer, const NewToken& t,
                       std::vector<Backend::RowStoreJob>* out) const;
  // Rotates, clips, quantizes and packs a full page of k/v rows (all layers) into an
  // INT2 page (quantize-on-demote of Put).
  void WriteInt2Page(const PageRef& page, const KvRows& k, const KvRows& v, int64_t src_token);
  // Demotes every private BF16 page of `seq` that has left the recent window.
  void DemotePages(Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq->mu);
  // Reads rows [slot, slot + count) of (layer, head) of a page as float, in the
  // rotated space (as stored). which: 0 = K, 1 = V.
  void ReadRows(const PageRef& page, int32_t layer, int32_t head, int which, int32_t slot,
                int32_t count, float* out) const;
  std::vector<AttentionSegment> Segments(const Sequence& seq, int64_t len) const;
  // OK if tokens [first, first + n) of an open sequence can be read.
  absl::Status CheckReadable(const Sequence& seq, int64_t first, int64_t n) const;

  const ModelSpec spec_;
  Backend* const backend_;
  const double high_watermark_;
  const double low_watermark_;
  CacheCounters* const counters_;
  std::vector<uint8_t*> memory_;
  std::vector<uint64_t> memory_bytes_;
  std::vector<std::unique_ptr<PagePool>> pools_;  // [0] = BF16; [1] = INT2 when compressed
  std::unique_ptr<CodecProfile> codec_;           // null: BF16 history, no rotation
  std::vector<float> rho_k_, rho_v_;              // per layer, for device demotion
  std::atomic<uint64_t> demoted_pages_{0};

  mutable std::mutex mu_;
  RadixTree tree_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> open_sequences_{0};
};

}  // namespace kvcd
