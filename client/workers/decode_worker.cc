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
// --hops (issue #36): how the two cross-process hops of a call are ordered on the GPU: events
// (the buffer's IPC events, the default) or memops (over the decode channel with --wait
// device: stream memory operations on device signal words of the IPC buffer,
// cuStreamWriteValue32 / cuStreamWaitValue32; opt-in until a device run has measured it).
//
// With --io host the loop needs no GPU: queries, K/V rows and results travel inline over the
// same transports (any backend; a prompt not yet cached is appended first from synthetic
// rows). With KVCD_PHASE_TIMES=1 the worker prints its side of every call step by step
// (common/phase_times.h); the daemon prints its side when the channel closes.
//
// For the worker-death test (bench/run-h200-worker-death.sh): --lease-ms N gives the
// sequence, the decode channel and the IPC buffer N ms leases (default 600000), and
// --die-after-calls N makes the worker kill itself (SIGKILL, from a second thread) as it
// starts its N-th layer call of the IPC loop, its request in flight and its GPU work queued.
// The loop prints "decode loop started" (flushed) when it begins.
//
// --producer: the IPC loop makes each layer's inputs (q from the previous output, the
// token's k/v row, an FSQ model's x) with one kernel (fused, the default) or four (split, the
// loop before session 27; the same values). They stand in for the model's own layer work,
// which the in-process cuDNN loop it is compared with does not run, so the loop charges
// them one launch (run-decode-batch.sh compares the two in one lease).
//
// Usage: kvcd_decode_worker --target HOST:PORT --model NAME [--tokens 32768] [--seed 1]
//          [--salt prefill] [--steps 16] [--sync] [--device 0] [--transport channel|stream]
//          [--wait device|host] [--io ipc|host] [--batch 1] [--lease-ms N] [--die-after-calls N]
//          [--hops events|memops] [--producer fused|split]
//
// --batch B (IPC loop): B sequences opened on the same cached prompt decode together, one
// call per layer for all of them (tokens/s counts every sequence's tokens); with
// --distinct-prompts each on its own copy of the prompt (salts <salt>-0 .. <salt>-(B-1)).
//        security (README "Security"): [--token-file F] [--tls-ca F] [--tls-cert F --tls-key F]
//          [--tls-server-name N], or KVCD_TOKEN / KVCD_TLS_* in the environment
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "client/client.h"
#include "client/decode_channel.h"
#include "client/workers/ipc_buffer.h"
#include "client/workers/worker_common.h"
#include "common/phase_times.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"
#include "testing/synthetic_device.h"

ABSL_FLAG(int32_t, steps, 16, "decode steps (tokens per sequence)");
ABSL_FLAG(bool, sync, false, "wait for every call's result on the host (one layer's latency)");
ABSL_FLAG(std::string, wait, "device",
          "device: order through stream waits on the IPC events; host: the host waits");
ABSL_FLAG(std::string, transport, "channel",
          "channel (same-node decode channel) or stream (AttentionDecodeStream)");
ABSL_FLAG(std::string, hops, "events",
          "cross-process hops: events (IPC events) or memops (device signal words over the "
          "decode channel, with --wait device)");
ABSL_FLAG(std::string, io, "ipc", "ipc (CUDA IPC regions) or host (inline tensors, no GPU)");
ABSL_FLAG(std::string, producer, "fused",
          "the IPC loop's per-layer q/k/v (and x) kernels: fused (one launch) or split (one "
          "launch each, the loop before session 27); the same values");
ABSL_FLAG(int64_t, lease_ms, 600000, "lease of the sequences, the channel and the IPC buffer");
ABSL_FLAG(int64_t, die_after_calls, 0,
          "worker-death test: SIGKILL itself as it starts this layer call (0: never)");
ABSL_FLAG(int32_t, batch, 1, "sequences decoding together, one call per layer (1..256)");
ABSL_FLAG(bool, distinct_prompts, false,
          "each sequence of the batch on its own copy of the prompt (salts <salt>-<i>)");
ABSL_FLAG(int64_t, append_chunk, 512, "--io host: tokens per Append of the uncached prompt");

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

namespace {

// The --io host loop: the same per-layer calls with inline tensors (no GPU in the worker).
// Each layer's query depends on the previous layer's output, as on the device.
int RunHostLoop(kvcd::Client* client, const std::string& model, const std::string& salt,
                int64_t n_tokens, uint64_t seed, int steps, const std::string& transport) {
  auto info = client->GetModel(model);
  CHECK_OK(info.status());
  const kvcd::v1::ModelProfile& p = info->profile();
  const int64_t prompt = n_tokens / p.page_size() * p.page_size();
  std::vector<int32_t> tokens = kw::PromptTokens(prompt, seed);
  auto open = client->OpenSequence(model, salt, tokens, 600000);
  CHECK_OK(open.status());
  const uint64_t seq = open->sequence_id();
  // What the prefix cache does not hold yet goes in from synthetic rows, in chunks.
  const int64_t chunk = std::max<int64_t>(1, absl::GetFlag(FLAGS_append_chunk));
  for (int64_t at = open->matched_tokens(); at < prompt; at += chunk) {
    const int64_t n = std::min(chunk, prompt - at);
    kvcd::v1::AppendRequest app;
    app.set_sequence_id(seq);
    for (int64_t i = 0; i < n; ++i) app.add_tokens(tokens[static_cast<size_t>(at + i)]);
    const std::vector<int64_t> shape = {p.num_layers(), n, p.num_kv_heads(), p.head_dim()};
    std::vector<float> k = kvcd::synthetic::Kv(seed, p, at, n, 0);
    std::vector<float> v = kvcd::synthetic::Kv(seed, p, at, n, 1);
    kvcd::SetBf16FromFloat(app.mutable_k(), shape, k.data());
    kvcd::SetBf16FromFloat(app.mutable_v(), shape, v.data());
    if (p.history_format() == kvcd::v1::HISTORY_FORMAT_FSQ) {
      std::vector<float> x = kvcd::synthetic::Residuals(seed, p, at, n);
      kvcd::SetBf16FromFloat(app.mutable_x(), {p.num_layers(), n, p.fsq_residual_width()},
                             x.data());
    }
    CHECK_OK(client->Append(app).status());
  }
  std::unique_ptr<kvcd::DecodeStream> stream_rpc;
  std::unique_ptr<kvcd::DecodeChannel> channel;
  if (transport == "stream") {
    auto st = client->OpenDecodeStream();
    CHECK_OK(st.status());
    stream_rpc = std::move(*st);
  } else {
    auto ch = kvcd::DecodeChannel::Open(client, 1u << 20, 600000);
    CHECK_OK(ch.status());
    channel = std::move(*ch);
  }
  static const int kBuild = kvcd::PhaseTimes::Phase("worker.build q,k_new,v_new (host)");
  static const int kCall = kvcd::PhaseTimes::Phase("worker.call (round trip)");
  static const int kLayer = kvcd::PhaseTimes::Phase("worker.layer total");
  const int64_t q_n = int64_t{p.num_q_heads()} * p.head_dim();
  std::vector<float> o(static_cast<size_t>(q_n), 0.0f), q(static_cast<size_t>(q_n));
  std::vector<double> rtt_us, kernel_us;
  kvcd::v1::AttentionDecodeRequest req;
  req.add_sequence_ids(seq);
  req.add_new_tokens(0);
  const auto t_loop = Clock::now();
  for (int s = 0; s < steps; ++s) {
    req.set_new_tokens(0, static_cast<int32_t>((seed + s) % 151000));
    for (int l = 0; l < p.num_layers(); ++l) {
      kvcd::PhaseLap lap, layer_lap;
      const std::vector<float> qr = kvcd::synthetic::Row(seed, p, l, prompt + s, 2);
      for (int64_t i = 0; i < q_n; ++i) {
        const auto k = static_cast<size_t>(i);
        q[k] = 0.5f * std::tanh(o[k]) + qr[k];
      }
      const std::vector<float> kr = kvcd::synthetic::Row(seed, p, l, prompt + s, 0);
      const std::vector<float> vr = kvcd::synthetic::Row(seed, p, l, prompt + s, 1);
      kvcd::SetBf16FromFloat(req.mutable_q(), {1, p.num_q_heads(), p.head_dim()}, q.data());
      kvcd::SetBf16FromFloat(req.mutable_k_new(), {1, p.num_kv_heads(), p.head_dim()}, kr.data());
      kvcd::SetBf16FromFloat(req.mutable_v_new(), {1, p.num_kv_heads(), p.head_dim()}, vr.data());
      if (p.history_format() == kvcd::v1::HISTORY_FORMAT_FSQ) {
        const std::vector<float> xr = kvcd::synthetic::ResidualRow(seed, p, l, prompt + s);
        kvcd::SetBf16FromFloat(req.mutable_x_new(), {1, p.fsq_residual_width()}, xr.data());
      }
      req.set_layer(l);
      req.set_request_id(static_cast<uint64_t>(s) * p.num_layers() + l);
      lap.Mark(kBuild);
      const auto t0 = Clock::now();
      auto r = channel ? channel->Call(req) : stream_rpc->Call(req);
      rtt_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      lap.Mark(kCall);
      CHECK_OK(r.status());
      kernel_us.push_back(r->kernel_seconds() * 1e6);
      for (int64_t i = 0; i < q_n; ++i) o[static_cast<size_t>(i)] = kvcd::ElementAsFloat(r->o(), i);
      layer_lap.Mark(kLayer);
    }
  }
  const double loop_s = std::chrono::duration<double>(Clock::now() - t_loop).count();
  CHECK_OK(channel ? channel->Close() : stream_rpc->Close());
  auto closed = client->CloseSequence(seq);
  CHECK_OK(closed.status());
  std::vector<double> overhead(rtt_us.size());
  for (size_t i = 0; i < rtt_us.size(); ++i) overhead[i] = rtt_us[i] - kernel_us[i];
  std::printf(
      "decode worker: %s, context %lld tokens, %d steps x %d layers, inline tensors (host), "
      "calls over the %s\n",
      model.c_str(), static_cast<long long>(prompt), steps, p.num_layers(),
      transport == "channel" ? "shared-memory decode channel" : "gRPC stream");
  std::printf("tokens/s: %.1f (%.3f ms per token, %d layer calls per token)\n", steps / loop_s,
              loop_s / steps * 1e3, p.num_layers());
  std::printf(
      "per call: round trip p50 %.1f us p90 %.1f us; daemon-side p50 %.1f us; "
      "RPC overhead p50 %.1f us p90 %.1f us\n",
      kw::Median(rtt_us), kw::Percentile(rtt_us, 0.9), kw::Median(kernel_us), kw::Median(overhead),
      kw::Percentile(overhead, 0.9));
  std::printf("final length %lld\n", static_cast<long long>(*closed));
  if (kvcd::PhaseTimes::Enabled()) {
    std::printf("%s", kvcd::PhaseTimes::Report("decode worker (worker side)").c_str());
  }
  const int64_t want = prompt + steps;
  if (*closed != want) {
    std::fprintf(stderr, "decode worker: final length %lld, expected %lld\n",
                 static_cast<long long>(*closed), static_cast<long long>(want));
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "kvcd_decode_worker",
      .summary = "the decode side of disaggregated serving (see the top of decode_worker.cc)",
      .files = {__FILE__, kw::kFlagsFile},
      .synopsis = "--target HOST:PORT --model NAME [--tokens N] [--seed X] [flags]"};
  const kvcd::cli::Parsed flags = kvcd::cli::Parse(program, argc, argv);
  kvcd::ClientOptions opts;
  opts.target = absl::GetFlag(FLAGS_target);
  if (absl::Status s = kw::ApplySecurityFlags(flags, &opts); !s.ok()) {
    std::fprintf(stderr, "%s worker: %s\n", "decode", s.ToString().c_str());
    return 2;
  }
  const std::string model = absl::GetFlag(FLAGS_model);
  const std::string salt = absl::GetFlag(FLAGS_salt);
  const int64_t n_tokens = absl::GetFlag(FLAGS_tokens);
  const uint64_t seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  const int steps = absl::GetFlag(FLAGS_steps);
  const bool sync = absl::GetFlag(FLAGS_sync);
  // --wait device (default): cross-process order through stream waits on the IPC events;
  // --wait host: the host waits for each event, so no stream ever waits on the other
  // process (the per-call cost of GPU time-slicing between the two contexts shows as the
  // difference).
  const std::string wait = absl::GetFlag(FLAGS_wait);
  if (wait != "device" && wait != "host") {
    std::fprintf(stderr, "--wait must be device or host\n");
    return 2;
  }
  const bool host_wait = wait == "host";
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "channel" && transport != "stream") {
    std::fprintf(stderr, "--transport must be channel or stream\n");
    return 2;
  }
  const std::string hops_flag = absl::GetFlag(FLAGS_hops);
  if (hops_flag != "memops" && hops_flag != "events") {
    std::fprintf(stderr, "--hops must be events or memops\n");
    return 2;
  }
  if (hops_flag == "memops" && (transport != "channel" || host_wait)) {
    std::fprintf(stderr, "--hops memops needs --transport channel and --wait device\n");
    return 2;
  }
  const bool memops = hops_flag == "memops";
  const std::string producer = absl::GetFlag(FLAGS_producer);
  if (producer != "fused" && producer != "split") {
    std::fprintf(stderr, "--producer must be fused or split, got %s\n", producer.c_str());
    return 2;
  }
  const bool fused_producer = producer == "fused";
  const std::string io = absl::GetFlag(FLAGS_io);
  if (io != "ipc" && io != "host") {
    std::fprintf(stderr, "--io must be ipc or host\n");
    return 2;
  }
  if (io == "host") {
    auto client = kvcd::Client::Connect(opts);
    CHECK_OK(client.status());
    return RunHostLoop(client->get(), model, salt, n_tokens, seed, steps, transport);
  }
  CHECK_OK(kw::CudaCheck(cudaSetDevice(absl::GetFlag(FLAGS_device)), "cudaSetDevice"));
  auto client = kvcd::Client::Connect(opts);
  CHECK_OK(client.status());
  auto geo = kw::FetchGeometry(client->get(), model);
  CHECK_OK(geo.status());
  const kw::Geometry& g = *geo;
  const int64_t prompt = n_tokens / g.page_size * g.page_size;
  std::vector<int32_t> tokens = kw::PromptTokens(prompt, seed);
  const int64_t lease_ms = absl::GetFlag(FLAGS_lease_ms);
  const int64_t die_after = absl::GetFlag(FLAGS_die_after_calls);
  const int batch = absl::GetFlag(FLAGS_batch);
  if (batch < 1 || batch > 256) {
    std::fprintf(stderr, "--batch must be 1..256\n");
    return 2;
  }
  // The batch's sequences share the cached prompt (each appends its own tokens), or with
  // --distinct-prompts sequence i opens the prompt cached under salt "<salt>-<i>" (its own
  // pages: the prefill worker pushed each).
  const bool distinct = absl::GetFlag(FLAGS_distinct_prompts);
  std::vector<uint64_t> seqs;
  for (int i = 0; i < batch; ++i) {
    const std::string seq_salt = distinct ? salt + "-" + std::to_string(i) : salt;
    auto open = (*client)->OpenSequence(model, seq_salt, tokens, lease_ms);
    CHECK_OK(open.status());
    if (open->matched_tokens() != prompt) {
      std::fprintf(stderr,
                   "only %lld of %lld prompt tokens are cached under salt %s: run the prefill "
                   "worker first, or give the model's pools room for every prompt stored (a "
                   "pool that fills evicts the least recently used unreferenced pages)\n",
                   static_cast<long long>(open->matched_tokens()), static_cast<long long>(prompt),
                   seq_salt.c_str());
      return 1;
    }
    seqs.push_back(open->sequence_id());
  }

  // One buffer: q (BF16), k_new and v_new (BF16), o (F32), lse (F32) of the whole batch,
  // then an FSQ model's x_new (BF16 residuals [batch, C]), 256-byte aligned.
  const int64_t q_n = int64_t{batch} * g.num_q_heads * g.head_dim,
                kv_n = int64_t{batch} * g.num_kv_heads * g.head_dim,
                x_n = int64_t{batch} * g.fsq_residual_width;
  auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t q_off = 0, k_off = align(2 * q_n), v_off = k_off + align(2 * kv_n),
                o_off = v_off + align(2 * kv_n), l_off = o_off + align(4 * q_n),
                x_off = l_off + align(4 * int64_t{batch} * g.num_q_heads),
                s_off = x_off + align(2 * x_n),
                total = s_off + 256;  // the device signal words (--hops memops)
  auto buf = kw::IpcBuffer::Create(client->get(), static_cast<uint64_t>(total), "decode", lease_ms);
  CHECK_OK(buf.status());
  kw::IpcBuffer& b = **buf;
  uint8_t* d = b.data();
  cudaStream_t stream;
  CHECK_OK(kw::CudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"));
  CHECK_OK(kw::CudaCheck(kw::FillBf16(reinterpret_cast<uint16_t*>(d + q_off), q_n, seed, stream),
                         "fill"));
  CHECK_OK(kw::CudaCheck(cudaMemsetAsync(d + o_off, 0, 4 * q_n, stream), "memset"));

  kvcd::v1::AttentionDecodeRequest req;
  for (uint64_t id : seqs) {
    req.add_sequence_ids(id);
    req.add_new_tokens(0);
  }
  b.Region(req.mutable_q(), kvcd::v1::DTYPE_BF16, {batch, g.num_q_heads, g.head_dim}, q_off);
  b.Region(req.mutable_k_new(), kvcd::v1::DTYPE_BF16, {batch, g.num_kv_heads, g.head_dim}, k_off);
  b.Region(req.mutable_v_new(), kvcd::v1::DTYPE_BF16, {batch, g.num_kv_heads, g.head_dim}, v_off);
  b.Region(req.mutable_o_out(), kvcd::v1::DTYPE_F32, {batch, g.num_q_heads, g.head_dim}, o_off);
  b.Region(req.mutable_lse_out(), kvcd::v1::DTYPE_F32, {batch, g.num_q_heads}, l_off);
  if (g.fsq)
    b.Region(req.mutable_x_new(), kvcd::v1::DTYPE_BF16, {batch, g.fsq_residual_width}, x_off);

  std::unique_ptr<kvcd::DecodeStream> stream_rpc;
  std::unique_ptr<kvcd::DecodeChannel> channel;
  if (transport == "stream") {
    auto st = (*client)->OpenDecodeStream();
    CHECK_OK(st.status());
    stream_rpc = std::move(*st);
  } else {
    // Room for the final check's inline q (BF16) in the request and o, lse in the answer.
    const int64_t inline_bytes = 2 * q_n + 4 * q_n + 4 * int64_t{batch} * g.num_q_heads;
    const auto capacity = static_cast<uint32_t>(std::max<int64_t>(1 << 16, 2 * inline_bytes));
    auto ch = kvcd::DecodeChannel::Open(client->get(), capacity, lease_ms);
    CHECK_OK(ch.status());
    channel = std::move(*ch);
    if (memops) {
      CHECK_OK(b.UseSignalWords(static_cast<uint64_t>(s_off)));
      channel->SetDeviceSignal(b.id(), b.signal_offset());
    }
  }
  auto call = [&](const kvcd::v1::AttentionDecodeRequest& r) {
    return channel ? channel->Call(r) : stream_rpc->Call(r);
  };
  // The two hops of a call: the worker's inputs ready for the daemon's stream, the daemon's
  // results for the worker's (device signal words or IPC events).
  auto mark_ready = [&] {
    return memops ? b.SignalReady(stream, channel->NextSignalValue()) : b.MarkReady(stream);
  };
  auto wait_done = [&](uint32_t value) {
    return memops ? b.WaitSignalDone(stream, value) : b.WaitDone(stream);
  };
  std::vector<double> rtt_us, kernel_us, done_us;
  cudaEvent_t done_ev;
  cudaEventCreateWithFlags(&done_ev, cudaEventDisableTiming);
  // The phase's name follows --producer (registered once: Phase looks names up).
  const int kProduce = kvcd::PhaseTimes::Phase(
      fused_producer ? "worker.produce q,k,v (1 launch)" : "worker.produce q,k,v (3 launches)");
  static const int kReady = kvcd::PhaseTimes::Phase("worker.mark ready (event record)");
  static const int kCall = kvcd::PhaseTimes::Phase("worker.call (round trip)");
  static const int kDone = kvcd::PhaseTimes::Phase("worker.wait done (stream wait)");
  static const int kSync = kvcd::PhaseTimes::Phase("worker.result on host (sync)");
  static const int kLayer = kvcd::PhaseTimes::Phase("worker.layer total");
  // The GPU side (with KVCD_PHASE_TIMES=1): timing events on the worker's stream when its
  // q/k/v are produced and when its stream has passed the wait for the daemon's result.
  // q_ready[i] -> o_ready[i] is the daemon's turn as the worker sees it (both cross-process
  // hops and the daemon's GPU work); o_ready[i - 1] -> q_ready[i] the worker's own kernels.
  const bool gpu_timeline = kvcd::PhaseTimes::Enabled();
  std::vector<cudaEvent_t> q_ready, o_ready;
  if (gpu_timeline) {
    q_ready.resize(static_cast<size_t>(steps) * g.num_layers);
    o_ready.resize(q_ready.size());
    for (size_t i = 0; i < q_ready.size(); ++i) {
      CHECK_OK(kw::CudaCheck(cudaEventCreate(&q_ready[i]), "timing event"));
      CHECK_OK(kw::CudaCheck(cudaEventCreate(&o_ready[i]), "timing event"));
    }
  }
  size_t call_index = 0;
  // --die-after-calls: a thread that kills the process once the N-th call has started.
  std::atomic<int64_t> calls_started{0};
  if (die_after > 0) {
    std::thread([&calls_started, die_after] {
      while (calls_started.load(std::memory_order_acquire) < die_after) {
      }
      std::raise(SIGKILL);
    }).detach();
  }
  std::printf("decode loop started\n");
  std::fflush(stdout);
  const auto t_loop = Clock::now();
  for (int s = 0; s < steps; ++s) {
    for (int i = 0; i < batch; ++i) {
      req.set_new_tokens(i, static_cast<int32_t>((seed + s + 7919 * i) % 151000));
    }
    for (int l = 0; l < g.num_layers; ++l) {
      kvcd::PhaseLap lap, layer_lap;
      const uint64_t key = seed * 1000003ull + s * 1009ull + l;
      // This layer's query from the previous layer's output; the token's K/V row (and x).
      auto* q16 = reinterpret_cast<uint16_t*>(d + q_off);
      auto* k16 = reinterpret_cast<uint16_t*>(d + k_off);
      auto* v16 = reinterpret_cast<uint16_t*>(d + v_off);
      auto* x16 = reinterpret_cast<uint16_t*>(d + x_off);
      const auto* o32 = reinterpret_cast<const float*>(d + o_off);
      if (fused_producer) {
        CHECK_OK(kw::CudaCheck(
            kw::ProduceStep(o32, q16, q_n, k16, v16, kv_n, x16, g.fsq ? x_n : 0, key, stream),
            "ProduceStep"));
      } else {
        CHECK_OK(kw::CudaCheck(kw::NextQueries(o32, q16, q_n, key, stream), "NextQueries"));
        CHECK_OK(kw::CudaCheck(kw::FillBf16(k16, kv_n, key ^ 1, stream), "fill k"));
        CHECK_OK(kw::CudaCheck(kw::FillBf16(v16, kv_n, key ^ 2, stream), "fill v"));
        if (g.fsq) CHECK_OK(kw::CudaCheck(kw::FillBf16(x16, x_n, key ^ 3, stream), "fill x"));
      }
      lap.Mark(kProduce);
      if (gpu_timeline) cudaEventRecord(q_ready[call_index], stream);
      const uint32_t signal = channel ? channel->NextSignalValue() : 0;
      CHECK_OK(mark_ready());
      if (host_wait) CHECK_OK(b.WaitReadyOnHost());
      lap.Mark(kReady);
      req.set_layer(l);
      req.set_request_id(static_cast<uint64_t>(s) * g.num_layers + l);
      const auto t0 = Clock::now();
      calls_started.fetch_add(1, std::memory_order_release);
      auto r = call(req);
      const double rtt = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      CHECK_OK(r.status());
      lap.Mark(kCall);
      rtt_us.push_back(rtt);
      kernel_us.push_back(r->kernel_seconds() * 1e6);
      CHECK_OK(host_wait ? b.WaitDoneOnHost() : wait_done(signal));
      if (gpu_timeline) cudaEventRecord(o_ready[call_index], stream);
      ++call_index;
      lap.Mark(kDone);
      if (sync) {
        cudaEventRecord(done_ev, stream);
        CHECK_OK(kw::CudaCheck(cudaEventSynchronize(done_ev), "sync"));
        done_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        lap.Mark(kSync);
      }
      layer_lap.Mark(kLayer);
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
  for (uint64_t id : seqs) check.add_sequence_ids(id);
  b.Region(check.mutable_q(), kvcd::v1::DTYPE_BF16, {batch, g.num_q_heads, g.head_dim}, q_off);
  b.Region(check.mutable_o_out(), kvcd::v1::DTYPE_F32, {batch, g.num_q_heads, g.head_dim}, o_off);
  b.Region(check.mutable_lse_out(), kvcd::v1::DTYPE_F32, {batch, g.num_q_heads}, l_off);
  const uint32_t check_signal = channel ? channel->NextSignalValue() : 0;
  CHECK_OK(mark_ready());
  auto via_ipc = call(check);
  CHECK_OK(via_ipc.status());
  CHECK_OK(wait_done(check_signal));
  CHECK_OK(kw::CudaCheck(cudaStreamSynchronize(stream), "sync"));
  CHECK_OK(
      kw::CudaCheck(cudaMemcpy(o_ipc.data(), d + o_off, 4 * q_n, cudaMemcpyDeviceToHost), "D2H"));
  kvcd::SetBf16Tensor(check.mutable_q(), {batch, g.num_q_heads, g.head_dim}, q_host.data());
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
  auto closed = (*client)->CloseSequence(seqs.front());
  CHECK_OK(closed.status());
  for (size_t i = 1; i < seqs.size(); ++i) CHECK_OK((*client)->CloseSequence(seqs[i]).status());

  std::vector<double> overhead(rtt_us.size());
  for (size_t i = 0; i < rtt_us.size(); ++i) overhead[i] = rtt_us[i] - kernel_us[i];
  std::printf(
      "decode worker: %s, context %lld tokens, batch %d, %d steps x %d layers, tensors over "
      "CUDA IPC, calls over the %s%s%s, hops through %s\n",
      model.c_str(), static_cast<long long>(prompt), batch, steps, g.num_layers,
      transport == "channel" ? "shared-memory decode channel" : "gRPC stream",
      sync ? " (host waits for every result)" : "",
      host_wait ? ", events waited on by the host" : "",
      memops ? "stream memory operations" : "IPC events");
  std::printf("tokens/s: %.1f (%.3f ms per step of %d token(s), %d layer calls per step)\n",
              batch * steps / loop_s, loop_s / steps * 1e3, batch, g.num_layers);
  std::printf(
      "per call: round trip p50 %.1f us p90 %.1f us; daemon-side p50 %.1f us; "
      "RPC overhead p50 %.1f us p90 %.1f us\n",
      kw::Median(rtt_us), kw::Percentile(rtt_us, 0.9), kw::Median(kernel_us), kw::Median(overhead),
      kw::Percentile(overhead, 0.9));
  if (sync) {
    std::printf("per call with the result on the host: p50 %.1f us p90 %.1f us\n",
                kw::Median(done_us), kw::Percentile(done_us, 0.9));
  }
  if (kvcd::PhaseTimes::Enabled()) {
    std::printf("%s", kvcd::PhaseTimes::Report("decode worker (worker side)").c_str());
  }
  if (gpu_timeline && call_index > 1) {
    std::vector<double> worker_gpu, daemon_turn;
    for (size_t i = 1; i < call_index; ++i) {
      float a = 0, b2 = 0;
      if (cudaEventElapsedTime(&a, o_ready[i - 1], q_ready[i]) == cudaSuccess &&
          cudaEventElapsedTime(&b2, q_ready[i], o_ready[i]) == cudaSuccess) {
        worker_gpu.push_back(a * 1e3);
        daemon_turn.push_back(b2 * 1e3);
      }
    }
    auto mean = [](const std::vector<double>& v) {
      double t = 0;
      for (double x : v) t += x;
      return v.empty() ? 0.0 : t / static_cast<double>(v.size());
    };
    std::printf(
        "gpu timeline (worker stream, %zu calls): worker kernels (o ready -> next q ready) p50 "
        "%.1f us mean %.1f us; daemon turn (q ready -> o ready: hops + daemon GPU) p50 %.1f us "
        "mean %.1f us p90 %.1f us\n",
        worker_gpu.size(), kw::Median(worker_gpu), mean(worker_gpu), kw::Median(daemon_turn),
        mean(daemon_turn), kw::Percentile(daemon_turn, 0.9));
    for (size_t i = 0; i < q_ready.size(); ++i) {
      cudaEventDestroy(q_ready[i]);
      cudaEventDestroy(o_ready[i]);
    }
  }
  std::printf("final length %lld; IPC vs inline output max |diff| %.3g (max |o| %.3g): %s\n",
              static_cast<long long>(*closed), max_diff, max_ref,
              max_diff <= 1e-5 * std::max(1.0, max_ref) ? "match" : "MISMATCH");
  return max_diff <= 1e-5 * std::max(1.0, max_ref) ? 0 : 1;
}
