// kvcd_prefill_worker: the prefill side of disaggregated serving. Produces a prompt's KV
// pages on its GPU (synthetic values, already in the model's storage format: BF16 sink
// pages, INT2 history pages) and pushes them into kvcd through the data plane:
//   --transport ipc   CUDA IPC (daemon on the same GPU/node): PushPages names a region
//                     of a registered buffer; the daemon copies and checks on the device.
//   --transport nccl  NCCL (daemon on another GPU): NcclConnect, then PushPages announces
//                     the transfer and the bytes go with ncclSend.
// It then fetches the pages back the same way and checks they are byte-identical, and
// reports push / fetch bandwidth against a plain device-to-device copy of the same bytes
// (IPC) measured in the same process.
//   --mode put        instead: the prompt's BF16 K/V [layers, tokens, kv_heads, head_dim]
//                     in a registered buffer, stored with Put (cuda_ipc tensors): the daemon
//                     rotates / quantizes on the device, the K/V never leave the GPU. Reports
//                     GB/s of BF16 consumed against a plain copy of the same bytes, and checks
//                     the stored pages of the first tokens against an inline Put of the same
//                     values (byte for byte). The first Put stores the prompt under --salt
//                     (where the decode worker opens it), the timed ones under
//                     "<salt>-put<r>-<seed>", the check's inline Put under "<salt>-inline".
//                     FSQ models (history_format FSQ): each Put also carries x, the residuals
//                     [layers, tokens, fsq_residual_width] as BF16 in the same buffer (synthetic,
//                     in [-1, 1) like testing/synthetic.cc's), and the prompt goes in chunks of
//                     --put-chunk-tokens through kv_first_token (chunk i: k/v/x of tokens
//                     [first, first + chunk), `tokens` the prefix up to the chunk's end): the
//                     buffer holds one chunk, refilled per chunk (Qwen3-8B's x alone is 29 GB at
//                     100k tokens). The inline check Put carries x too.
//
// Usage: kvcd_prefill_worker --target HOST:PORT --model NAME [--tokens 32768] [--salt S]
//          [--seed 1] [--transport ipc|nccl] [--mode push|put] [--repeat 3] [--device 0]
//          [--timeout-ms 20000] [--put-chunk-tokens 8192]
//        security (README "Security"): [--token-file F] [--tls-ca F] [--tls-cert F --tls-key F]
//          [--tls-server-name N], or KVCD_TOKEN / KVCD_TLS_* in the environment
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/workers/ipc_buffer.h"
#include "client/workers/worker_common.h"
#include "kvcd/kernels/cuda_nccl.h"
#include "kvcd/kernels/int2_attention.h"
#include "testing/synthetic_device.h"

ABSL_FLAG(std::string, transport, "ipc", "ipc (CUDA IPC, same node) or nccl (another GPU)");
ABSL_FLAG(int32_t, repeat, 3, "timed repetitions of the push / fetch (or put)");
ABSL_FLAG(int32_t, timeout_ms, 20000, "deadline of each transfer in milliseconds");
ABSL_FLAG(std::string, mode, "push",
          "push (pages in the storage format) or put (BF16 K/V from a registered buffer)");
ABSL_FLAG(int64_t, put_chunk_tokens, 8192,
          "--mode put, FSQ models: tokens per Put (a multiple of the page size; the buffer "
          "holds one chunk's K, V and x)");

namespace kw = kvcd::workers;
namespace kc = kvcd::kernels::cuda;
using Clock = std::chrono::steady_clock;

namespace {

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

#define CHECK_OK(expr)                                                     \
  do {                                                                     \
    const absl::Status s_ = (expr);                                        \
    if (!s_.ok()) {                                                        \
      std::fprintf(stderr, "prefill worker: %s\n", s_.ToString().c_str()); \
      return 1;                                                            \
    }                                                                      \
  } while (0)

// Fills the pages of tokens [0, pages * page_size) at `dst`, back to back.
absl::Status FillPages(const kw::Geometry& g, int64_t pages, uint8_t* dst, uint64_t seed) {
  const kvcd::kernels::Int2PageLayout layout{g.num_kv_heads, g.page_size, g.head_dim};
  int64_t at = 0;
  const int64_t sink = g.int2 ? std::min(pages, g.sink_pages) : pages;
  if (sink > 0) {
    const int64_t bytes = sink * g.bf16_page_bytes;
    if (auto s = kw::CudaCheck(kw::FillBf16(reinterpret_cast<uint16_t*>(dst), bytes / 2, seed, 0),
                               "FillBf16");
        !s.ok())
      return s;
    at += bytes;
  }
  if (pages > sink) {
    const int64_t layer_bytes = g.history_page_bytes / g.num_layers;
    const int64_t chunks = (pages - sink) * g.num_layers;
    if (auto s = kw::CudaCheck(
            kw::FillInt2PageLayers(dst + at, chunks, layer_bytes, 2 * layout.KScale(0),
                                   4LL * g.num_kv_heads * g.page_size, g.page_size, seed + 1, 0),
            "FillInt2PageLayers");
        !s.ok())
      return s;
  }
  return kw::CudaCheck(cudaDeviceSynchronize(), "fill");
}

// Times one D2D copy of `bytes` (median of 5, events on the legacy stream).
absl::StatusOr<double> CopySeconds(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> copy_s;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(e0, 0);
    cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0);
    cudaEventRecord(e1, 0);
    if (auto s = kw::CudaCheck(cudaEventSynchronize(e1), "copy"); !s.ok()) return s;
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    copy_s.push_back(ms / 1e3);
  }
  return kw::Median(copy_s);
}

// --mode put: Put of BF16 K/V (and an FSQ model's residuals x) from a registered buffer (see
// the header comment).
int PutMode(kvcd::Client* client, const std::string& model, const kw::Geometry& g, int64_t n_tokens,
            const std::string& salt, uint64_t seed, int repeat, int64_t chunk_tokens) {
  const int64_t n = n_tokens / g.page_size * g.page_size;
  if (n < 1) {
    std::fprintf(stderr, "--tokens must hold at least one page (%d tokens)\n", g.page_size);
    return 2;
  }
  // FSQ models: chunks of --put-chunk-tokens through kv_first_token (the buffer holds one
  // chunk's K, V and x, refilled per chunk); other models: the whole prompt in one Put.
  int64_t chunk = n;
  if (g.fsq) {
    if (chunk_tokens < g.page_size || chunk_tokens % g.page_size != 0) {
      std::fprintf(stderr,
                   "--put-chunk-tokens must be a positive multiple of the page size (%d), "
                   "got %lld\n",
                   g.page_size, static_cast<long long>(chunk_tokens));
      return 2;
    }
    chunk = std::min(n, chunk_tokens);
  }
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t row = int64_t{g.num_kv_heads} * g.head_dim, x_row = g.fsq_residual_width;
  const int64_t elems = int64_t{g.num_layers} * chunk * row;  // one of K, V of a chunk
  const int64_t x_elems = int64_t{g.num_layers} * chunk * x_row;
  const int64_t bytes = 2 * elems;  // one of K, V as BF16; x follows V at 2 * bytes
  auto b =
      kw::IpcBuffer::Create(client, static_cast<uint64_t>(2 * bytes + 2 * x_elems), "prefill-put");
  CHECK_OK(b.status());
  kw::IpcBuffer& buf = **b;
  // The synthetic K, V (and x, values in [-1, 1) as testing/synthetic.cc's residuals) of
  // chunk c; chunk 0 with `seed` itself.
  auto fill = [&](int64_t c) {
    return kw::CudaCheck(kw::FillBf16(reinterpret_cast<uint16_t*>(buf.data()), 2 * elems + x_elems,
                                      seed + static_cast<uint64_t>(c) * 0x9e3779b97f4a7c15ull, 0),
                         "FillBf16");
  };
  CHECK_OK(fill(0));
  CHECK_OK(kw::CudaCheck(cudaDeviceSynchronize(), "fill"));
  const std::vector<int32_t> tokens = kw::PromptTokens(n, seed);
  const int64_t all_bytes = 2 * int64_t{g.num_layers} * n * (2 * row + x_row);
  std::printf(
      "put worker: %s, %lld tokens, %.1f MB of BF16 K/V%s in %lld Put(s) from a CUDA IPC "
      "buffer of %.1f MB\n",
      model.c_str(), static_cast<long long>(n), all_bytes / 1e6, g.fsq ? " and x" : "",
      static_cast<long long>(chunks), (2 * bytes + 2 * x_elems) / 1e6);
  // Stores the prompt under `tenant`; returns the seconds spent in the Puts (the refills of
  // the buffer between chunks not counted).
  auto put = [&](const std::string& tenant) -> absl::StatusOr<double> {
    double seconds = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t first = c * chunk, len = std::min(chunk, n - first);
      if (chunks > 1) {
        if (auto s = fill(c); !s.ok()) return s;
        if (auto s = kw::CudaCheck(cudaDeviceSynchronize(), "fill"); !s.ok()) return s;
      }
      kvcd::v1::PutRequest req;
      req.set_model(model);
      req.set_cache_salt(tenant);
      for (int64_t t = 0; t < first + len; ++t) req.add_tokens(tokens[static_cast<size_t>(t)]);
      req.set_kv_first_token(first);
      const std::vector<int64_t> shape = {g.num_layers, len, g.num_kv_heads, g.head_dim};
      buf.Region(req.mutable_k(), kvcd::v1::DTYPE_BF16, shape, 0);
      buf.Region(req.mutable_v(), kvcd::v1::DTYPE_BF16, shape, static_cast<uint64_t>(bytes));
      if (g.fsq) {
        buf.Region(req.mutable_x(), kvcd::v1::DTYPE_BF16, {g.num_layers, len, x_row},
                   static_cast<uint64_t>(2 * bytes));
      }
      const auto t0 = Clock::now();
      if (auto s = buf.MarkReady(0); !s.ok()) return s;
      auto r = client->Put(req);
      if (!r.ok()) {
        return absl::Status(
            r.status().code(),
            absl::StrCat("the daemon refused the Put of tokens [", first, ", ", first + len,
                         ") of ", n, " (tenant ", tenant, "): ", r.status().message()));
      }
      if (r->inserted_tokens() != len) {
        return absl::InternalError(absl::StrCat("Put of tokens [", first, ", ", first + len,
                                                ") inserted ", r->inserted_tokens(), " of ", len,
                                                " tokens"));
      }
      seconds += Seconds(t0);
    }
    return seconds;
  };
  // The first Put stores the prompt under --salt itself (where the decode worker opens it),
  // then the timed ones into fresh tenants.
  std::vector<double> put_s;
  for (int r = 0; r < std::max(1, repeat) + 1; ++r) {
    auto t = put(r == 0 ? salt : absl::StrCat(salt, "-put", r, "-", seed));
    CHECK_OK(t.status());
    if (r > 0) put_s.push_back(*t);  // the first call also allocates device scratch
  }
  // Byte check: the first pages stored from the device against an inline Put of the same
  // values (host bytes through the same daemon), both fetched as stored.
  const int64_t check_tokens = std::min<int64_t>(chunk, 8 * g.page_size);
  if (chunks > 1) {
    CHECK_OK(fill(0));
    CHECK_OK(kw::CudaCheck(cudaDeviceSynchronize(), "fill"));
  }
  kvcd::v1::PutRequest inline_req;
  inline_req.set_model(model);
  inline_req.set_cache_salt(salt + "-inline");
  for (int64_t t = 0; t < check_tokens; ++t) inline_req.add_tokens(tokens[static_cast<size_t>(t)]);
  // K, V [layers, check_tokens, kv_heads, head_dim] and x [layers, check_tokens, C]: the
  // first tokens of each layer of chunk 0 (layer stride: chunk tokens).
  for (int which = 0; which < (g.fsq ? 3 : 2); ++which) {
    kvcd::v1::TensorRef* tr = which == 0   ? inline_req.mutable_k()
                              : which == 1 ? inline_req.mutable_v()
                                           : inline_req.mutable_x();
    const int64_t w = which < 2 ? row : x_row;
    tr->set_dtype(kvcd::v1::DTYPE_BF16);
    tr->add_shape(g.num_layers);
    tr->add_shape(check_tokens);
    if (which < 2) {
      tr->add_shape(g.num_kv_heads);
      tr->add_shape(g.head_dim);
    } else {
      tr->add_shape(x_row);
    }
    std::string* data = tr->mutable_inline_data();
    data->resize(static_cast<size_t>(2 * g.num_layers * check_tokens * w));
    for (int32_t l = 0; l < g.num_layers; ++l) {
      const int64_t src = which * bytes + 2 * int64_t{l} * chunk * w;
      CHECK_OK(kw::CudaCheck(
          cudaMemcpy(data->data() + 2 * int64_t{l} * check_tokens * w, buf.data() + src,
                     static_cast<size_t>(2 * check_tokens * w), cudaMemcpyDeviceToHost),
          "D2H"));
    }
  }
  CHECK_OK(client->Put(inline_req).status());
  std::vector<std::string> stored[2];
  for (int which = 0; which < 2; ++which) {
    const std::string tenant = which == 0 ? salt : salt + "-inline";
    std::vector<int32_t> prefix(tokens.begin(), tokens.begin() + check_tokens);
    auto open = client->OpenSequence(model, tenant, prefix);
    CHECK_OK(open.status());
    kvcd::v1::FetchPagesRequest f;
    f.set_sequence_id(open->sequence_id());
    auto resp = client->FetchPages(f);
    CHECK_OK(resp.status());
    for (const auto& p : resp->pages()) stored[which].push_back(p.data());
    (void)client->CloseSequence(open->sequence_id());
  }
  const bool same = stored[0] == stored[1] && !stored[0].empty();
  auto copy = CopySeconds(buf.data() + bytes, buf.data(), bytes);
  CHECK_OK(copy.status());
  const double gb = all_bytes / 1e9, copy_s = *copy * all_bytes / bytes;
  std::printf("put (ipc): %.3f ms per %.1f MB of BF16 K/V%s = %.1f GB/s consumed (median of %zu)\n",
              kw::Median(put_s) * 1e3, all_bytes / 1e6, g.fsq ? " and x" : "",
              gb / kw::Median(put_s), put_s.size());
  std::printf("plain cudaMemcpy D2D of the same bytes: %.3f ms = %.1f GB/s\n", copy_s * 1e3,
              gb / copy_s);
  std::printf("pages stored from the device byte-identical to an inline Put (%lld tokens%s): %s\n",
              static_cast<long long>(check_tokens), g.fsq ? ", x inline too" : "",
              same ? "yes" : "NO");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "kvcd_prefill_worker",
      .summary = "the prefill side of disaggregated serving (see the top of prefill_worker.cc)",
      .files = {__FILE__, kw::kFlagsFile},
      .synopsis = "--target HOST:PORT --model NAME [--tokens N] [--salt S] [flags]"};
  const kvcd::cli::Parsed flags = kvcd::cli::Parse(program, argc, argv);
  kvcd::ClientOptions opts;
  opts.target = absl::GetFlag(FLAGS_target);
  if (absl::Status s = kw::ApplySecurityFlags(flags, &opts); !s.ok()) {
    std::fprintf(stderr, "%s worker: %s\n", "prefill", s.ToString().c_str());
    return 2;
  }
  const std::string model = absl::GetFlag(FLAGS_model);
  const std::string salt = absl::GetFlag(FLAGS_salt);
  const std::string transport = absl::GetFlag(FLAGS_transport);
  const int64_t n_tokens = absl::GetFlag(FLAGS_tokens);
  const uint64_t seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  const int repeat = absl::GetFlag(FLAGS_repeat);
  const int timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
  if (transport != "ipc" && transport != "nccl") {
    std::fprintf(stderr, "--transport must be ipc or nccl\n");
    return 2;
  }
  CHECK_OK(kw::CudaCheck(cudaSetDevice(absl::GetFlag(FLAGS_device)), "cudaSetDevice"));
  auto client = kvcd::Client::Connect(opts);
  CHECK_OK(client.status());
  auto geo = kw::FetchGeometry(client->get(), model);
  CHECK_OK(geo.status());
  const kw::Geometry& g = *geo;
  if (g.fsq && absl::GetFlag(FLAGS_mode) != "put") {
    std::fprintf(stderr,
                 "model %s stores FSQ history: its pages are encoded by the daemon from K/V and "
                 "the residuals x, so it takes --mode put, not page pushes\n",
                 model.c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_mode) == "put") {
    return PutMode(client->get(), model, g, n_tokens, salt, seed, repeat,
                   absl::GetFlag(FLAGS_put_chunk_tokens));
  }
  const int64_t pages = n_tokens / g.page_size;
  if (pages < 1) {
    std::fprintf(stderr, "--tokens must hold at least one page (%d tokens)\n", g.page_size);
    return 2;
  }
  int64_t total = 0;
  for (int64_t p = 0; p < pages; ++p) total += g.PageBytesAt(p);
  const std::vector<int32_t> tokens = kw::PromptTokens(pages * g.page_size, seed);
  std::printf("prefill worker: %s, %lld tokens = %lld pages, %.1f MB as stored, transport %s\n",
              model.c_str(), static_cast<long long>(pages * g.page_size),
              static_cast<long long>(pages), total / 1e6, transport.c_str());

  // Device memory: the pushed pages, then room for the fetched copy.
  std::unique_ptr<kw::IpcBuffer> ipc;
  uint8_t* base = nullptr;
  if (transport == "ipc") {
    auto b = kw::IpcBuffer::Create(client->get(), 2 * static_cast<uint64_t>(total), "prefill");
    CHECK_OK(b.status());
    ipc = std::move(*b);
    base = ipc->data();
  } else {
    void* p = nullptr;
    CHECK_OK(kw::CudaCheck(cudaMalloc(&p, 2 * static_cast<size_t>(total)), "cudaMalloc"));
    base = static_cast<uint8_t*>(p);
  }
  uint8_t* pushed = base;
  uint8_t* fetched = base + total;
  CHECK_OK(FillPages(g, pages, pushed, seed));

  // NCCL: join the daemon's communicator as rank 1.
  void* comm = nullptr;
  void* nstream = nullptr;
  uint64_t comm_id = 0;
  if (transport == "nccl") {
    auto conn = (*client)->NcclConnect("prefill", timeout_ms);
    CHECK_OK(conn.status());
    comm_id = conn->communicator_id();
    kvcd::kernels::Error e = kc::CreateStream(&nstream);
    if (e.ok()) e = kc::NcclInit(conn->unique_id(), 2, 1, timeout_ms, &comm);
    if (!e.ok()) {
      std::printf("nccl: joining communicator %llu failed: %s\n",
                  static_cast<unsigned long long>(comm_id), e.message().c_str());
      comm = nullptr;
    }
  }

  auto push = [&](const std::string& tenant) -> absl::StatusOr<double> {
    kvcd::v1::PushPagesRequest req;
    req.set_model(model);
    req.set_cache_salt(tenant);
    for (int32_t t : tokens) req.add_tokens(t);
    req.set_first_page(0);
    req.set_num_pages(pages);
    const auto t0 = Clock::now();
    if (ipc) {
      ipc->Region(req.mutable_pages(), kvcd::v1::DTYPE_U8, {total}, 0);
      if (auto s = ipc->MarkReady(0); !s.ok()) return s;
      auto r = (*client)->PushPages(req);
      if (!r.ok()) return r.status();
    } else {
      req.mutable_pages()->set_dtype(kvcd::v1::DTYPE_U8);
      req.mutable_pages()->add_shape(total);
      req.mutable_pages()->mutable_nccl()->set_communicator_id(comm_id);
      req.mutable_pages()->mutable_nccl()->set_size(static_cast<uint64_t>(total));
      absl::StatusOr<int64_t> r = absl::UnknownError("not run");
      std::thread rpc([&] { r = (*client)->PushPages(req); });
      kvcd::kernels::Error e =
          comm ? kc::NcclSend(comm, pushed, total, 0, nstream)
               : kvcd::kernels::Error(kvcd::kernels::ErrorCode::kNccl, "no communicator");
      if (e.ok()) e = kc::NcclWait(comm, nstream, timeout_ms);
      rpc.join();
      if (!r.ok()) return r.status();
      if (!e.ok()) return absl::InternalError("ncclSend: " + e.message());
    }
    return Seconds(t0);
  };

  // First push (the one the decode worker will use), then timed pushes into fresh tenants.
  auto first = push(salt);
  if (!first.ok()) {
    std::printf("push failed: %s\n", first.status().ToString().c_str());
    auto m = (*client)->Match(model, salt, tokens);
    std::printf("after the failed push the daemon holds %lld tokens of the prompt\n",
                m.ok() ? static_cast<long long>(m->matched_tokens()) : -1LL);
    return 3;
  }
  std::vector<double> push_s;
  for (int r = 0; r < repeat; ++r) {
    auto t = push(absl::StrCat(salt, "-bw", r, "-", seed));
    CHECK_OK(t.status());
    push_s.push_back(*t);
  }

  // Fetch the pages back through the same transport and compare every byte.
  auto open = (*client)->OpenSequence(model, salt, tokens);
  CHECK_OK(open.status());
  if (open->matched_tokens() != pages * g.page_size) {
    std::fprintf(stderr, "the daemon matched %lld of %lld pushed tokens\n",
                 static_cast<long long>(open->matched_tokens()),
                 static_cast<long long>(pages * g.page_size));
    return 1;
  }
  std::vector<double> fetch_s;
  for (int r = 0; r < std::max(1, repeat); ++r) {
    CHECK_OK(kw::CudaCheck(cudaMemset(fetched, 0xA5, total), "cudaMemset"));
    CHECK_OK(kw::CudaCheck(cudaDeviceSynchronize(), "sync"));
    kvcd::v1::FetchPagesRequest f;
    f.set_sequence_id(open->sequence_id());
    const auto t0 = Clock::now();
    if (ipc) {
      ipc->Region(f.mutable_destination(), kvcd::v1::DTYPE_U8, {total},
                  static_cast<uint64_t>(total));
      CHECK_OK(ipc->MarkReady(0));
      auto resp = (*client)->FetchPages(f);
      CHECK_OK(resp.status());
      CHECK_OK(ipc->WaitDone(0));
      CHECK_OK(kw::CudaCheck(cudaDeviceSynchronize(), "sync"));
    } else {
      f.mutable_destination()->set_dtype(kvcd::v1::DTYPE_U8);
      f.mutable_destination()->add_shape(total);
      f.mutable_destination()->mutable_nccl()->set_communicator_id(comm_id);
      f.mutable_destination()->mutable_nccl()->set_size(static_cast<uint64_t>(total));
      absl::StatusOr<kvcd::v1::FetchPagesResponse> resp = absl::UnknownError("not run");
      std::thread rpc([&] { resp = (*client)->FetchPages(f); });
      kvcd::kernels::Error e = kc::NcclRecv(comm, fetched, total, 0, nstream);
      if (e.ok()) e = kc::NcclWait(comm, nstream, timeout_ms);
      rpc.join();
      CHECK_OK(resp.status());
      if (!e.ok()) CHECK_OK(absl::InternalError("ncclRecv: " + e.message()));
    }
    fetch_s.push_back(Seconds(t0));
  }
  std::vector<uint8_t> a(static_cast<size_t>(total)), b(static_cast<size_t>(total));
  CHECK_OK(kw::CudaCheck(cudaMemcpy(a.data(), pushed, total, cudaMemcpyDeviceToHost), "D2H"));
  CHECK_OK(kw::CudaCheck(cudaMemcpy(b.data(), fetched, total, cudaMemcpyDeviceToHost), "D2H"));
  int64_t diff = 0;
  for (int64_t i = 0; i < total; ++i)
    diff += a[static_cast<size_t>(i)] != b[static_cast<size_t>(i)];
  (void)(*client)->CloseSequence(open->sequence_id());

  // Baseline: a plain device-to-device copy of the same bytes, timed with events.
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> copy_s;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(e0, 0);
    cudaMemcpyAsync(fetched, pushed, total, cudaMemcpyDeviceToDevice, 0);
    cudaEventRecord(e1, 0);
    CHECK_OK(kw::CudaCheck(cudaEventSynchronize(e1), "copy"));
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    copy_s.push_back(ms / 1e3);
  }
  const double gb = total / 1e9;
  std::printf("push  (%s): %.3f ms per %.1f MB = %.1f GB/s (median of %zu)\n", transport.c_str(),
              kw::Median(push_s) * 1e3, total / 1e6, gb / kw::Median(push_s), push_s.size());
  std::printf("fetch (%s): %.3f ms = %.1f GB/s (median of %zu)\n", transport.c_str(),
              kw::Median(fetch_s) * 1e3, gb / kw::Median(fetch_s), fetch_s.size());
  std::printf("plain cudaMemcpy D2D: %.3f ms = %.1f GB/s (bytes read; x2 for read+write)\n",
              kw::Median(copy_s) * 1e3, gb / kw::Median(copy_s));
  std::printf("fetched pages byte-identical to pushed: %s (%lld differing bytes)\n",
              diff == 0 ? "yes" : "NO", static_cast<long long>(diff));
  if (comm != nullptr) (void)kc::NcclDestroy(comm);
  if (comm_id != 0) (void)(*client)->NcclDisconnect(comm_id);
  return diff == 0 ? 0 : 1;
}
