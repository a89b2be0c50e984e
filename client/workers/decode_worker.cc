// kvcd_decode_worker: the decode side of disaggregated serving. Opens a sequence on the
// prefix a prefill worker pushed (same --tokens/--seed), then runs the per-layer decode
// loop — over the same-node decode channel (shared memory, --transport channel, the
// default) or over one AttentionDecodeStream (--transport stream): for every token and layer it
// sends the layer's query and the token's K/V row and receives the attention output, all through
// CUDA IPC regions of one registered buffer. Each layer's query is computed on the GPU from the
// previous layer's output, so the loop is data-dependent end to end; the host never waits
// for the GPU inside the loop (the daemon's stream waits on the worker's ready event, the
// worker's stream on the daemon's done event).
//
// Reports tokens/s of the loop, the per-call round trip (p50 / p90) and the daemon-side
// time of each call (kernel_seconds: validation excluded, the backend's work including its
// copies), so RPC overhead = round trip - kernel_seconds. With --sync every call also
// waits for its result on the host (latency of one layer, not throughput). Finally the
// IPC result of one call is checked against the same call with inline tensors. With
// --wait host the host waits for the ready and done events instead of the streams.
//
// Usage: kvcd_decode_worker --target HOST:PORT --model NAME [--tokens 32768] [--seed 1]
//          [--salt prefill] [--steps 16] [--sync] [--device 0] [--transport channel|stream]
//          [--wait device|host]
//        security (README "Security"): [--token-file F] [--tls-ca F] [--tls-cert F --tls-key F]
//          [--tls-server-name N], or KVCD_TOKEN / KVCD_TLS_* in the environment
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "client/client.h"
#include "client/decode_channel.h"
#include "client/workers/ipc_buffer.h"
#include "client/workers/synthetic_device.h"
#include "client/workers/worker_common.h"
#include "common/tensor_ref.h"

namespace kw = kvcd::workers;
using Clock = std::chrono::steady_clock;

#define CHECK_OK(expr)                                                    \
  do {                                                                    \
    const absl::Status s_ = (expr);                                       \
    if (!s_.ok()) {                                                       \
      std::fprintf(stderr, "decode worker: %s\n", s_.ToString().c_str()); \
      return 1;                                                           \
    }                                                                     \
  } while (0)

int main(int argc, char** argv) {
  kw::Flags flags(argc, argv);
  kvcd::ClientOptions opts;
  opts.target = flags.Get("target", "127.0.0.1:50051");
  if (absl::Status s = kw::ApplySecurityFlags(flags, &opts); !s.ok()) {
    std::fprintf(stderr, "%s worker: %s\n", "decode", s.ToString().c_str());
    return 2;
  }
  const std::string model = flags.Get("model", "qwen3-8b-int2");
  const std::string salt = flags.Get("salt", "prefill");
  const int64_t n_tokens = flags.GetInt("tokens", 32768);
  const uint64_t seed = static_cast<uint64_t>(flags.GetInt("seed", 1));
  const int steps = static_cast<int>(flags.GetInt("steps", 16));
  const bool sync = flags.Has("sync");
  // --wait device (default): cross-process order through stream waits on the IPC events;
  // --wait host: the host waits for each event, so no stream ever waits on the other
  // process (the per-call cost of GPU time-slicing between the two contexts shows as the
  // difference).
  const std::string wait = flags.Get("wait", "device");
  if (wait != "device" && wait != "host") {
    std::fprintf(stderr, "--wait must be device or host\n");
    return 2;
  }
  const bool host_wait = wait == "host";
  const std::string transport = flags.Get("transport", "channel");
  if (transport != "channel" && transport != "stream") {
    std::fprintf(stderr, "--transport must be channel or stream\n");
    return 2;
  }
  CHECK_OK(
      kw::CudaCheck(cudaSetDevice(static_cast<int>(flags.GetInt("device", 0))), "cudaSetDevice"));
  auto client = kvcd::Client::Connect(opts);
  CHECK_OK(client.status());
  auto geo = kw::FetchGeometry(client->get(), model);
  CHECK_OK(geo.status());
  const kw::Geometry& g = *geo;
  const int64_t prompt = n_tokens / g.page_size * g.page_size;
  std::vector<int32_t> tokens = kw::PromptTokens(prompt, seed);
  auto open = (*client)->OpenSequence(model, salt, tokens, 600000);
  CHECK_OK(open.status());
  if (open->matched_tokens() != prompt) {
    std::fprintf(stderr,
                 "only %lld of %lld prompt tokens are cached; run the prefill worker first\n",
                 static_cast<long long>(open->matched_tokens()), static_cast<long long>(prompt));
    return 1;
  }
  const uint64_t seq = open->sequence_id();

  // One buffer: q (BF16), k_new and v_new (BF16), o (F32), lse (F32), 256-byte aligned.
  const int64_t q_n = int64_t{g.num_q_heads} * g.head_dim,
                kv_n = int64_t{g.num_kv_heads} * g.head_dim;
  auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t q_off = 0, k_off = align(2 * q_n), v_off = k_off + align(2 * kv_n),
                o_off = v_off + align(2 * kv_n), l_off = o_off + align(4 * q_n),
                total = l_off + align(4 * g.num_q_heads);
  auto buf = kw::IpcBuffer::Create(client->get(), static_cast<uint64_t>(total), "decode");
  CHECK_OK(buf.status());
  kw::IpcBuffer& b = **buf;
  uint8_t* d = b.data();
  cudaStream_t stream;
  CHECK_OK(kw::CudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"));
  CHECK_OK(kw::CudaCheck(kw::FillBf16(reinterpret_cast<uint16_t*>(d + q_off), q_n, seed, stream),
                         "fill"));
  CHECK_OK(kw::CudaCheck(cudaMemsetAsync(d + o_off, 0, 4 * q_n, stream), "memset"));

  kvcd::v1::AttentionDecodeRequest req;
  req.add_sequence_ids(seq);
  b.Region(req.mutable_q(), kvcd::v1::DTYPE_BF16, {1, g.num_q_heads, g.head_dim}, q_off);
  b.Region(req.mutable_k_new(), kvcd::v1::DTYPE_BF16, {1, g.num_kv_heads, g.head_dim}, k_off);
  b.Region(req.mutable_v_new(), kvcd::v1::DTYPE_BF16, {1, g.num_kv_heads, g.head_dim}, v_off);
  b.Region(req.mutable_o_out(), kvcd::v1::DTYPE_F32, {1, g.num_q_heads, g.head_dim}, o_off);
  b.Region(req.mutable_lse_out(), kvcd::v1::DTYPE_F32, {1, g.num_q_heads}, l_off);
  req.add_new_tokens(0);

  std::unique_ptr<kvcd::DecodeStream> stream_rpc;
  std::unique_ptr<kvcd::DecodeChannel> channel;
  if (transport == "stream") {
    auto st = (*client)->OpenDecodeStream();
    CHECK_OK(st.status());
    stream_rpc = std::move(*st);
  } else {
    auto ch = kvcd::DecodeChannel::Open(client->get(), 1u << 16, 600000);
    CHECK_OK(ch.status());
    channel = std::move(*ch);
  }
  auto call = [&](const kvcd::v1::AttentionDecodeRequest& r) {
    return channel ? channel->Call(r) : stream_rpc->Call(r);
  };
  std::vector<double> rtt_us, kernel_us, done_us;
  cudaEvent_t done_ev;
  cudaEventCreateWithFlags(&done_ev, cudaEventDisableTiming);
  const auto t_loop = Clock::now();
  for (int s = 0; s < steps; ++s) {
    req.set_new_tokens(0, static_cast<int32_t>((seed + s) % 151000));
    for (int l = 0; l < g.num_layers; ++l) {
      const uint64_t key = seed * 1000003ull + s * 1009ull + l;
      // This layer's query from the previous layer's output; the token's K/V row.
      CHECK_OK(
          kw::CudaCheck(kw::NextQueries(reinterpret_cast<float*>(d + o_off),
                                        reinterpret_cast<uint16_t*>(d + q_off), q_n, key, stream),
                        "NextQueries"));
      CHECK_OK(kw::CudaCheck(
          kw::FillBf16(reinterpret_cast<uint16_t*>(d + k_off), kv_n, key ^ 1, stream), "fill k"));
      CHECK_OK(kw::CudaCheck(
          kw::FillBf16(reinterpret_cast<uint16_t*>(d + v_off), kv_n, key ^ 2, stream), "fill v"));
      CHECK_OK(b.MarkReady(stream));
      if (host_wait) CHECK_OK(b.WaitReadyOnHost());
      req.set_layer(l);
      req.set_request_id(static_cast<uint64_t>(s) * g.num_layers + l);
      const auto t0 = Clock::now();
      auto r = call(req);
      const double rtt = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      CHECK_OK(r.status());
      rtt_us.push_back(rtt);
      kernel_us.push_back(r->kernel_seconds() * 1e6);
      CHECK_OK(host_wait ? b.WaitDoneOnHost() : b.WaitDone(stream));
      if (sync) {
        cudaEventRecord(done_ev, stream);
        CHECK_OK(kw::CudaCheck(cudaEventSynchronize(done_ev), "sync"));
        done_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
    }
  }
  CHECK_OK(kw::CudaCheck(cudaStreamSynchronize(stream), "final sync"));
  const double loop_s = std::chrono::duration<double>(Clock::now() - t_loop).count();

  // Check: the same attention (last layer, no append) through inline tensors.
  std::vector<uint16_t> q_host(static_cast<size_t>(q_n));
  std::vector<float> o_ipc(static_cast<size_t>(q_n));
  CHECK_OK(
      kw::CudaCheck(cudaMemcpy(q_host.data(), d + q_off, 2 * q_n, cudaMemcpyDeviceToHost), "D2H"));
  kvcd::v1::AttentionDecodeRequest check;
  check.set_layer(g.num_layers - 1);
  check.add_sequence_ids(seq);
  b.Region(check.mutable_q(), kvcd::v1::DTYPE_BF16, {1, g.num_q_heads, g.head_dim}, q_off);
  b.Region(check.mutable_o_out(), kvcd::v1::DTYPE_F32, {1, g.num_q_heads, g.head_dim}, o_off);
  b.Region(check.mutable_lse_out(), kvcd::v1::DTYPE_F32, {1, g.num_q_heads}, l_off);
  CHECK_OK(b.MarkReady(stream));
  auto via_ipc = call(check);
  CHECK_OK(via_ipc.status());
  CHECK_OK(b.WaitDone(stream));
  CHECK_OK(kw::CudaCheck(cudaStreamSynchronize(stream), "sync"));
  CHECK_OK(
      kw::CudaCheck(cudaMemcpy(o_ipc.data(), d + o_off, 4 * q_n, cudaMemcpyDeviceToHost), "D2H"));
  kvcd::SetBf16Tensor(check.mutable_q(), {1, g.num_q_heads, g.head_dim}, q_host.data());
  check.clear_o_out();
  check.clear_lse_out();
  auto via_inline = call(check);
  CHECK_OK(via_inline.status());
  double max_diff = 0, max_ref = 0;
  for (int64_t i = 0; i < q_n; ++i) {
    const double ref = kvcd::ElementAsFloat(via_inline->o(), i);
    max_diff = std::max(max_diff, std::fabs(ref - o_ipc[static_cast<size_t>(i)]));
    max_ref = std::max(max_ref, std::fabs(ref));
  }
  CHECK_OK(channel ? channel->Close() : stream_rpc->Close());
  auto closed = (*client)->CloseSequence(seq);
  CHECK_OK(closed.status());

  std::vector<double> overhead(rtt_us.size());
  for (size_t i = 0; i < rtt_us.size(); ++i) overhead[i] = rtt_us[i] - kernel_us[i];
  std::printf(
      "decode worker: %s, context %lld tokens, %d steps x %d layers, tensors over CUDA "
      "IPC, calls over the %s%s%s\n",
      model.c_str(), static_cast<long long>(prompt), steps, g.num_layers,
      transport == "channel" ? "shared-memory decode channel" : "gRPC stream",
      sync ? " (host waits for every result)" : "",
      host_wait ? ", events waited on by the host" : "");
  std::printf("tokens/s: %.1f (%.3f ms per token, %d layer calls per token)\n", steps / loop_s,
              loop_s / steps * 1e3, g.num_layers);
  std::printf(
      "per call: round trip p50 %.1f us p90 %.1f us; daemon-side p50 %.1f us; "
      "RPC overhead p50 %.1f us p90 %.1f us\n",
      kw::Median(rtt_us), kw::Percentile(rtt_us, 0.9), kw::Median(kernel_us), kw::Median(overhead),
      kw::Percentile(overhead, 0.9));
  if (sync) {
    std::printf("per call with the result on the host: p50 %.1f us p90 %.1f us\n",
                kw::Median(done_us), kw::Percentile(done_us, 0.9));
  }
  std::printf("final length %lld; IPC vs inline output max |diff| %.3g (max |o| %.3g): %s\n",
              static_cast<long long>(*closed), max_diff, max_ref,
              max_diff <= 1e-5 * std::max(1.0, max_ref) ? "match" : "MISMATCH");
  return max_diff <= 1e-5 * std::max(1.0, max_ref) ? 0 : 1;
}
