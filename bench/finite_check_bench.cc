// Cost of refusing non-finite K/V and queries (issue #21.3) on the CPU hot path: the
// finite scan alone against the whole CacheEngine call it guards, for a Put of a
// qwen3-8b-shaped prompt and for AttentionDecode over its history, in one process.
// "before" = the call minus the scan (the scan is the only work the check adds); "after"
// = the call as it runs now. Prints a table; pass an output path to write it as markdown.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "client/synthetic.h"
#include "common/tensor_ref.h"
#include "kvcd/kernels/finite_check.h"
#include "server/engine/cache_engine.h"

namespace kvcd {
namespace {

using Clock = std::chrono::steady_clock;

template <class F>
double BestSeconds(int reps, F&& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

int Main(int argc, char** argv) {
  ServerConfig config;
  config.memory_budget_bytes = 2ull << 30;
  config.compute_threads = 2;
  CacheEngine engine(config, MakeCpuBackend(2));
  ModelSpec spec = *BuiltinModelSpec("qwen3-8b");
  spec.memory_bytes = 1ull << 30;
  if (!engine.RegisterModelSpec(spec).ok()) return 1;
  v1::ModelProfile p;
  ProfileFromSpec(spec, &p);
  const int64_t n = 1024;  // prompt tokens
  const std::vector<int64_t> shape = {spec.num_layers, n, spec.num_kv_heads, spec.head_dim};
  std::string out;
  char line[256];
  auto emit = [&](const char* s) {
    std::printf("%s", s);
    out += s;
  };
  emit("| call | elements checked | call (ms) | scan (ms) | before = call - scan (ms) | cost |\n");
  emit("|---|---|---|---|---|---|\n");
  // Put: each rep stores a new prompt (a different seed), so every rep writes all pages.
  std::vector<v1::PutRequest> puts;
  for (int r = 0; r < 3; ++r) {
    v1::PutRequest req;
    req.set_model(spec.name);
    const auto t = synthetic::Tokens(100 + r, 0, n);
    req.mutable_tokens()->Add(t.begin(), t.end());
    SetBf16FromFloat(req.mutable_k(), shape, synthetic::Kv(100 + r, p, 0, n, 0).data());
    SetBf16FromFloat(req.mutable_v(), shape, synthetic::Kv(100 + r, p, 0, n, 1).data());
    puts.push_back(std::move(req));
  }
  int rep = 0;
  const double put_s = BestSeconds(3, [&] {
    v1::PutResponse resp;
    if (!engine.Put(puts[static_cast<size_t>(rep++)], &resp).ok()) std::abort();
  });
  const int64_t kv_elems = 2 * spec.num_layers * n * spec.num_kv_heads * spec.head_dim;
  const double put_scan_s = BestSeconds(5, [&] {
    for (const auto* t : {&puts[0].k(), &puts[0].v()}) {
      if (kernels::FirstNonFinite(t->inline_data().data(), kv_elems / 2, true) != -1) std::abort();
    }
  });
  std::snprintf(line, sizeof(line),
                "| Put, %lld tokens, BF16 K+V | %lld | %.2f | %.2f | %.2f | %.2f%% |\n",
                static_cast<long long>(n), static_cast<long long>(kv_elems), put_s * 1e3,
                put_scan_s * 1e3, (put_s - put_scan_s) * 1e3, 100.0 * put_scan_s / put_s);
  emit(line);
  // AttentionDecode over the stored prompt: batch 1, F32 queries, one layer.
  v1::OpenSequenceRequest open;
  open.set_model(spec.name);
  const auto t = synthetic::Tokens(100, 0, n);
  open.mutable_tokens()->Add(t.begin(), t.end());
  v1::OpenSequenceResponse opened;
  if (!engine.OpenSequence(open, &opened).ok()) return 1;
  v1::AttentionDecodeRequest dec;
  dec.set_layer(3);
  dec.add_sequence_ids(opened.sequence_id());
  const auto q = synthetic::Row(100, p, 3, n, 2);
  SetF32Tensor(dec.mutable_q(), {1, spec.num_q_heads, spec.head_dim}, q.data());
  const double dec_s = BestSeconds(200, [&] {
    v1::AttentionDecodeResponse resp;
    if (!engine.AttentionDecode(dec, &resp).ok()) std::abort();
  });
  const int64_t q_elems = int64_t{spec.num_q_heads} * spec.head_dim;
  const double dec_scan_s = BestSeconds(2000, [&] {
    if (kernels::FirstNonFinite(dec.q().inline_data().data(), q_elems, false) != -1) std::abort();
  });
  std::snprintf(
      line, sizeof(line),
      "| AttentionDecode, %lld-token history, F32 q | %lld | %.4f | %.5f | %.4f | %.3f%% |\n",
      static_cast<long long>(n), static_cast<long long>(q_elems), dec_s * 1e3, dec_scan_s * 1e3,
      (dec_s - dec_scan_s) * 1e3, 100.0 * dec_scan_s / dec_s);
  emit(line);
  std::snprintf(line, sizeof(line), "\nscan throughput: %.2f GB/s (BF16 K/V)\n",
                static_cast<double>(kv_elems) * 2 / put_scan_s / 1e9);
  emit(line);
  if (argc > 1) std::ofstream(argv[1]) << out;
  return 0;
}

}  // namespace
}  // namespace kvcd

int main(int argc, char** argv) { return kvcd::Main(argc, argv); }
