// Host cost of the CUDA calls a per-layer decode call makes (issue #19): what one kernel
// launch, a programmatic-dependent launch, an event record (plain and interprocess), a
// stream wait on an interprocess event and a stream memory op cost the calling thread, and
// what the same four launches cost as a CUDA graph (captured and updated each call, or with
// its kernel nodes' parameters set each call, or launched unchanged).
//
// Each figure is host microseconds per call: the median over 200 rounds of 16 calls, timed
// with steady_clock around the calls only. Two conditions: the stream idle (a
// synchronize before each round) and the stream busy (each round queues behind a kernel that
// spins 300 µs, as the daemon's stream queues behind the worker's work). Run it with and
// without MPS (bench/run-h200-host-cost.sh) to see what MPS adds.
//
//   cuda_host_cost_bench [--rounds N]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/cli.h"
#include "cuda_bench.cuh"

namespace {

// About the size of the decode kernels' argument block (PartArgs: page list, geometry,
// pointers, scale, raw-query fields).
struct Args {
  const void* p[12];
  int32_t i[16];
};

__global__ void Empty(Args a) {
  if (a.i[0] == 12345 && threadIdx.x == 0) *static_cast<int*>(const_cast<void*>(a.p[0])) = 1;
}

__global__ void Spin(int64_t ns) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (static_cast<int64_t>(t - t0) >= ns) break;
  }
}

using WriteValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned);
WriteValueFn write_value = nullptr;

bool LoadWriteValue() {
  cudaDriverEntryPointQueryResult q{};
  void* fn = nullptr;
  if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &q) !=
          cudaSuccess ||
      fn == nullptr) {
    (void)cudaGetLastError();
    return false;
  }
  write_value = reinterpret_cast<WriteValueFn>(fn);
  return true;
}

double NowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Bench {
  cudaStream_t s = nullptr;
  int rounds = 200;
  static constexpr int kCalls = 16;

  // Median host µs per call of op over the rounds; busy: each round queues behind a spin.
  double Time(bool busy, const std::function<void()>& op) {
    std::vector<float> us;
    for (int r = 0; r < rounds + 10; ++r) {
      CHECK(cudaStreamSynchronize(s));
      if (busy) {
        Spin<<<1, 32, 0, s>>>(300000);
        CHECK(cudaGetLastError());
      }
      const double t0 = NowUs();
      for (int c = 0; c < kCalls; ++c) op();
      const double t1 = NowUs();
      if (r >= 10) us.push_back(static_cast<float>((t1 - t0) / kCalls));
    }
    CHECK(cudaStreamSynchronize(s));
    return Median(us);
  }
};

void Row(const char* what, double idle, double busy) {
  std::printf("| %-66s | %8.2f | %8.2f |\n", what, idle, busy);
}

}  // namespace

ABSL_FLAG(int32_t, rounds, Bench{}.rounds, "rounds per measurement (at least 10)");

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cuda_host_cost_bench",
      .summary = "host cost of the CUDA calls a per-layer decode call makes",
      .files = {__FILE__},
      .synopsis = "[--rounds N]"};
  kvcd::cli::Parse(program, argc, argv);
  Bench b;
  b.rounds = std::max(10, absl::GetFlag(FLAGS_rounds));
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device: nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s; host µs per call, median of %d rounds of %d calls\n", prop.name,
              b.rounds, Bench::kCalls);
  CHECK(cudaStreamCreateWithFlags(&b.s, cudaStreamNonBlocking));
  int* word = nullptr;
  CHECK(cudaMalloc(&word, 256));
  Args args{};
  args.p[0] = word;
  const dim3 grid(16, 8, 1), block(128);
  auto launch = [&] {
    Empty<<<grid, block, 0, b.s>>>(args);
    CHECK(cudaGetLastError());
  };
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  auto launch_pdl = [&] {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.stream = b.s;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&cfg, Empty, args));
  };
  cudaEvent_t plain, ipc;
  CHECK(cudaEventCreateWithFlags(&plain, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&ipc, cudaEventDisableTiming | cudaEventInterprocess));
  cudaIpcEventHandle_t handle;
  CHECK(cudaIpcGetEventHandle(&handle, ipc));
  CHECK(cudaEventRecord(ipc, b.s));

  std::printf("| %-66s | %8s | %8s |\n", "call", "idle", "busy");
  std::printf("|%s|---:|---:|\n", std::string(68, '-').c_str());
  auto both = [&](const char* what, const std::function<void()>& op) {
    const double idle = b.Time(false, op);
    const double busy = b.Time(true, op);
    Row(what, idle, busy);
  };
  both("kernel launch <<<>>> (176-byte arguments)", launch);
  both("cudaLaunchKernelEx, programmatic stream serialization", launch_pdl);
  both("cudaEventRecord (timing off)", [&] { CHECK(cudaEventRecord(plain, b.s)); });
  both("cudaEventRecord (interprocess event)", [&] { CHECK(cudaEventRecord(ipc, b.s)); });
  both("cudaStreamWaitEvent (interprocess event)",
       [&] { CHECK(cudaStreamWaitEvent(b.s, ipc, 0)); });
  if (LoadWriteValue()) {
    uint32_t v = 0;
    both("cuStreamWriteValue32 (device word)", [&] {
      const CUresult r =
          write_value(reinterpret_cast<CUstream>(b.s), reinterpret_cast<CUdeviceptr>(word), ++v, 0);
      if (r != CUDA_SUCCESS) {
        std::fprintf(stderr, "cuStreamWriteValue32 failed: %d\n", static_cast<int>(r));
        std::exit(1);
      }
    });
  }

  // Four launches per decode call (query fragments, decode, merge; window), as today and as
  // a graph. Arguments change each call (the layer's pool base), as in the daemon.
  auto four = [&](bool pdl) {
    ++args.i[1];
    launch();
    launch();
    pdl ? launch_pdl() : launch();
    pdl ? launch_pdl() : launch();
  };
  both("4 launches (2 plain + 2 programmatic), per decode call", [&] { four(true); });
  both("4 launches (2 plain + 2 programmatic) + interprocess event record", [&] {
    four(true);
    CHECK(cudaEventRecord(ipc, b.s));
  });
  both("4 plain launches + interprocess event record", [&] {
    four(false);
    CHECK(cudaEventRecord(ipc, b.s));
  });

  // Captured once: the executable graph and its kernel nodes.
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamBeginCapture(b.s, cudaStreamCaptureModeThreadLocal));
  four(true);
  CHECK(cudaStreamEndCapture(b.s, &graph));
  cudaGraphExec_t exec = nullptr;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  size_t num_nodes = 0;
  CHECK(cudaGraphGetNodes(graph, nullptr, &num_nodes));
  std::vector<cudaGraphNode_t> nodes(num_nodes);
  CHECK(cudaGraphGetNodes(graph, nodes.data(), &num_nodes));
  std::printf("(captured graph: %zu nodes)\n", num_nodes);

  both("graph: cudaGraphLaunch, 4 kernel nodes unchanged",
       [&] { CHECK(cudaGraphLaunch(exec, b.s)); });
  both("graph: set 4 kernel nodes' arguments + cudaGraphLaunch", [&] {
    ++args.i[1];
    for (cudaGraphNode_t node : nodes) {
      cudaKernelNodeParams p{};
      CHECK(cudaGraphKernelNodeGetParams(node, &p));
      void* kargs[1] = {&args};
      p.kernelParams = kargs;
      CHECK(cudaGraphExecKernelNodeSetParams(exec, node, &p));
    }
    CHECK(cudaGraphLaunch(exec, b.s));
  });
  both("graph: capture 4 launches + cudaGraphExecUpdate + cudaGraphLaunch", [&] {
    cudaGraph_t g = nullptr;
    CHECK(cudaStreamBeginCapture(b.s, cudaStreamCaptureModeThreadLocal));
    four(true);
    CHECK(cudaStreamEndCapture(b.s, &g));
    cudaGraphExecUpdateResultInfo info{};
    CHECK(cudaGraphExecUpdate(exec, g, &info));
    if (info.result != cudaGraphExecUpdateSuccess) {
      std::fprintf(stderr, "cudaGraphExecUpdate refused the captured graph (%d)\n",
                   static_cast<int>(info.result));
      std::exit(1);
    }
    CHECK(cudaGraphLaunch(exec, b.s));
    CHECK(cudaGraphDestroy(g));
  });
  CHECK(cudaStreamSynchronize(b.s));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaEventDestroy(plain));
  CHECK(cudaEventDestroy(ipc));
  CHECK(cudaFree(word));
  CHECK(cudaStreamDestroy(b.s));
  return 0;
}
