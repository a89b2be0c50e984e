// What a cross-process dependency costs on the GPU (issue #19, "measure what a stream
// memory-op wait costs under MPS against an IPC event wait before building it"): two
// processes on one GPU — a "worker" and a "daemon", as kvcd_decode_worker and kvcd over the
// decode channel — play ping-pong. Each round the worker queues its kernels and signals, the
// daemon's stream waits for that signal, queues its kernels and signals back, and the
// worker's stream waits for the daemon's signal. The hosts exchange one message per round
// through shared memory (as the decode channel does) and never wait for the GPU, unless a
// mode says so; a round's time is the GPU's (N rounds, then one synchronize).
//
//   cuda_doorbell_bench [--rounds N] [--worker-kernels A] [--daemon-kernels B] [--kernel-us U]
//
// Modes (one line each: GPU µs per round, host µs per round to queue it):
//   events           IPC events: cudaEventRecord + cudaStreamWaitEvent (today's channel)
//   events+host      the same, and the worker's host waits for each round's end
//   memops           flags in the daemon's device memory (CUDA IPC):
//                    cuStreamWriteValue32 / cuStreamWaitValue32 (GEQ), host messages kept
//   memops+host      the same, and the worker's host waits for each round's end
//   memops-queued    memops, no host messages: the daemon queues every round ahead
//   one-process      the floor: the A + B kernels of a round in one stream, one process
// Kernels are one-warp stores ("ticks"), each spinning U µs (default 0) first: with U = 0
// the figures are the cost of the dependencies and of the launches, not of work; with U
// large enough that the GPU, not the hosts, sets the pace, a mode's GPU time per round minus
// one-process's is what its cross-process dependencies cost the GPU. Run it under MPS to
// match the daemon's setting.
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"

namespace {

constexpr int kModes = 5;
const char* const kModeNames[kModes] = {"events", "events+host", "memops", "memops+host",
                                        "memops-queued"};
bool UsesEvents(int m) { return m <= 1; }
bool HostWaits(int m) { return m == 1 || m == 3; }
bool Queued(int m) { return m == 4; }

struct Shared {
  cudaIpcEventHandle_t ev_worker, ev_daemon;
  cudaIpcMemHandle_t flags;
  std::atomic<int> worker_ready, daemon_ready, failed;
  std::atomic<int> mode_start[kModes], mode_done[kModes], mode_printed[kModes];
  alignas(64) std::atomic<uint32_t> req[kModes];
  alignas(64) std::atomic<uint32_t> resp[kModes];
};

using WaitFn = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
WaitFn wait_value = nullptr;
WaitFn write_value = nullptr;

// Stores v after spinning `ns` nanoseconds of the GPU's global timer (0: no spin).
__global__ void Tick(uint32_t* p, uint32_t v, uint64_t ns) {
  if (ns > 0) {
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
  }
  if (threadIdx.x == 0) p[blockIdx.x] = v;
}
uint64_t tick_ns = 0;

double Now() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double P50(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

bool Ok(cudaError_t e, const char* what, Shared* sh) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "doorbell: %s: %s\n", what, cudaGetErrorString(e));
  sh->failed.store(1);
  return false;
}
bool Ok(CUresult r, const char* what, Shared* sh) {
  if (r == CUDA_SUCCESS) return true;
  std::fprintf(stderr, "doorbell: %s: CUresult %d\n", what, static_cast<int>(r));
  sh->failed.store(1);
  return false;
}

// Spins until *a >= v; false if the other side failed or 20 s passed.
template <typename T>
bool SpinUntil(const std::atomic<T>& a, T v, Shared* sh) {
  const double deadline = Now() + 20e6;
  for (uint64_t n = 0; a.load(std::memory_order_acquire) < v; ++n) {
    if ((n & 1023) == 0 && (sh->failed.load() != 0 || Now() > deadline)) return false;
  }
  return true;
}

// The driver's entry point `name` (no libcuda link: the runtime hands it out).
bool EntryPoint(const char* name, WaitFn* out, Shared* sh) {
  cudaDriverEntryPointQueryResult q{};
  void* fn = nullptr;
  if (!Ok(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q), name, sh) ||
      fn == nullptr)
    return false;
  *out = reinterpret_cast<WaitFn>(fn);
  return true;
}

bool LoadMemops(Shared* sh) {
  return EntryPoint("cuStreamWaitValue32", &wait_value, sh) &&
         EntryPoint("cuStreamWriteValue32", &write_value, sh);
}

// The flag words of mode m: worker -> daemon at 2m, daemon -> worker at 2m + 1 (64 B apart).
CUdeviceptr Flag(void* flags, int m, int dir) {
  return reinterpret_cast<CUdeviceptr>(static_cast<char*>(flags) + (2 * m + dir) * 64);
}

int Daemon(Shared* sh, int rounds, int kernels) {
  if (!Ok(cudaSetDevice(0), "set device", sh) || !LoadMemops(sh)) return 1;
  cudaStream_t s;
  cudaEvent_t ev, ev_worker;
  void* flags = nullptr;
  uint32_t* sink = nullptr;
  if (!Ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream", sh) ||
      !Ok(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess), "event",
          sh) ||
      !Ok(cudaIpcGetEventHandle(&sh->ev_daemon, ev), "event handle", sh) ||
      !Ok(cudaMalloc(&flags, 64 * 2 * kModes), "flags", sh) ||
      !Ok(cudaMemset(flags, 0, 64 * 2 * kModes), "flags", sh) ||
      !Ok(cudaMalloc(&sink, 64 * sizeof(uint32_t)), "sink", sh) ||
      !Ok(cudaIpcGetMemHandle(&sh->flags, flags), "flags handle", sh) ||
      !Ok(cudaDeviceSynchronize(), "sync", sh))
    return 1;
  sh->daemon_ready.store(1);
  if (!SpinUntil(sh->worker_ready, 1, sh)) return 1;
  if (!Ok(cudaIpcOpenEventHandle(&ev_worker, sh->ev_worker), "open worker event", sh)) return 1;
  for (int m = 0; m < kModes; ++m) {
    if (!SpinUntil(sh->mode_start[m], 1, sh)) return 1;
    // The daemon's host time per round in three steps: the wait it queues, its launches,
    // the signal it records (medians printed after the worker's line of the mode).
    std::vector<double> t_wait, t_launch, t_signal;
    for (uint32_t i = 1; i <= static_cast<uint32_t>(rounds); ++i) {
      if (!Queued(m) && !SpinUntil(sh->req[m], i, sh)) return 1;
      const double h0 = Now();
      const bool ok =
          UsesEvents(m)
              ? Ok(cudaStreamWaitEvent(s, ev_worker, 0), "wait event", sh)
              : Ok(wait_value(s, Flag(flags, m, 0), i, CU_STREAM_WAIT_VALUE_GEQ), "wait value", sh);
      if (!ok) return 1;
      const double h1 = Now();
      for (int k = 0; k < kernels; ++k) Tick<<<1, 32, 0, s>>>(sink, i, tick_ns);
      const double h2 = Now();
      if (!(UsesEvents(m) ? Ok(cudaEventRecord(ev, s), "record", sh)
                          : Ok(write_value(s, Flag(flags, m, 1), i, CU_STREAM_WRITE_VALUE_DEFAULT),
                               "write value", sh)))
        return 1;
      const double h3 = Now();
      sh->resp[m].store(i, std::memory_order_release);
      t_wait.push_back(h1 - h0);
      t_launch.push_back(h2 - h1);
      t_signal.push_back(h3 - h2);
    }
    if (!Ok(cudaStreamSynchronize(s), "daemon sync", sh)) return 1;
    if (!SpinUntil(sh->mode_printed[m], 1, sh)) return 1;
    std::printf("  daemon host p50 per round: wait %.2f us, %d launches %.2f us, signal %.2f us\n",
                P50(t_wait), kernels, P50(t_launch), P50(t_signal));
    std::fflush(stdout);
    sh->mode_done[m].store(1);
  }
  return 0;
}

int Worker(Shared* sh, int rounds, int warmup, int kernels, int daemon_kernels) {
  if (!Ok(cudaSetDevice(0), "set device", sh) || !LoadMemops(sh)) return 1;
  cudaStream_t s;
  cudaEvent_t ev, ev_daemon;
  uint32_t* sink = nullptr;
  if (!Ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream", sh) ||
      !Ok(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess), "event",
          sh) ||
      !Ok(cudaIpcGetEventHandle(&sh->ev_worker, ev), "event handle", sh) ||
      !Ok(cudaMalloc(&sink, 64 * sizeof(uint32_t)), "sink", sh))
    return 1;
  if (!SpinUntil(sh->daemon_ready, 1, sh)) return 1;
  void* flags = nullptr;
  if (!Ok(cudaIpcOpenEventHandle(&ev_daemon, sh->ev_daemon), "open daemon event", sh) ||
      !Ok(cudaIpcOpenMemHandle(&flags, sh->flags, cudaIpcMemLazyEnablePeerAccess), "open flags",
          sh))
    return 1;
  sh->worker_ready.store(1);
  const int total = rounds;
  for (int m = 0; m < kModes; ++m) {
    sh->mode_start[m].store(1);
    double t0 = Now();
    for (uint32_t i = 1; i <= static_cast<uint32_t>(total); ++i) {
      if (i == static_cast<uint32_t>(warmup) + 1) {
        if (!Ok(cudaStreamSynchronize(s), "worker sync", sh)) return 1;
        t0 = Now();
      }
      for (int k = 0; k < kernels; ++k) Tick<<<1, 32, 0, s>>>(sink, i, tick_ns);
      if (!(UsesEvents(m) ? Ok(cudaEventRecord(ev, s), "record", sh)
                          : Ok(write_value(s, Flag(flags, m, 0), i, CU_STREAM_WRITE_VALUE_DEFAULT),
                               "write value", sh)))
        return 1;
      sh->req[m].store(i, std::memory_order_release);
      if (!Queued(m) && !SpinUntil(sh->resp[m], i, sh)) return 1;
      const bool ok =
          UsesEvents(m)
              ? Ok(cudaStreamWaitEvent(s, ev_daemon, 0), "wait event", sh)
              : Ok(wait_value(s, Flag(flags, m, 1), i, CU_STREAM_WAIT_VALUE_GEQ), "wait value", sh);
      if (!ok) return 1;
      if (HostWaits(m) && !Ok(cudaStreamSynchronize(s), "worker sync", sh)) return 1;
    }
    const double th = Now();
    if (!Ok(cudaStreamSynchronize(s), "worker sync", sh)) return 1;
    const double t1 = Now();
    const int n = total - warmup;
    std::printf(
        "doorbell %-14s gpu_us_per_round %7.2f  host_us_per_round %7.2f  (%d rounds, %d + %d "
        "kernels of %.1f us)\n",
        kModeNames[m], (t1 - t0) / n, (th - t0) / n, n, kernels, daemon_kernels, tick_ns / 1e3);
    std::fflush(stdout);
    sh->mode_printed[m].store(1);
    if (!SpinUntil(sh->mode_done[m], 1, sh)) return 1;
  }
  // The floor: both sides' kernels of a round in one stream of one process.
  double t0 = 0;
  for (int i = 1; i <= total; ++i) {
    if (i == warmup + 1) {
      if (!Ok(cudaStreamSynchronize(s), "worker sync", sh)) return 1;
      t0 = Now();
    }
    for (int k = 0; k < kernels + daemon_kernels; ++k) Tick<<<1, 32, 0, s>>>(sink, i, tick_ns);
  }
  const double th = Now();
  if (!Ok(cudaStreamSynchronize(s), "worker sync", sh)) return 1;
  const double t1 = Now();
  std::printf(
      "doorbell %-14s gpu_us_per_round %7.2f  host_us_per_round %7.2f  (%d rounds, %d kernels of "
      "%.1f us)\n",
      "one-process", (t1 - t0) / (total - warmup), (th - t0) / (total - warmup), total - warmup,
      kernels + daemon_kernels, tick_ns / 1e3);
  (void)cudaIpcCloseMemHandle(flags);
  return 0;
}

}  // namespace

ABSL_FLAG(int32_t, rounds, 2000, "ping-pong rounds (at least 2)");
ABSL_FLAG(int32_t, worker_kernels, 3, "kernels the worker queues per round");
ABSL_FLAG(int32_t, daemon_kernels, 6, "kernels the daemon queues per round");
ABSL_FLAG(double, kernel_us, 0, "length of each kernel in microseconds (0: empty kernels)");

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cuda_doorbell_bench",
      .summary = "what a cross-process dependency costs on the GPU",
      .files = {__FILE__},
      .synopsis = "[--rounds N] [--worker-kernels A] [--daemon-kernels B] [--kernel-us U]"};
  kvcd::cli::Parse(program, argc, argv);
  const int rounds = absl::GetFlag(FLAGS_rounds),
            worker_kernels = absl::GetFlag(FLAGS_worker_kernels),
            daemon_kernels = absl::GetFlag(FLAGS_daemon_kernels);
  tick_ns = static_cast<uint64_t>(absl::GetFlag(FLAGS_kernel_us) * 1000);
  if (rounds < 2 || worker_kernels < 0 || daemon_kernels < 0) {
    std::fprintf(stderr, "doorbell: --rounds must be >= 2 and kernel counts >= 0\n");
    return 2;
  }
  const int warmup = std::max(1, rounds / 10);
  // Shared before fork, and no CUDA call before it: each process makes its own context.
  void* mem =
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  auto* sh = new (mem) Shared();
  const pid_t pid = fork();
  if (pid < 0) {
    std::perror("fork");
    return 1;
  }
  if (pid == 0) _exit(Daemon(sh, rounds + warmup, daemon_kernels));
  const int rc = Worker(sh, rounds + warmup, warmup, worker_kernels, daemon_kernels);
  if (rc != 0) sh->failed.store(1);
  int status = 0;
  waitpid(pid, &status, 0);
  const bool daemon_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!daemon_ok) std::fprintf(stderr, "doorbell: the daemon process failed\n");
  return rc == 0 && daemon_ok ? 0 : 1;
}
