// CUDA backend: page pools in device memory (cudaMalloc once per model), the CUDA formats'
// kernels, batched copies, and the device runtime of the data plane. Only built with
// KVCD_CUDA; reaches CUDA only through kernels' host APIs.
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/env_choice.h"
#include "common/log.h"
#include "common/phase_times.h"
#include "common/status_macros.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_device_copy.h"
#include "kvcd/kernels/cuda_page_copy.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "kvcd/kernels/cuda_stream_memops.h"
#include "kvcd/kernels/device_fault.h"
#include "server/backends/backend.h"
#include "server/backends/cuda_fault_board.h"
#include "server/backends/cuda_gpu_timeline.h"
#include "server/backends/cuda_side_stream.h"
#include "server/backends/device_runtime.h"
#include "server/formats/cuda_codec.h"
#include "server/formats/cuda_page_format.h"
#include "server/formats/kernel_status.h"

namespace kvcd {
namespace {

namespace kc = kernels::cuda;

#define RETURN_IF_CUDA(expr)                       \
  do {                                             \
    const kernels::Error kvcd_err_ = (expr);       \
    if (!kvcd_err_.ok()) return Failed(kvcd_err_); \
  } while (0)

class CudaBackend final : public Backend, public DeviceRuntime, public RowStream {
 public:
  explicit CudaBackend(int device)
      : device_(device),
        sms_(std::max(1, kc::SmCount())),
        timeline_(PhaseTimes::Enabled() ? std::make_unique<GpuTimeline>() : nullptr) {}
  ~CudaBackend() override {
    if (fold_counters_ != nullptr) (void)kc::Free(fold_counters_);
    if (side_word_ != nullptr) (void)kc::Free(side_word_);
  }
  const char* name() const override { return "cuda"; }
  DeviceRuntime* device() override { return this; }
  RowStream* row_stream() override { return rows_on_side_ ? this : nullptr; }

  // RowStream: a pipelined call's row store on the side stream, ordered after everything
  // queued so far on the daemon's stream. Attend orders the launches that read the rows
  // after it (the windows run on the side stream after it, or the daemon's stream joins it
  // first), and so do the page copies (CudaSideStream::JoinPendingRows).
  absl::StatusOr<void*> Fork() override {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_CUDA(side_.Fork(/*rows=*/true));
    return side_.stream();
  }

  bool Healthy() const override {
    if (!sticky_.load() && kc::LastErrorIsSticky()) sticky_.store(true);
    return !sticky_.load();
  }

  absl::StatusOr<uint8_t*> AllocatePoolMemory(uint64_t bytes) override {
    void* p = nullptr;
    KVCD_RETURN_IF_ERROR(KernelStatus(
        kc::Malloc(&p, bytes), absl::StatusCode::kResourceExhausted,
        absl::StrCat("cannot allocate ", bytes, " bytes of device memory for a page pool")));
    // Where the runtime put it, not where it was asked to: a pool on another GPU than the
    // one the kernels run on would fault at the first launch (kc::SetDevice binds the
    // device on every thread; this checks that it did).
    int holder = -1;
    const kernels::Error where = kc::PointerDevice(p, &holder);
    if (!where.ok() || holder != device_) {
      (void)kc::Free(p);
      return absl::InternalError(
          absl::StrCat("a page pool of ", bytes, " bytes was allocated ",
                       where.ok() ? absl::StrCat("on CUDA device ", holder)
                                  : absl::StrCat("where CUDA cannot say (", where.message(), ")"),
                       ", expected on cuda_device ", device_));
    }
    KVCD_LOG(INFO) << "page pool of " << bytes << " bytes on CUDA device " << holder;
    return static_cast<uint8_t*>(p);
  }
  void FreePoolMemory(uint8_t* p, uint64_t) override { (void)kc::Free(p); }

  BackendKind kind() const override { return BackendKind::kCuda; }

  // One paged-copy launch per call; host runs go through device staging in one copy.
  absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> ids, const uint8_t* run,
                          bool run_on_device) override {
    if (ids.empty()) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_CUDA(side_.JoinPendingRows());
    const uint64_t bytes = static_cast<uint64_t>(pool.page_bytes()) * ids.size();
    const uint8_t* src = run;
    if (!run_on_device) {
      auto staged = staging_.Reserve(bytes);
      if (!staged.ok()) return staged.status();
      RETURN_IF_CUDA(kc::CopyToDevice(*staged, run, bytes));
      src = *staged;
    }
    return PagedCopyLocked(kc::PageCopy::kScatter, pool, ids, const_cast<uint8_t*>(src));
  }

  absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> ids, uint8_t* run,
                         bool run_on_device) override {
    if (ids.empty()) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_CUDA(side_.JoinPendingRows());
    if (run_on_device) return PagedCopyLocked(kc::PageCopy::kGather, pool, ids, run);
    const uint64_t bytes = static_cast<uint64_t>(pool.page_bytes()) * ids.size();
    auto staged = staging_.Reserve(bytes);
    if (!staged.ok()) return staged.status();
    KVCD_RETURN_IF_ERROR(PagedCopyLocked(kc::PageCopy::kGather, pool, ids, *staged));
    RETURN_IF_CUDA(kc::CopyToHost(run, *staged, bytes));
    return absl::OkStatus();
  }

  // DeviceRuntime.
  absl::StatusOr<void*> OpenIpcBuffer(const std::string& handle) override {
    void* p = nullptr;
    KVCD_RETURN_IF_ERROR(
        KernelStatus(kc::IpcOpenMemory(handle, &p), absl::StatusCode::kInvalidArgument));
    return p;
  }
  void CloseIpcBuffer(void* p) override { Note(kc::IpcCloseMemory(p)); }
  absl::StatusOr<void*> OpenIpcEvent(const std::string& handle) override {
    void* e = nullptr;
    KVCD_RETURN_IF_ERROR(
        KernelStatus(kc::IpcOpenEvent(handle, &e), absl::StatusCode::kInvalidArgument));
    return e;
  }
  absl::StatusOr<void*> CreateIpcEvent(std::string* handle) override {
    void* e = nullptr;
    RETURN_IF_CUDA(kc::IpcCreateEvent(&e, handle));
    return e;
  }
  void DestroyEvent(void* e) override { Note(kc::DestroyEvent(e)); }
  absl::Status WaitEvent(void* e) override {
    RETURN_IF_CUDA(kc::StreamWaitEvent(e));
    if (timeline_ != nullptr) timeline_->Start();
    return absl::OkStatus();
  }
  absl::Status RecordEvent(void* e) override {
    if (timeline_ != nullptr) timeline_->End();
    RETURN_IF_CUDA(kc::RecordEvent(e));
    return absl::OkStatus();
  }
  absl::Status WaitValue(const uint32_t* word, uint32_t value) override {
    if (!kc::StreamMemopsAvailable()) {
      return absl::FailedPreconditionError(
          "this GPU's driver offers no stream memory operations (cuStreamWaitValue32); "
          "order the buffer with its IPC events instead (no device signal words)");
    }
    RETURN_IF_CUDA(kc::StreamWaitValue32(nullptr, word, value));
    if (timeline_ != nullptr) timeline_->Start();
    return absl::OkStatus();
  }
  absl::Status WriteValue(uint32_t* word, uint32_t value) override {
    if (timeline_ != nullptr) timeline_->End();
    RETURN_IF_CUDA(kc::StreamWriteValue32(nullptr, word, value));
    return absl::OkStatus();
  }
  void ReleaseValue(uint32_t* word, uint32_t value) override {
    Note(kc::ReleaseValue32(word, value));
  }
  absl::Status CopyDeviceToHost(void* host, const void* dev, size_t bytes) override {
    RETURN_IF_CUDA(kc::CopyToHost(host, dev, bytes));
    return absl::OkStatus();
  }
  absl::Status CopyHostToDevice(void* dev, const void* host, size_t bytes) override {
    RETURN_IF_CUDA(kc::CopyToDevice(dev, host, bytes));
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    RETURN_IF_CUDA(kc::Synchronize());
    return absl::OkStatus();
  }
  absl::StatusOr<DeviceFaultWords> AcquireFaultWords() override { return faults_.Acquire(); }
  void ReleaseFaultWords(const DeviceFaultWords& words) override { faults_.Release(words); }

  absl::Status Attend(const AttentionBatch& b) override {
    static const int kLists = PhaseTimes::Phase("daemon.cuda.lock+page lists");
    static const int kScratch = PhaseTimes::Phase("daemon.cuda.scratch");
    static const int kUpload = PhaseTimes::Phase("daemon.cuda.page table upload");
    static const int kLaunch = PhaseTimes::Phase("daemon.cuda.attention launches");
    PhaseLap lap;
    std::lock_guard<std::mutex> lock(mu_);
    // Rows stored on the side stream (Fork) that this call does not join on its way (a
    // failed call, one not forked): joined before it returns, whatever it returns.
    absl::Cleanup rows_joined = [&] { Note(side_.JoinPendingRows()); };
    const int batch = static_cast<int>(b.jobs.size());
    const int d = b.head_dim, hq = b.num_q_heads;
    const int rows = batch * hq;
    // One page list per format present, per sequence (token order does not matter, and only a
    // sequence's last page can be partial, so each list is a valid page list). A format that
    // merges in its launch goes last and merges every part. The lists and the table keep
    // their memory from call to call: the per-layer decode loop allocates nothing here.
    size_t num_lists = 0;
    for (int j = 0; j < batch; ++j) {
      for (const AttentionSegment& seg : b.jobs[j].segments) {
        const CudaPageFormat* f = seg.format->cuda();
        if (f == nullptr) {
          return absl::InternalError(absl::StrCat("the ", seg.format->name(),
                                                  " format was not built for the cuda backend"));
        }
        const auto end = lists_.begin() + static_cast<std::ptrdiff_t>(num_lists);
        auto it = std::find_if(lists_.begin(), end, [&](const List& l) { return l.format == f; });
        if (it == end) {
          if (num_lists == lists_.size()) lists_.emplace_back();
          List& l = lists_[num_lists++];
          l.format = f;
          l.name = seg.format->name();
          l.pool = seg.pool;
          if (l.pages.size() < static_cast<size_t>(batch)) l.pages.resize(batch);
          for (int i = 0; i < batch; ++i) l.pages[i].clear();
          l.lens.assign(batch, 0);
          l.max_pages = 1;
          l.max_len = 0;
          if (f->NeedsPositions()) {
            l.first_pos.assign(batch, -1);
            l.end_pos.assign(batch, -1);
          } else {
            l.first_pos.clear();
            l.end_pos.clear();
          }
          it = lists_.begin() + static_cast<std::ptrdiff_t>(num_lists - 1);
        }
        if (!it->first_pos.empty()) {
          // Keys rebuilt with RoPE: token t of the list is at first_pos + t.
          if (it->first_pos[j] < 0) {
            it->first_pos[j] = it->end_pos[j] = seg.first_position;
          } else if (seg.first_position != it->end_pos[j] || seg.token_begin != 0) {
            return absl::InternalError(absl::StrCat(
                "the ", seg.format->name(), " pages of batch entry ", j,
                " are not consecutive in its sequence; their attention needs them so"));
          }
          it->end_pos[j] += seg.token_end;
        }
        it->pages[j].insert(it->pages[j].end(), seg.page_ids.begin(), seg.page_ids.end());
        it->lens[j] += static_cast<int32_t>(seg.token_end - seg.token_begin);
      }
    }
    const auto lists_end = lists_.begin() + static_cast<std::ptrdiff_t>(num_lists);
    std::stable_partition(lists_.begin(), lists_end,
                          [](const List& l) { return !l.format->FusesMerge(); });
    const kc::DecodeGeometry geo{batch, hq, b.num_kv_heads, d, b.page_size};
    int parts = 0;
    size_t state_bytes = 0;
    std::vector<int32_t>& host_i32 = table_;
    host_i32.clear();
    for (auto l = lists_.begin(); l != lists_end; ++l) {
      int64_t total_len = 0;
      for (int j = 0; j < batch; ++j) {
        l->max_pages = std::max(l->max_pages, static_cast<int>(l->pages[j].size()));
        l->max_len = std::max(l->max_len, l->lens[j]);
        total_len += l->lens[j];
      }
      l->splits = l->max_len > 0 ? l->format->AttendSplits(geo, l->max_len,
                                                           balanced_splits_ ? total_len : 0, sms_)
                                 : 0;
      parts += l->splits;
      if (l->splits > 0) {
        state_bytes = std::max(state_bytes, l->format->AttendStateBytes(geo, l->max_len, sms_));
      }
      l->table_off = host_i32.size();
      for (int j = 0; j < batch; ++j) {
        host_i32.insert(host_i32.end(), l->pages[j].begin(), l->pages[j].end());
        host_i32.resize(host_i32.size() + (l->max_pages - l->pages[j].size()), 0);
      }
      l->len_off = host_i32.size();
      host_i32.insert(host_i32.end(), l->lens.begin(), l->lens.end());
      if (!l->first_pos.empty()) {  // int64 positions, 8-byte aligned
        if (host_i32.size() % 2 != 0) host_i32.push_back(0);
        l->pos_off = host_i32.size();
        host_i32.resize(l->pos_off + 2 * static_cast<size_t>(batch));
        for (int j = 0; j < batch; ++j) {
          const int64_t p = std::max<int64_t>(0, l->first_pos[j]);
          std::memcpy(host_i32.data() + l->pos_off + 2 * j, &p, sizeof(p));
        }
      }
    }
    // The sequences' fault targets (device_fault.h) travel with the page tables, 8-byte
    // aligned: the query conversion sets them, the merge poisons the rows of a set one. They
    // go with layer 0 in their tags (the launch names the layer: LaunchQueriesToFloat), so a
    // token's tables are the same bytes at every layer and are sent once per token.
    bool any_fault = false;
    for (const AttentionJob& job : b.jobs) any_fault = any_fault || job.fault.tag != 0;
    size_t faults_off = 0;
    if (any_fault) {
      if (host_i32.size() % 2 != 0) host_i32.push_back(0);
      faults_off = host_i32.size();
      host_i32.resize(faults_off + batch * sizeof(kernels::DeviceFault) / sizeof(int32_t));
      for (int j = 0; j < batch; ++j) {
        kernels::DeviceFault f = b.jobs[j].fault;
        if (f.tag != 0) f.tag = kernels::FaultTag(f.tag >> kernels::kFaultOwnerShift, 0);
        std::memcpy(host_i32.data() + faults_off + j * sizeof(kernels::DeviceFault) / 4, &f,
                    sizeof(kernels::DeviceFault));
      }
    }
    parts = std::max(1, parts);
    lap.Mark(kLists);
    const CudaCodec* codec =
        b.model_format->cuda() != nullptr ? b.model_format->cuda()->device_codec() : nullptr;
    const float* d_rk = codec != nullptr ? codec->RK(b.layer) : nullptr;
    const float* d_rvt = codec != nullptr ? codec->RVT(b.layer) : nullptr;
    // Scratch: q, page tables and lengths, parts, o, lse, the fusing format's state.
    const size_t q_bytes = sizeof(float) * rows * d;
    const size_t i32_bytes = sizeof(int32_t) * std::max<size_t>(1, host_i32.size());
    const size_t part_o_bytes = sizeof(float) * static_cast<size_t>(parts) * rows * d;
    const size_t part_lse_bytes = sizeof(float) * static_cast<size_t>(parts) * rows;
    const size_t total = 2 * q_bytes + i32_bytes + part_o_bytes + part_lse_bytes +
                         sizeof(float) * rows + state_bytes + 64 * 8;
    auto scratch = scratch_.Reserve(total);
    if (!scratch.ok()) return scratch.status();
    auto carve = [p = *scratch](size_t bytes) mutable {
      uint8_t* r = p;
      p += (bytes + 255) / 256 * 256;
      return r;
    };
    float* d_q = reinterpret_cast<float*>(carve(q_bytes));
    int32_t* d_i32 = reinterpret_cast<int32_t*>(carve(i32_bytes));
    float* d_part_o = reinterpret_cast<float*>(carve(part_o_bytes));
    float* d_part_lse = reinterpret_cast<float*>(carve(part_lse_bytes));
    float* d_o = reinterpret_cast<float*>(carve(q_bytes));
    float* d_lse = reinterpret_cast<float*>(carve(sizeof(float) * rows));
    void* d_state = carve(state_bytes);
    lap.Mark(kScratch);
    // Page tables, lengths and fault targets go up from pinned staging without waiting for
    // the device: a call whose queries and results live on the device (CUDA IPC) never
    // blocks here. They go before the query conversion, which reads the fault targets.
    // The per-layer decode loop sends the same tables for every layer of a token (they
    // change when a token completes or a page is demoted), so a table equal to the one the
    // previous call left at the same place of the same scratch is not sent again: only
    // Attend writes that part of the scratch, under mu_, in stream order.
    if (!TableStillOnDevice(d_i32, host_i32)) {
      last_table_.at = nullptr;
      KVCD_RETURN_IF_ERROR(
          Noted(uploads_.Upload(d_i32, host_i32.data(), sizeof(int32_t) * host_i32.size())));
      // The sent table becomes the last one; the next call builds into the other buffer.
      last_table_.at = d_i32;
      last_table_.generation = scratch_.generation();
      last_table_.table.swap(table_);
    }
    lap.Mark(kUpload);
    if (timeline_ != nullptr) {
      static const int kGpuBefore = PhaseTimes::Phase("gpu.daemon inputs ready -> attention");
      timeline_->Step(kGpuBefore);
    }
    const auto* d_faults =
        any_fault ? reinterpret_cast<const kernels::DeviceFault*>(d_i32 + faults_off) : nullptr;
    // The worker's device queries are read with the non-finite check fused in (a bad value
    // becomes 0 and marks its sequence's fault words): by the attention launches themselves
    // (every launched list's grid reads every query), or by the conversion into d_q when no
    // list has tokens (a bad query is reported all the same) or a launched format reads only
    // converted queries (FSQ).
    bool any_splits = false, all_read_raw = true;
    for (auto it = lists_.begin(); it != lists_end; ++it) {
      if (it->splits == 0) continue;
      any_splits = true;
      all_read_raw = all_read_raw && it->format->ReadsRawQueries();
    }
    const kc::RawQueries raw{b.device_q, b.device_q_bf16, d_faults, b.layer};
    const kc::RawQueries* raw_q =
        b.device_q != nullptr && any_splits && all_read_raw ? &raw : nullptr;
    if (b.device_q != nullptr && raw_q == nullptr) {
      RETURN_IF_CUDA(kc::LaunchQueriesToFloat(b.device_q, b.device_q_bf16, batch,
                                              static_cast<int64_t>(hq) * d, d_q, d_faults, nullptr,
                                              b.layer));
    } else if (b.device_q == nullptr) {
      std::vector<float> q(static_cast<size_t>(rows) * d);
      for (int j = 0; j < batch; ++j)
        std::copy(b.jobs[j].q, b.jobs[j].q + hq * d, q.begin() + j * hq * d);
      RETURN_IF_CUDA(kc::CopyToDevice(d_q, q.data(), q_bytes));
    }
    // Results go into the worker's buffer (CUDA IPC; the caller records its event) or into
    // device scratch copied back below.
    const kc::MergeTarget merge{parts,
                                d_rvt,
                                b.device_o != nullptr ? b.device_o : d_o,
                                b.device_o != nullptr ? b.device_lse : d_lse,
                                d_faults,
                                hq};
    // With several lists (the BF16 windows beside INT2 history), the lists before the last
    // run on a second stream beside it and the merge runs once both are done, instead of one
    // list after the other (the windows' CTAs start beside the history's grid where SMs are
    // free: measured +11% per token at 32k, ~0 at 100k;
    // bench/results/2026-12-06-h200-decode-step-timeline.md).
    const CudaPageFormat* last_format = nullptr;
    int launched = 0;
    bool all_side = true;
    for (auto it = lists_.begin(); it != lists_end; ++it) {
      if (it->splits == 0) continue;
      if (last_format != nullptr) all_side = all_side && last_format->RunsOnSideStream();
      last_format = it->format;
      ++launched;
    }
    const bool forked = side_lists_ && launched >= 2 && all_side;
    // Rows stored on the side stream: a forked call's windows run there after them; any
    // other call's launches wait for them here.
    if (!forked) RETURN_IF_CUDA(side_.JoinPendingRows());
    // The merge folded into the launches' last CTAs (MergeTarget::fold_counters) where every
    // launched format takes it: no merge launch, and no wait for both streams before it.
    bool fold =
        merge_mode_ == MergeMode::kFold && launched > 0 && parts <= kc::MaxFoldedMergeParts(d);
    for (auto it = lists_.begin(); fold && it != lists_end; ++it) {
      if (it->splits > 0) fold = it->format->FoldsMerge(geo);
    }
    kc::MergeTarget folded = merge;
    if (fold) {
      auto counters = FoldCountersLocked(static_cast<size_t>(batch) * b.num_kv_heads);
      if (!counters.ok()) return counters.status();
      folded.fold_counters = *counters;
    }
    // A call that fails between its launches may leave counts behind, and a count left
    // behind would merge every later call's group early: wait for every grid of the call
    // (both streams, whatever the join did), then zero them, so the next call starts from
    // zero. An error path only; the device wait costs nothing a working call pays.
    bool fold_complete = !fold;
    absl::Cleanup zero_on_failure = [&] {
      if (!fold_complete) {
        Note(kc::Synchronize());
        Note(kc::ZeroAsync(fold_counters_, sizeof(unsigned int) * fold_counters_size_));
      }
    };
    // A forked call's merge follows the last list on the daemon's stream as its programmatic
    // dependent (KVCD_MERGE=dependent, the default) where the side stream can tell it on the
    // device that its lists are done: the side stream writes a rising value into side_word_
    // after them and the merge waits for it (MergeTarget::wait_word), in place of the daemon's
    // stream joining the side stream before a plain merge launch. The merge's CTAs wait in
    // their SM slots, so only where they leave most of the GPU to the windows: one 512-thread
    // CTA per row, rows <= SMs.
    const bool await_side = forked && !fold && merge_mode_ == MergeMode::kDependent &&
                            rows <= sms_ && kc::StreamMemopsAvailable();
    kc::MergeTarget awaited = merge;
    if (await_side) {
      auto word = SideWordLocked();
      if (!word.ok()) return word.status();
      awaited.wait_word = *word;
    }
    if (forked) {
      RETURN_IF_CUDA(side_.Fork());
    }
    // Every return after the fork joins the side stream back first, so that the daemon's
    // stream (and the next call's use of this scratch) stays ordered after its kernels.
    bool joined = !forked;
    absl::Cleanup join_on_exit = [&] {
      if (!joined) Note(side_.Join());
    };
    int part_base = 0;
    bool merged = false;
    int launched_so_far = 0;
    for (auto it = lists_.begin(); it != lists_end; ++it) {
      const List& l = *it;
      if (l.splits == 0) continue;
      const bool on_side = forked && ++launched_so_far < launched;
      CudaPageFormat::AttendLaunch a;
      a.stream = on_side ? side_.stream() : nullptr;
      a.list = kc::PagedList{l.pool->LayerBase(b.layer), l.pool->layer_page_bytes(),
                             d_i32 + l.table_off, l.max_pages, d_i32 + l.len_off};
      a.geo = geo;
      a.q = d_q;
      a.raw = raw_q;
      a.r_k = d_rk;
      a.scale = b.softmax_scale;
      a.splits = l.splits;
      a.max_tokens = l.max_len;
      a.part_o = d_part_o;
      a.part_lse = d_part_lse;
      a.part_base = part_base;
      a.state = d_state;
      a.layer = b.layer;
      a.num_sms = sms_;
      if (!l.first_pos.empty()) a.positions = reinterpret_cast<const int64_t*>(d_i32 + l.pos_off);
      if (await_side && !on_side) {  // every side list is queued: the word rises after them
        awaited.wait_value = ++side_word_value_;
        RETURN_IF_CUDA(kc::StreamWriteValue32(side_.stream(), side_word_, awaited.wait_value));
      }
      // Lists are ordered so that a merging format is last: it merges every part (unless
      // lists run on two streams: then the merge waits for both, below).
      if (fold) {
        a.merge = &folded;
        merged = true;
      } else if (await_side && !on_side && l.format->FusesMerge()) {
        a.merge = &awaited;
        merged = true;
      } else if (!forked && l.format->FusesMerge() && part_base + l.splits == parts) {
        a.merge = &merge;
        merged = true;
      }
      if (absl::Status s = l.format->LaunchAttend(a); !s.ok()) return Noted(s);
      part_base += l.splits;
      if (timeline_ != nullptr && !forked) {
        timeline_->Step(PhaseTimes::Phase(
            absl::StrCat("gpu.daemon attention ", l.name, a.merge != nullptr ? " (+merge)" : "")));
      }
    }
    if (await_side) {
      // The merge waits on the device for everything queued on the side stream, so the
      // daemon's stream is ordered after it from the merge on: no join.
      if (!merged) {
        RETURN_IF_CUDA(kc::LaunchMergeTarget(awaited, d_part_o, d_part_lse, rows, d, nullptr,
                                             /*dependent=*/true));
        merged = true;
      }
      joined = true;
      side_.JoinedOnDevice();
    } else if (forked) {
      joined = true;
      RETURN_IF_CUDA(side_.Join());  // rows stored on the side stream before included
    }
    fold_complete = true;
    if (!merged) {
      if (part_base == 0) {  // nothing to attend: every row is the empty state
        std::vector<float> neg(static_cast<size_t>(rows), -INFINITY);
        RETURN_IF_CUDA(kc::CopyToDevice(d_part_lse, neg.data(), sizeof(float) * rows));
      }
      // As the last launch's programmatic dependent (KVCD_MERGE=dependent; after a join or
      // a copy it starts as a plain launch would).
      RETURN_IF_CUDA(kc::LaunchMergeTarget(merge, d_part_o, d_part_lse, rows, d, nullptr,
                                           merge_mode_ == MergeMode::kDependent));
    }
    lap.Mark(kLaunch);
    if (timeline_ != nullptr && forked) {
      static const int kGpuForked =
          PhaseTimes::Phase("gpu.daemon attention, lists on two streams (+merge)");
      timeline_->Step(kGpuForked);
    }
    if (b.device_o != nullptr) return absl::OkStatus();
    std::vector<float> o(static_cast<size_t>(rows) * d), lse(rows);
    RETURN_IF_CUDA(kc::CopyToHost(o.data(), d_o, q_bytes));
    RETURN_IF_CUDA(kc::CopyToHost(lse.data(), d_lse, sizeof(float) * rows));
    for (int j = 0; j < batch; ++j) {
      std::copy(o.begin() + j * hq * d, o.begin() + (j + 1) * hq * d, b.jobs[j].o);
      std::copy(lse.begin() + j * hq, lse.begin() + (j + 1) * hq, b.jobs[j].lse);
    }
    return absl::OkStatus();
  }

 private:
  // The formats size their splits by the longest list of a ragged batch (AttendSplits'
  // total_tokens; measured on the device, bench/results/2026-12-05-h200-gpu-step.md);
  // KVCD_SPLITS=kernel: each kernel's own count, sized for equal lengths (the earlier rule);
  // "balanced" names the default; another value is reported and ignored.
  static bool BalancedSplitsFromEnv() {
    return EnvChoice("KVCD_SPLITS", {"balanced", "kernel"}) == 0;
  }
  static bool SideListsFromEnv() {
    const char* v = std::getenv("KVCD_SIDE_STREAM");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }
  // How a call's split-K parts are merged. KVCD_MERGE=dependent (the default): the merge
  // kernel after the lists, on a forked call as the last list's programmatic dependent,
  // waiting on the device for the side stream's lists (see Attend); "kernel": the merge
  // kernel after the lists, on a forked call after the daemon's stream joins the side stream
  // (the order before session 29); "fold": the merge folded into the launches where their
  // formats allow it (measured slower with INT2 history on an H100 in session 28: its last CTA's
  // tail comes after the grid's slowest CTA; +4% with BF16 history alone,
  // bench/results/2026-12-05-h200-gpu-step.md). Any other value is reported and ignored.
  enum class MergeMode { kDependent, kKernel, kFold };  // in EnvChoice's order
  static MergeMode MergeModeFromEnv() {
    return static_cast<MergeMode>(EnvChoice("KVCD_MERGE", {"dependent", "kernel", "fold"}));
  }
  // The word the side stream raises after a forked call's lists (Attend), zero at first.
  // REQUIRES: mu_.
  absl::StatusOr<uint32_t*> SideWordLocked() {
    if (side_word_ != nullptr) return side_word_;
    void* p = nullptr;
    KVCD_RETURN_IF_ERROR(KernelStatus(kc::Malloc(&p, sizeof(uint32_t)),
                                      absl::StatusCode::kResourceExhausted,
                                      "cannot allocate the side stream's word"));
    RETURN_IF_CUDA(kc::ZeroAsync(p, sizeof(uint32_t)));
    side_word_ = static_cast<uint32_t*>(p);
    side_word_value_ = 0;
    return side_word_;
  }
  // The folded merge's counters, at least n of them, zero (the merging CTAs leave them so).
  // Growing waits for the device, so that no launch still counts on the old ones; it
  // happens when a call's batch x KV heads first passes the size. REQUIRES: mu_.
  absl::StatusOr<unsigned int*> FoldCountersLocked(size_t n) {
    if (n <= fold_counters_size_) return fold_counters_;
    const size_t size = std::max<size_t>(n, 4096);
    if (fold_counters_ != nullptr) {
      RETURN_IF_CUDA(kc::Synchronize());
      Note(kc::Free(fold_counters_));
      fold_counters_ = nullptr;
      fold_counters_size_ = 0;
    }
    void* p = nullptr;
    KVCD_RETURN_IF_ERROR(KernelStatus(kc::Malloc(&p, sizeof(unsigned int) * size),
                                      absl::StatusCode::kResourceExhausted,
                                      "cannot allocate the folded merge's counters"));
    RETURN_IF_CUDA(kc::ZeroAsync(p, sizeof(unsigned int) * size));
    fold_counters_ = static_cast<unsigned int*>(p);
    fold_counters_size_ = size;
    return fold_counters_;
  }
  // Pipelined calls store their rows on the side stream, beside the history's attention
  // (measured on an H100 in session 28: INT2 100k batch 1 2.01x -> 2.18x cuDNN, 32k 0.97x ->
  // 0.99x, batch 8 +3%); KVCD_ROW_STREAM=main keeps them on the daemon's stream. Needs the
  // side stream.
  static bool RowsOnSideFromEnv() { return EnvChoice("KVCD_ROW_STREAM", {"side", "main"}) == 0; }
  // Queues one paged copy between `pool` and the device run (page ids go up through the
  // pinned uploader, so the host does not wait).
  absl::Status PagedCopyLocked(kc::PageCopy kind, const PagePool& pool,
                               absl::Span<const int32_t> ids, uint8_t* run) {
    auto d_ids = ids_scratch_.Reserve(sizeof(int32_t) * ids.size());
    if (!d_ids.ok()) return d_ids.status();
    KVCD_RETURN_IF_ERROR(Noted(uploads_.Upload(*d_ids, ids.data(), sizeof(int32_t) * ids.size())));
    kc::PagedCopyArgs a;
    a.pool = pool.LayerBase(0);
    a.pool_layer_stride = int64_t{pool.num_pages()} * pool.layer_page_bytes();
    a.layer_bytes = pool.layer_page_bytes();
    a.num_layers = pool.num_layers();
    a.page_ids = reinterpret_cast<const int32_t*>(*d_ids);
    a.num_pages = static_cast<int64_t>(ids.size());
    a.run = run;
    RETURN_IF_CUDA(kc::LaunchPagedCopy(kind, a, nullptr, nullptr));
    return absl::OkStatus();
  }

  absl::Status Noted(absl::Status s) {
    if (kc::LastErrorIsSticky()) sticky_.store(true);
    return s;
  }
  // Records a failed copy; a sticky error makes the backend unhealthy for good.
  void Note(const kernels::Error& err) {
    if (err.ok()) return;
    KVCD_LOG(ERROR) << "CUDA error: " << err.message();
    if (kc::LastErrorIsSticky()) sticky_.store(true);
  }
  absl::Status Failed(const kernels::Error& err) {
    Note(err);
    return KernelStatus(err, absl::StatusCode::kInternal, "CUDA");
  }

  // True if the device copy at d_i32 already holds `table` (see Attend). REQUIRES: mu_.
  bool TableStillOnDevice(const int32_t* d_i32, const std::vector<int32_t>& table) const {
    return last_table_.at == d_i32 && last_table_.generation == scratch_.generation() &&
           last_table_.table == table;
  }

  const int device_;
  const int sms_;
  // Lists beside the last one run on a second stream (KVCD_SIDE_STREAM=0 turns it off).
  const bool side_lists_ = SideListsFromEnv();
  const bool balanced_splits_ = BalancedSplitsFromEnv();
  const MergeMode merge_mode_ = MergeModeFromEnv();
  const bool rows_on_side_ = side_lists_ && RowsOnSideFromEnv();
  unsigned int* fold_counters_ = nullptr;  // FoldCountersLocked, under mu_
  uint32_t* side_word_ = nullptr;          // SideWordLocked, under mu_
  uint32_t side_word_value_ = 0;           // its last value queued, under mu_
  size_t fold_counters_size_ = 0;
  CudaSideStream side_;  // under mu_
  // The GPU side of PhaseTimes (KVCD_PHASE_TIMES=1 only): busy / idle spans of the stream.
  const std::unique_ptr<GpuTimeline> timeline_;
  std::mutex mu_;
  DeviceScratch scratch_;
  // One page list of Attend: a format's pages per sequence (kept across calls).
  struct List {
    const CudaPageFormat* format = nullptr;
    const char* name = "";  // the format's
    const PagePool* pool = nullptr;
    std::vector<std::vector<int32_t>> pages;
    std::vector<int32_t> lens;
    // NeedsPositions formats: per sequence, the position of the list's token 0 and where
    // the list's pages end in the sequence (they must be consecutive).
    std::vector<int64_t> first_pos, end_pos;
    int max_pages = 1, max_len = 0, splits = 0;
    size_t table_off = 0, len_off = 0, pos_off = 0;
  };
  std::vector<List> lists_;
  std::vector<int32_t> table_;  // the table Attend builds (page tables, lengths, faults)
  // The page tables, lengths and fault targets the last Attend queued into scratch_ (`at`
  // cleared before an upload, so a failed one leaves nothing to trust).
  struct UploadedTable {
    const int32_t* at = nullptr;
    uint64_t generation = 0;
    std::vector<int32_t> table;
  };
  UploadedTable last_table_;
  DeviceScratch ids_scratch_;
  DeviceScratch staging_;
  CudaFaultBoard faults_;
  PinnedUploader uploads_;
  mutable std::atomic<bool> sticky_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device) {
  // The process's device: every daemon thread that reaches CUDA (gRPC callbacks, the
  // executor, decode channels, NCCL links, cluster pulls, the reaper) binds it at its first
  // call into the kernels' host API (kernels/cuda/device_binding.cu says why there).
  KVCD_RETURN_IF_ERROR(KernelStatus(kc::SetDevice(device), absl::StatusCode::kUnavailable,
                                    absl::StrCat("CUDA device ", device, " unavailable")));
  return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(device));
}

}  // namespace kvcd
