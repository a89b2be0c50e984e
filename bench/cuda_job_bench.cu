// Job-level decode throughput under a fixed pool budget (issue #36, last bullet): how many
// concurrent sequences a budget of GPU memory holds in each history format, and how many
// tokens/s one decode step over all of them gives, on the kernels the daemon launches.
//
// The workload: one shared system prompt (its pages held once, as kvcd's prefix cache holds
// them) plus one history per session with the prompt lengths of a request trace (Mooncake's
// synthetic trace, ../shared/data/traces/), clipped to a context limit, sessions taken in the
// trace's order while their pages fit the budget. Qwen3-8B: 36 layers, 32 query heads, 8 KV
// heads, head_dim 128, pages of 64 tokens.
//  - BF16 history: every token in BF16 pages (4 KB per token-layer).
//  - INT2 (int2-oscar) and int2-transform history: the daemon's split of a sequence, the
//    sink window (the prompt's first 64 tokens, shared) and the recent window (the
//    session's last 256 tokens) in BF16 pages, the rest in the history format.
// One decode step = per layer the daemon's launches for the whole batch (every held
// sequence): BF16 windows through the split BF16 kernel into parts, then the history
// format's kernel (INT2: v2 kernel with the fused merge; int2-transform: tensor-core or FP32
// kernel, then LaunchMergeParts), the layers' pages distinct (layer-major pool). Not
// counted: the row store of the step's new token (one row per sequence and layer) and the
// process boundary (this is the daemon's GPU work in one process). Each format runs twice:
// with each kernel's own split count (KVCD_SPLITS=kernel in the daemon; sized for a
// batch of equal lengths) and with the history's splits sized by the longest sequence
// ("balanced": the formats' rule, the daemon's default, kvcd/kernels/cuda_split_balance.h).
// Pages hold random codes with valid parameters (times do not depend on the values; the
// kernel tests check results against the float64 oracle); queries are random.
//
//   cuda_job_bench --trace ../shared/data/traces/mooncake_synthetic_trace.jsonl
//                  [--budget_gb 60] [--system_tokens 2048] [--max_context 131072]
//                  [--formats bf16,int2,int2-transform] [--steps 5] [--out FILE.md]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "common/key_transform_profile.h"
#include "cuda_bench.cuh"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cuda_bf16_split_attention.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_split_balance.h"
#include "kvcd/kernels/cuda_transform.h"
#include "kvcd/kernels/int2_attention.h"
#include "transform_device_codec.cuh"

namespace kk = kvcd::kernels;
namespace kc = kvcd::kernels::cuda;

ABSL_FLAG(std::string, trace, "", "request trace (JSON lines with input_length)");
ABSL_FLAG(double, budget_gb, 60.0, "pool budget in GB (1e9 bytes) for every format");
ABSL_FLAG(int32_t, system_tokens, 2048, "shared system prompt tokens (a multiple of 64)");
ABSL_FLAG(int32_t, max_context, 131072, "context limit: system prompt + session history");
ABSL_FLAG(std::string, formats, "bf16,int2,int2-transform", "history formats, comma-separated");
ABSL_FLAG(std::string, transform_kernel, "tc", "int2-transform decode kernel: tc or fp32");
ABSL_FLAG(std::string, splits, "both",
          "history splits: kernel (each kernel's own count: KVCD_SPLITS=kernel), balanced (sized "
          "by the longest "
          "sequence), or both");
ABSL_FLAG(int32_t, steps, 5, "timed decode steps (after one warm-up step)");
ABSL_FLAG(std::string, out, "", "also write the table to this Markdown file");

namespace {

constexpr int kLayers = 36, kHq = 32, kHkv = 8, kD = 128, kPs = 64;
constexpr int kSink = 64, kRecent = 256;

// Prompt lengths of the trace, in order.
std::vector<int> TraceLengths(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "cannot read the trace %s\n", path.c_str());
    std::exit(2);
  }
  std::vector<int> out;
  std::string line;
  const std::string key = "\"input_length\":";
  while (std::getline(in, line)) {
    const size_t at = line.find(key);
    if (at == std::string::npos) continue;
    out.push_back(std::atoi(line.c_str() + at + key.size()));
  }
  if (out.empty()) {
    std::fprintf(stderr, "no input_length in %s\n", path.c_str());
    std::exit(2);
  }
  return out;
}

int Pages(int64_t tokens) { return static_cast<int>((tokens + kPs - 1) / kPs); }

// Random BF16 values in +-[1/16, 2) (never NaN or Inf).
__global__ void FillBf16(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 0x2c1b3c6du;
    x ^= x >> 12;
    p[i] = static_cast<uint16_t>((x & 0x8000u) | ((0x7bu + ((x >> 8) & 3u)) << 7) | (x & 0x7fu));
  }
}

// One page list of a batch: table [batch][max_pages], lengths [batch] on the device.
struct DeviceList {
  int32_t* table = nullptr;
  int32_t* lengths = nullptr;
  int max_pages = 0, max_len = 0;
  DeviceList(const std::vector<std::vector<int32_t>>& rows, const std::vector<int32_t>& lens) {
    for (const auto& r : rows) max_pages = std::max(max_pages, static_cast<int>(r.size()));
    for (int32_t l : lens) max_len = std::max(max_len, static_cast<int>(l));
    max_pages = std::max(max_pages, 1);
    std::vector<int32_t> flat(rows.size() * max_pages, 0);
    for (size_t b = 0; b < rows.size(); ++b)
      std::copy(rows[b].begin(), rows[b].end(), flat.begin() + b * max_pages);
    table = Upload(flat);
    lengths = Upload(lens);
  }
  ~DeviceList() {
    cudaFree(table);
    cudaFree(lengths);
  }
  DeviceList(const DeviceList&) = delete;
  DeviceList& operator=(const DeviceList&) = delete;
};

struct Result {
  std::string format;
  int held = 0, splits = 0;
  bool balanced = false;
  int64_t tokens = 0;  // history tokens held (system prompt once)
  double pool_gb = 0, step_ms = 0, step_ms_spread = 0, tok_s = 0, read_gb = 0;
};

Result RunFormat(const std::string& fmt, const std::vector<int>& trace, int64_t budget, int system,
                 int max_context, int steps, bool tc, bool balanced, int sms, cudaStream_t stream) {
  const bool bf16 = fmt == "bf16", xform = fmt == "int2-transform";
  if (!bf16 && !xform && fmt != "int2") {
    std::fprintf(stderr, "unknown format %s\n", fmt.c_str());
    std::exit(2);
  }
  const int64_t bf16_page = kk::Bf16PageElems(kHkv, kPs, kD) * 2;
  std::unique_ptr<TransformDeviceCodec> codec;
  int64_t hist_page = bf16_page;
  kk::TransformPageLayout xlayout{kHkv, kPs, kD, 0};
  if (xform) {
    codec = std::make_unique<TransformDeviceCodec>(
        kvcd::KeyTransformProfile::SyntheticHeads(kLayers, kHkv, kD, 7), kD);
    xlayout.code_bytes = codec->code_bytes;
    hist_page = xlayout.Bytes();
  } else if (!bf16) {
    hist_page = kk::Int2PageBytes(kHkv, kPs, kD);
  }
  // Pages per layer the budget allows, in each pool (history format, BF16 windows), and the
  // sessions that fit: shared pages first, then each session's own while they fit.
  const int64_t per_layer_budget = budget / kLayers;
  std::vector<int> hist;  // session history tokens, in trace order
  int64_t hist_pages = bf16 ? Pages(system) : Pages(system - kSink);
  int64_t win_pages = bf16 ? 0 : 1;  // the sink page (shared)
  const int64_t shared_hist = hist_pages, shared_win = win_pages;
  for (int len : trace) {
    const int h = std::clamp(len, kRecent, max_context - system);
    const int64_t hp = bf16 ? Pages(h) : Pages(h - kRecent), wp = bf16 ? 0 : Pages(kRecent);
    if ((hist_pages + hp) * hist_page + (win_pages + wp) * bf16_page > per_layer_budget) break;
    hist_pages += hp;
    win_pages += wp;
    hist.push_back(h);
  }
  Result r;
  r.format = fmt;
  r.balanced = balanced;
  r.held = static_cast<int>(hist.size());
  r.tokens = system;
  for (int h : hist) r.tokens += h;
  const int64_t hist_layer = hist_pages * hist_page, win_layer = win_pages * bf16_page;
  r.pool_gb = static_cast<double>(hist_layer + win_layer) * kLayers / 1e9;
  if (r.held == 0) return r;
  // Pools, layer-major: layer l's pages at base + l * layer bytes.
  uint8_t *hpool = nullptr, *wpool = nullptr;
  CHECK(cudaMalloc(&hpool, hist_layer * kLayers));
  if (bf16 || fmt == "int2") {
    if (bf16) {
      FillBf16<<<4096, 256, 0, stream>>>(reinterpret_cast<uint16_t*>(hpool),
                                         hist_layer * kLayers / 2, 3u);
    } else {
      FillPages<<<4096, 256, 0, stream>>>(hpool, hist_pages * kLayers, hist_page, kPs,
                                          2 * int64_t{kHkv} * kPs * (kD / 4), 7u);
    }
  } else {
    const kc::TransformPageOffsets off(xlayout);
    FillPages<<<4096, 256, 0, stream>>>(hpool, hist_pages * kLayers, hist_page, kPs, off.v_params,
                                        11u, off.k_gains, int64_t{kHkv} * kPs * 2);
  }
  CHECK(cudaGetLastError());
  if (win_layer > 0) {
    CHECK(cudaMalloc(&wpool, win_layer * kLayers));
    FillBf16<<<4096, 256, 0, stream>>>(reinterpret_cast<uint16_t*>(wpool), win_layer * kLayers / 2,
                                       5u);
    CHECK(cudaGetLastError());
  }
  // Page tables: shared pages, then the session's own (consecutive in its pool).
  const int batch = r.held;
  std::vector<std::vector<int32_t>> ht(batch), wt(batch);
  std::vector<int32_t> hl(batch), wl(batch);
  int32_t next_h = static_cast<int32_t>(shared_hist), next_w = static_cast<int32_t>(shared_win);
  for (int b = 0; b < batch; ++b) {
    for (int32_t p = 0; p < shared_hist; ++p) ht[b].push_back(p);
    const int own = bf16 ? hist[b] : hist[b] - kRecent;
    for (int p = 0; p < Pages(own); ++p) ht[b].push_back(next_h++);
    hl[b] = static_cast<int32_t>((bf16 ? system : system - kSink) + own);
    if (!bf16) {
      wt[b].push_back(0);
      for (int p = 0; p < Pages(kRecent); ++p) wt[b].push_back(next_w++);
      wl[b] = kSink + kRecent;
    }
  }
  const DeviceList hlist(ht, hl);
  std::unique_ptr<DeviceList> wlist;
  if (!bf16) wlist = std::make_unique<DeviceList>(wt, wl);
  const kc::DecodeGeometry geo{batch, kHq, kHkv, kD, kPs};
  const int rows = batch * kHq;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(rows) * kD);
  for (auto& x : q) x = normal(rng);
  float* d_q = Upload(q);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  // Splits as the daemon's formats choose them (AttendSplits): "kernel", each kernel's own
  // count (sized for a batch of equal lengths: one wave of CTAs; KVCD_SPLITS=kernel);
  // "balanced", sized by the longest list when the lengths differ (the daemon's default,
  // kvcd/kernels/cuda_split_balance.h). With the trace's lengths (up to ~8x the mean) the
  // kernels' own count leaves one CTA walking the longest sequence alone while the others are
  // done; the balanced rule gives each CTA at most half of an even share of one wave's tokens
  // (CTAs past a sequence's length exit at once).
  int64_t w_total = 0, h_total = 0;
  for (int32_t n : wl) w_total += n;
  for (int32_t n : hl) h_total += n;
  const int64_t bf16_wave = int64_t{std::max(1, kc::Bf16SplitCtasPerSm(kD))} * sms;
  const int w_uniform =
      bf16 ? 0 : kc::Bf16DecodeSplits(kc::Bf16Kernel::kSplit, batch, kHkv, kD, wlist->max_len, sms);
  const int w_splits = balanced && !bf16 ? kc::BalancedSplits(w_uniform, batch, kHkv,
                                                              wlist->max_len, w_total, bf16_wave)
                                         : w_uniform;
  const kc::TransformPageOffsets xoff(xlayout);
  const bool use_tc = xform && tc && kc::TransformTensorCoreServes(geo, xoff);
  constexpr int kUnbounded = 1 << 30;
  const int h_uniform =
      bf16 ? kc::Bf16DecodeSplits(kc::Bf16Kernel::kSplit, batch, kHkv, kD, hlist.max_len, sms)
      : xform
          ? (use_tc ? kc::TransformTcDecodeSplits(batch, kHq, kHkv, hlist.max_len, sms)
                    : kc::TransformDecodeSplits(batch, kHkv, hlist.max_len, sms))
          : kc::Int2DecodeSplits(batch, kHkv, hlist.max_len, sms, kc::Int2CtasPerSm(kHq, kHkv, kD));
  // The kernel's wave: its count for one sequence of one KV head, unbounded by tokens.
  const int64_t h_wave =
      bf16    ? bf16_wave
      : xform ? (use_tc ? kc::TransformTcDecodeSplits(1, kHq / kHkv, 1, kUnbounded, sms)
                        : kc::TransformDecodeSplits(1, 1, kUnbounded, sms))
              : int64_t{kc::Int2CtasPerSm(kHq, kHkv, kD)} * sms;
  const int splits_h =
      balanced ? kc::BalancedSplits(h_uniform, batch, kHkv, hlist.max_len, h_total, h_wave)
               : h_uniform;
  r.splits = splits_h;
  const int parts = w_splits + splits_h;
  float *part_o = nullptr, *part_lse = nullptr, *o = nullptr, *lse = nullptr;
  CHECK(cudaMalloc(&part_o, sizeof(float) * parts * rows * kD));
  CHECK(cudaMalloc(&part_lse, sizeof(float) * parts * rows));
  CHECK(cudaMalloc(&o, sizeof(float) * rows * kD));
  CHECK(cudaMalloc(&lse, sizeof(float) * rows));
  const size_t state_bytes =
      xform ? kc::TransformTcStateBytes(batch, kHkv) : kc::Int2StateBytes(batch, kHkv);
  void* state = nullptr;
  CHECK(cudaMalloc(&state, std::max<size_t>(state_bytes, 16)));
  const kc::MergeTarget merge{parts, nullptr, o, lse, nullptr, 1};
  auto layer_call = [&](int l) {
    if (!bf16) {
      const kc::PagedList wl_l{wpool + l * win_layer, bf16_page, wlist->table, wlist->max_pages,
                               wlist->lengths};
      CHECK(kc::LaunchBf16SplitDecodeParts(wl_l, geo, d_q, nullptr, scale, w_splits, wlist->max_len,
                                           part_o, part_lse, 0, stream));
    }
    const kc::PagedList hl_l{hpool + l * hist_layer, hist_page, hlist.table, hlist.max_pages,
                             hlist.lengths};
    if (bf16) {
      CHECK(kc::LaunchBf16SplitDecodeParts(hl_l, geo, d_q, nullptr, scale, splits_h, hlist.max_len,
                                           part_o, part_lse, 0, stream));
      CHECK(kc::LaunchMergeParts(part_o, part_lse, parts, rows, kD, nullptr, o, lse, stream));
    } else if (xform) {
      const kc::TransformHeadCodec* heads = codec->heads + l * kHkv;
      if (use_tc) {
        CHECK(kc::LaunchTransformDecodePartsTc(hl_l, geo, xoff, heads, d_q, scale, splits_h,
                                               hlist.max_len, part_o, part_lse, w_splits, state,
                                               stream));
      } else {
        CHECK(kc::LaunchTransformDecodeParts(hl_l, geo, xoff, heads, d_q, scale, splits_h,
                                             hlist.max_len, part_o, part_lse, w_splits, stream));
      }
      CHECK(kc::LaunchMergeParts(part_o, part_lse, parts, rows, kD, nullptr, o, lse, stream));
    } else {
      kc::Int2PartsOptions opt;
      opt.state = state;
      opt.merge = &merge;
      CHECK(kc::LaunchInt2DecodeParts(hl_l, geo, d_q, nullptr, scale, splits_h, hlist.max_len,
                                      part_o, part_lse, w_splits, stream, opt));
    }
  };
  std::vector<float> ms;
  cudaEvent_t a, e;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&e));
  for (int s = 0; s <= steps; ++s) {
    CHECK(cudaEventRecord(a, stream));
    for (int l = 0; l < kLayers; ++l) layer_call(l);
    CHECK(cudaEventRecord(e, stream));
    CHECK(cudaEventSynchronize(e));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, e));
    if (s > 0) ms.push_back(t);  // step 0: warm-up
  }
  // Every output row written and finite (the pages hold valid values).
  std::vector<float> host_lse(rows);
  CHECK(cudaMemcpy(host_lse.data(), lse, sizeof(float) * rows, cudaMemcpyDeviceToHost));
  for (float x : host_lse) {
    if (!std::isfinite(x)) {
      std::fprintf(stderr, "%s: a non-finite lse in the outputs\n", fmt.c_str());
      std::exit(1);
    }
  }
  std::sort(ms.begin(), ms.end());
  r.step_ms = ms[ms.size() / 2];
  r.step_ms_spread = ms.back() - ms.front();
  r.tok_s = batch * 1e3 / r.step_ms;
  // Bytes a step reads once (each sequence's pages, shared pages per sequence).
  double read = 0;
  for (int b = 0; b < batch; ++b) {
    read += static_cast<double>(ht[b].size()) * hist_page +
            static_cast<double>(wt[b].size()) * bf16_page;
  }
  r.read_gb = read * kLayers / 1e9;
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(e));
  for (void* p : {static_cast<void*>(hpool), static_cast<void*>(wpool), static_cast<void*>(d_q),
                  static_cast<void*>(part_o), static_cast<void*>(part_lse), static_cast<void*>(o),
                  static_cast<void*>(lse), state}) {
    if (p != nullptr) CHECK(cudaFree(p));
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "cuda_job_bench",
      .summary = "sequences held and decode tokens/s under a fixed pool budget, per history format",
      .files = {__FILE__},
      .synopsis = "--trace FILE.jsonl [--budget_gb 60] [--system_tokens 2048] [--out FILE.md]"};
  kvcd::cli::Parse(program, argc, argv);
  const std::vector<int> trace = TraceLengths(absl::GetFlag(FLAGS_trace));
  const int system = absl::GetFlag(FLAGS_system_tokens);
  const int max_context = absl::GetFlag(FLAGS_max_context);
  if (system < kPs || system % kPs != 0 || max_context < system + kRecent) {
    std::fprintf(stderr,
                 "--system_tokens must be a positive multiple of %d and --max_context at least "
                 "--system_tokens + %d\n",
                 kPs, kRecent);
    return 2;
  }
  const int64_t budget = static_cast<int64_t>(absl::GetFlag(FLAGS_budget_gb) * 1e9);
  const std::string tk = absl::GetFlag(FLAGS_transform_kernel);
  if (tk != "tc" && tk != "fp32") {
    std::fprintf(stderr, "--transform_kernel must be tc or fp32\n");
    return 2;
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream = nullptr;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::string md;
  char line[512];
  auto emit = [&md](const std::string& s) {
    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
    md += s;
  };
  std::snprintf(line, sizeof(line),
                "device: %s, %d SMs; Qwen3-8B (36 layers, 32/8 heads, d 128), page 64; budget "
                "%.1f GB; system prompt %d tokens (shared); %zu trace sessions, history clipped "
                "to %d tokens in all; int2-transform kernel %s\n\n",
                prop.name, prop.multiProcessorCount, budget / 1e9, system, trace.size(),
                max_context, tk.c_str());
  emit(line);
  emit(
      "| history | splits (history) | sequences held | tokens held | pool GB | step ms (spread) | "
      "tokens/s | GB read per step | TB/s |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
  const std::vector<std::string> formats = absl::StrSplit(absl::GetFlag(FLAGS_formats), ',');
  const std::string sp = absl::GetFlag(FLAGS_splits);
  std::vector<bool> policies;
  if (sp == "kernel" || sp == "both") policies.push_back(false);
  if (sp == "balanced" || sp == "both") policies.push_back(true);
  if (policies.empty()) {
    std::fprintf(stderr, "--splits must be kernel, balanced or both\n");
    return 2;
  }
  for (const std::string& f : formats) {
    for (bool balanced : policies) {
      const Result r =
          RunFormat(f, trace, budget, system, max_context, std::max(1, absl::GetFlag(FLAGS_steps)),
                    tk == "tc", balanced, prop.multiProcessorCount, stream);
      std::snprintf(line, sizeof(line),
                    "| %s | %s, %d | %d | %lld | %.1f | %.2f (%.2f) | %.0f | %.1f | %.2f |\n",
                    r.format.c_str(), r.balanced ? "balanced" : "kernel", r.splits, r.held,
                    static_cast<long long>(r.tokens), r.pool_gb, r.step_ms, r.step_ms_spread,
                    r.tok_s, r.read_gb, r.step_ms > 0 ? r.read_gb / r.step_ms : 0.0);
      emit(line);
    }
  }
  if (const std::string p = absl::GetFlag(FLAGS_out); !p.empty()) {
    if (FILE* f = std::fopen(p.c_str(), "w")) {
      std::fputs(md.c_str(), f);
      std::fclose(f);
    }
  }
  return 0;
}
