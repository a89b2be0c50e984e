// Cost of refusing non-finite K/V and queries (issue #21.3) on the CPU hot path, in one
// process:
//  1. Page writes alone (the BF16 CPU format's WritePages of a qwen3-8b-shaped 1024-token
//     prompt, rows as given), measured three ways on the same pages, interleaved rep by
//     rep: no check; "before" = a separate FirstNonFinite pass over K and V, then the write
//     (what the engine did until the check was fused); "after" = the write with the check
//     fused into it (RowSource::check_finite, what the engine does now).
//  2. The whole CacheEngine Put as it runs now (fused check), and AttentionDecode's query
//     check against the call.
// Prints a table; pass an output path to write it as markdown.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/cli.h"
#include "kvcd/kernels/finite_check.h"
#include "proto/tensor_ref.h"
#include "server/engine/cache_engine.h"
#include "server/engine/model_profile.h"
#include "server/formats/bf16/bf16_format.h"
#include "server/formats/page_pool.h"
#include "testing/synthetic.h"

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
  const cli::Program program = {
      .name = "finite_check_bench",
      .summary = "cost of refusing non-finite K/V and queries on the CPU hot path",
      .files = {__FILE__},
      .synopsis = "[OUT.md]   (the table, also written to OUT.md as markdown)",
      .takes_args = true};
  const cli::Parsed parsed = cli::Parse(program, argc, argv);
  if (parsed.args.size() > 1) {
    return cli::UsageError(program, nullptr, "unexpected argument '" + parsed.args[1] + "'");
  }
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
  // Each rep stores a new prompt (a different seed), so every rep writes all pages.
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
  const int64_t kv_elems = 2 * spec.num_layers * n * spec.num_kv_heads * spec.head_dim;

  // 1. The page write alone, three ways, interleaved.
  const PageGeometry g{spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.page_size};
  const auto format = MakeBf16CpuFormat(g, nullptr);
  const int32_t num_pages = static_cast<int32_t>(n / spec.page_size);
  std::vector<uint8_t> memory(static_cast<size_t>(format->page_bytes()) * num_pages);
  PagePool pool("bf16", memory.data(), g.num_layers, format->layer_page_bytes(), num_pages);
  std::vector<int32_t> pages;
  if (!pool.Allocate(num_pages, &pages)) return 1;
  auto rows = [&](const v1::TensorRef& t, bool check) {
    RowSource r;
    r.data = t.inline_data().data();
    r.is_bf16 = true;
    r.token_stride = int64_t{spec.num_kv_heads} * spec.head_dim;
    r.layer_stride = n * r.token_stride;
    r.check_finite = check;
    r.name = "k";
    return r;
  };
  auto time_once = [](auto&& f) {
    const auto t0 = Clock::now();
    f();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  double plain_s = 1e30, before_s = 1e30, after_s = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const v1::PutRequest& req = puts[static_cast<size_t>(rep) % puts.size()];
    plain_s = std::min(
        plain_s, time_once([&] {
          if (!format->WritePages(rows(req.k(), false), rows(req.v(), false), 0, pages, pool).ok())
            std::abort();
        }));
    before_s = std::min(
        before_s, time_once([&] {
          for (const auto* t : {&req.k(), &req.v()}) {
            if (kernels::FirstNonFinite(t->inline_data().data(), kv_elems / 2, true) != -1)
              std::abort();
          }
          if (!format->WritePages(rows(req.k(), false), rows(req.v(), false), 0, pages, pool).ok())
            std::abort();
        }));
    after_s = std::min(
        after_s, time_once([&] {
          if (!format->WritePages(rows(req.k(), true), rows(req.v(), true), 0, pages, pool).ok())
            std::abort();
        }));
  }
  emit("| BF16 WritePages, 1024 tokens, 75.5 M values | time (ms) | over no check |\n");
  emit("|---|---|---|\n");
  std::snprintf(line, sizeof(line), "| no check | %.2f | - |\n", plain_s * 1e3);
  emit(line);
  std::snprintf(line, sizeof(line), "| before: separate scan, then write | %.2f | %+.1f%% |\n",
                before_s * 1e3, 100.0 * (before_s - plain_s) / plain_s);
  emit(line);
  std::snprintf(line, sizeof(line), "| after: check fused into the write | %.2f | %+.1f%% |\n\n",
                after_s * 1e3, 100.0 * (after_s - plain_s) / plain_s);
  emit(line);

  // 2. Whole calls as the engine runs them now.
  emit("| call | elements checked | call (ms) | scan (ms) | cost |\n");
  emit("|---|---|---|---|---|\n");
  int rep = 0;
  const double put_s = BestSeconds(3, [&] {
    v1::PutResponse resp;
    if (!engine.Put(puts[static_cast<size_t>(rep++)], &resp).ok()) std::abort();
  });
  std::snprintf(line, sizeof(line),
                "| Put, %lld tokens, BF16 K+V (check fused) | %lld | %.2f | in the write | "
                "%+.1f%% (fused vs no check above) |\n",
                static_cast<long long>(n), static_cast<long long>(kv_elems), put_s * 1e3,
                100.0 * (after_s - plain_s) / put_s);
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
  std::snprintf(line, sizeof(line),
                "| AttentionDecode, %lld-token history, F32 q | %lld | %.4f | %.5f | %.3f%% |\n",
                static_cast<long long>(n), static_cast<long long>(q_elems), dec_s * 1e3,
                dec_scan_s * 1e3, 100.0 * dec_scan_s / dec_s);
  emit(line);
  std::snprintf(line, sizeof(line), "\nscan throughput: %.2f GB/s (BF16 K/V)\n",
                static_cast<double>(kv_elems) * 2 / (before_s - plain_s) / 1e9);
  emit(line);
  if (!parsed.args.empty()) std::ofstream(parsed.args[0]) << out;
  return 0;
}

}  // namespace
}  // namespace kvcd

int main(int argc, char** argv) { return kvcd::Main(argc, argv); }
