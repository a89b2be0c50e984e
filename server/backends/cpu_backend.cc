// CPU backend: aligned host memory for pools, the CPU formats' SIMD kernels on the compute
// threads, split-K over 4096-token items with an exact merge.
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/thread_pool.h"
#include "kvcd/kernels/attention_state.h"
#include "kvcd/kernels/int2_codec.h"
#include "server/backends/backend.h"
#include "server/formats/cpu_page_format.h"

namespace kvcd {
namespace {

// Tokens per split-K work item: long enough to amortize the merge, short enough that
// batch 1 still yields several items per KV head for the compute threads.
constexpr int64_t kSplitTokens = 4096;

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int compute_threads) : pool_(compute_threads) {}
  const char* name() const override { return "cpu"; }

  absl::StatusOr<uint8_t*> AllocatePoolMemory(uint64_t bytes) override {
    constexpr uint64_t kAlign = 2u << 20;                 // huge-page friendly
    const uint64_t rounded = PoolAllocationBytes(bytes);  // a multiple of kAlign
    void* p = std::aligned_alloc(kAlign, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " bytes of host memory for a page pool"));
    }
    std::memset(p, 0, rounded);  // commit the pages now, not on the request path
    return static_cast<uint8_t*>(p);
  }
  void FreePoolMemory(uint8_t* p, uint64_t) override { std::free(p); }

  BackendKind kind() const override { return BackendKind::kCpu; }

  absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> ids, const uint8_t* run,
                          bool run_on_device) override {
    if (run_on_device) return NoDevice();
    const int64_t layer_bytes = pool.layer_page_bytes();
    for (size_t i = 0; i < ids.size(); ++i) {
      for (int32_t l = 0; l < pool.num_layers(); ++l) {
        std::memcpy(pool.PagePtr(l, ids[i]), run + (i * pool.num_layers() + l) * layer_bytes,
                    static_cast<size_t>(layer_bytes));
      }
    }
    return absl::OkStatus();
  }
  absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> ids, uint8_t* run,
                         bool run_on_device) override {
    if (run_on_device) return NoDevice();
    const int64_t layer_bytes = pool.layer_page_bytes();
    for (size_t i = 0; i < ids.size(); ++i) {
      for (int32_t l = 0; l < pool.num_layers(); ++l) {
        std::memcpy(run + (i * pool.num_layers() + l) * layer_bytes, pool.PagePtr(l, ids[i]),
                    static_cast<size_t>(layer_bytes));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Attend(const AttentionBatch& b) override {
    struct Item {
      int32_t job, kv_head;
      const AttentionSegment* seg;
      const CpuPageFormat* kernels;
      int64_t begin, end;
    };
    std::vector<Item> items;
    std::vector<int64_t> first_item;  // per (job, kv_head): index of its first item
    for (int32_t j = 0; j < static_cast<int32_t>(b.jobs.size()); ++j) {
      for (int32_t h = 0; h < b.num_kv_heads; ++h) {
        first_item.push_back(static_cast<int64_t>(items.size()));
        for (const AttentionSegment& seg : b.jobs[j].segments) {
          const CpuPageFormat* kernels = seg.format->cpu();
          if (kernels == nullptr) {
            return absl::InternalError(absl::StrCat("the ", seg.format->name(),
                                                    " format was not built for the cpu backend"));
          }
          for (int64_t t = seg.token_begin; t < seg.token_end; t += kSplitTokens) {
            items.push_back({j, h, &seg, kernels, t, std::min(seg.token_end, t + kSplitTokens)});
          }
        }
      }
    }
    first_item.push_back(static_cast<int64_t>(items.size()));
    const int g = b.num_q_heads / b.num_kv_heads;
    const int d = b.head_dim;
    // Rotate every query once (q·R_k, FP32); pages hold rotated keys.
    const CodecProfile* rotation = b.model_format->rotation();
    const int64_t q_elems = int64_t{b.num_q_heads} * d;
    std::vector<float> q_rot;
    if (rotation != nullptr) {
      q_rot.resize(b.jobs.size() * q_elems);
      for (size_t j = 0; j < b.jobs.size(); ++j) {
        kernels::RotateRows(b.jobs[j].q, b.num_q_heads, d, rotation->RK(b.layer),
                            q_rot.data() + j * q_elems);
      }
    }
    auto query = [&](int32_t job) {
      return rotation != nullptr ? q_rot.data() + job * q_elems : b.jobs[job].q;
    };
    std::vector<float> part_o(items.size() * g * d);
    std::vector<float> part_lse(items.size() * g);
    pool_.ParallelFor(static_cast<int64_t>(items.size()), [&](int64_t i) {
      const Item& it = items[i];
      const float* q = query(it.job) + static_cast<int64_t>(it.kv_head) * g * d;
      float* o = part_o.data() + i * g * d;
      float* lse = part_lse.data() + i * g;
      it.kernels->Attend(*it.seg->pool, b.layer, it.seg->page_ids, it.seg->first_position,
                         it.kv_head, q, g, b.softmax_scale, it.begin, it.end, o, lse);
    });
    for (int32_t j = 0; j < static_cast<int32_t>(b.jobs.size()); ++j) {
      for (int32_t h = 0; h < b.num_kv_heads; ++h) {
        const int64_t slot = static_cast<int64_t>(j) * b.num_kv_heads + h;
        const int64_t begin = first_item[slot];
        const int64_t count = first_item[slot + 1] - begin;
        kernels::MergeStatesN(static_cast<int>(count), g, d, part_o.data() + begin * g * d,
                              part_lse.data() + begin * g,
                              b.jobs[j].o + static_cast<int64_t>(h) * g * d,
                              b.jobs[j].lse + static_cast<int64_t>(h) * g);
      }
      if (rotation != nullptr) {  // o = o_rot · R_v^T, once per head
        std::vector<float> o_rot(b.jobs[j].o, b.jobs[j].o + q_elems);
        kernels::RotateRows(o_rot.data(), b.num_q_heads, d, rotation->RVT(b.layer), b.jobs[j].o);
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status NoDevice() const {
    return absl::FailedPreconditionError(
        "the cpu backend has no device memory; send inline_data (inline_pages) instead");
  }
  ThreadPool pool_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(int compute_threads) {
  const int threads = compute_threads > 0
                          ? compute_threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // The calling request thread takes part in ParallelFor, so the pool holds one fewer.
  return std::make_unique<CpuBackend>(std::max(1, threads - 1));
}

}  // namespace kvcd
