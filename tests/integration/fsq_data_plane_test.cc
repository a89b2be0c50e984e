// FSQ models served from GPU memory (backend: cuda) through the real daemon and client,
// against the same model on the CPU backend (a second daemon) and against the inline path
// of the same calls. Skips without a GPU (CI); run on the device machine
// (bench/run-h200-fsq-daemon.sh).
//
// What must be equal, and what only close:
//   - stored pages (BF16 window K/V as sent, 4-bit codes): byte for byte, whatever the path
//     (inline or CUDA IPC, CPU or CUDA backend, put straight into the history or demoted):
//     the device encoder reproduces the CPU encoder's codes bit for bit (cuda_fsq.h);
//   - CUDA IPC against inline on the CUDA daemon: the same kernels on the same bytes, equal
//     to 4 ULP;
//   - CUDA against CPU attention: close. The CUDA kernel rebuilds the keys on tensor cores
//     with W_k in reduced precision and sums in another order; the CPU kernel works in FP32.
//     kMaxOutputError bounds the error on o relative to the row's largest |o| and on lse
//     (natural log), and the test prints what it measured.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/workers/ipc_buffer.h"
#include "common/fsq_codec.h"
#include "cuda_cpu_daemons.h"
#include "daemon_process.h"
#include "kvcd/kernels/bf16.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace {

using testing_util::DecodeThroughBuffer;
using testing_util::ExpectCloseToCpu;
using testing_util::ToDevice;
using workers::IpcBuffer;

// The bound on |o_cuda - o_cpu| / max(1, max |o_cpu| of the row) and on |lse_cuda - lse_cpu|.
// The CUDA kernel (cuda/fsq_decode_attention.cu) rebuilds keys with W_k in FP16 (2^-12 per
// weight), scores them as TF32 (2^-11) and sums the codes with FP16 softmax weights (2^-11):
// a logit of size |s| <= ~3 moves by ~|s| 2^-11 ~ 1.5e-3, and so does each weight,
// relatively. With every error pointing the same way the output moves by that much times
// the largest |v| (W_v z + b_v with |z| <= 8: up to ~10 here), 1.5e-2; independent errors
// average down by the square root of the tokens, so the run measures ~1e-3 (printed). The
// bound is the aligned worst case, rounded up.
constexpr double kMaxOutputError = 2e-2;

struct FsqCase {
  const char* name;
  int latent;        // G
  bool key_norm;     // RMS key norm
  bool interleaved;  // RoPE pairing
  int rotary_dims;
};

v1::ModelProfile Profile(const FsqCase& c) {
  v1::ModelProfile p;
  p.set_name(std::string("fsq-") + c.name);
  p.set_num_layers(2);
  p.set_num_q_heads(8);
  p.set_num_kv_heads(2);
  p.set_head_dim(128);
  p.set_page_size(16);
  p.set_sink_tokens(16);
  p.set_recent_tokens(32);
  p.set_history_format(v1::HISTORY_FORMAT_FSQ);
  p.set_memory_bytes(64 << 20);
  p.set_bf16_fraction(0.5);
  p.set_fsq_residual_width(192);
  p.set_fsq_latent_width(c.latent);
  p.set_key_norm(c.key_norm ? v1::KEY_NORM_RMS : v1::KEY_NORM_NONE);
  p.set_key_norm_eps(1e-6f);
  p.mutable_rope()->set_theta(10000.0);
  p.mutable_rope()->set_rotary_dims(c.rotary_dims);
  p.mutable_rope()->set_pairing(c.interleaved ? v1::ROPE_PAIRING_INTERLEAVED
                                              : v1::ROPE_PAIRING_HALF);
  return p;
}

std::string CodecBlob(const v1::ModelProfile& p, uint64_t seed) {
  FsqCodecShape s;
  s.num_layers = p.num_layers();
  s.residual_width = p.fsq_residual_width();
  s.latent_width = p.fsq_latent_width();
  s.num_kv_heads = p.num_kv_heads();
  s.head_dim = p.head_dim();
  s.key_norm = p.key_norm() == v1::KEY_NORM_RMS;
  s.key_norm_eps = p.key_norm_eps();
  return FsqCodec::Synthetic(s, seed).ToSafetensors().Serialize();
}

class FsqDataPlaneTest
    : public testing_util::CudaCpuDaemonsTest<::testing::TestWithParam<FsqCase>> {
 protected:
  void SetUp() override {
    StartDaemons();
    if (IsSkipped() || HasFatalFailure()) return;
    p_ = Profile(GetParam());
    RegisterOnBoth(CodecBlob(p_, 17), "bf16+fsq", "fsq");
  }

  // The fused call `req` (its layer, sequences and new tokens) with every tensor in the
  // worker's buffer b (>= 1 MiB): q (F32) and k_new, v_new, x_new (BF16) of `batch` entries
  // go there, the outputs (poisoned with NaN first) are written there and read back into
  // *o and *lse once the call's done event fired.
  void DeviceDecode(IpcBuffer& b, const v1::AttentionDecodeRequest& req, int64_t batch,
                    const std::vector<float>& q, const std::vector<uint16_t>& k,
                    const std::vector<uint16_t>& v, const std::vector<uint16_t>& x,
                    std::vector<float>* o, std::vector<float>* lse) {
    DecodeThroughBuffer(cuda_.get(), b, req, batch, p_.num_q_heads(), p_.num_kv_heads(),
                        p_.head_dim(), q, k, v, x, p_.fsq_residual_width(), o, lse);
  }
};

constexpr int64_t kPrompt = 160;  // 10 pages: the sink page, then 9 history pages

// Put (inline and over CUDA IPC), then the fused per-layer decode loop past two demotions,
// on both backends: stored bytes equal everywhere, attention close to the CPU backend's and
// equal between the IPC and inline paths of the CUDA daemon.
TEST_P(FsqDataPlaneTest, CudaBackendMatchesCpuBackend) {
  const auto put = MakePut(3, kPrompt, "");
  auto on_cuda = cuda_->Put(put);
  ASSERT_TRUE(on_cuda.ok()) << on_cuda.status();
  EXPECT_EQ(on_cuda->inserted_tokens(), kPrompt);
  ASSERT_TRUE(host_->Put(put).ok());
  const uint64_t cpu_seq = Open(host_.get(), put, "");
  const uint64_t cu_seq = Open(cuda_.get(), put, "");
  const std::string prefix = Stored(host_.get(), cpu_seq);
  ASSERT_FALSE(prefix.empty());
  EXPECT_EQ(Stored(cuda_.get(), cu_seq), prefix) << "codes or K/V differ from the CPU backend's";

  // The same Put with k, v and x in a worker buffer (tenant "ipc"): the same pages.
  const std::string& kb = put.k().inline_data();
  const std::string& vb = put.v().inline_data();
  const std::string& xb = put.x().inline_data();
  auto buf = IpcBuffer::Create(cuda_.get(), kb.size() + vb.size() + xb.size() + (1 << 20), "fsq");
  ASSERT_TRUE(buf.ok()) << buf.status();
  IpcBuffer& b = **buf;
  ToDevice(b.data(), kb.data(), kb.size());
  ToDevice(b.data() + kb.size(), vb.data(), vb.size());
  ToDevice(b.data() + kb.size() + vb.size(), xb.data(), xb.size());
  v1::PutRequest ipc_put = put;
  ipc_put.set_cache_salt("ipc");
  const std::vector<int64_t> kv_shape(put.k().shape().begin(), put.k().shape().end());
  const std::vector<int64_t> x_shape(put.x().shape().begin(), put.x().shape().end());
  b.Region(ipc_put.mutable_k(), v1::DTYPE_BF16, kv_shape, 0);
  b.Region(ipc_put.mutable_v(), v1::DTYPE_BF16, kv_shape, kb.size());
  b.Region(ipc_put.mutable_x(), v1::DTYPE_BF16, x_shape, kb.size() + vb.size());
  ASSERT_TRUE(b.MarkReady(nullptr).ok());
  auto ipc_r = cuda_->Put(ipc_put);
  ASSERT_TRUE(ipc_r.ok()) << ipc_r.status();
  EXPECT_EQ(ipc_r->inserted_tokens(), kPrompt);
  const uint64_t ipc_seq = Open(cuda_.get(), put, "ipc");
  EXPECT_EQ(Stored(cuda_.get(), ipc_seq), prefix);

  // The decode loop: inline on cpu_seq and cu_seq, everything on the device for ipc_seq.
  const int hq = p_.num_q_heads(), hkv = p_.num_kv_heads(), d = p_.head_dim();
  const int c = p_.fsq_residual_width();
  double worst_o = 0, worst_lse = 0;
  // Pages 10 and 11 leave the 32-token window at lengths 208 and 224: demoted.
  const int steps = 66;
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < p_.num_layers(); ++layer) {
      const int64_t pos = kPrompt + step;
      const auto q = synthetic::Row(9, p_, layer, pos, 2);
      std::vector<uint16_t> k(static_cast<size_t>(hkv) * d), v(k.size()), x(c);
      const auto kf = synthetic::Row(9, p_, layer, pos, 0);
      const auto vf = synthetic::Row(9, p_, layer, pos, 1);
      const auto xf = synthetic::ResidualRow(9, p_, layer, pos);
      for (size_t i = 0; i < k.size(); ++i) k[i] = kernels::FloatToBf16(kf[i]);
      for (size_t i = 0; i < v.size(); ++i) v[i] = kernels::FloatToBf16(vf[i]);
      for (size_t i = 0; i < x.size(); ++i) x[i] = kernels::FloatToBf16(xf[i]);
      v1::AttentionDecodeRequest in;
      in.set_layer(layer);
      in.add_sequence_ids(cpu_seq);
      SetF32Tensor(in.mutable_q(), {1, hq, d}, q.data());
      SetBf16Tensor(in.mutable_k_new(), {1, hkv, d}, k.data());
      SetBf16Tensor(in.mutable_v_new(), {1, hkv, d}, v.data());
      SetBf16Tensor(in.mutable_x_new(), {1, c}, x.data());
      in.add_new_tokens(synthetic::Token(9, pos));
      auto r_cpu = host_->AttentionDecode(in);
      ASSERT_TRUE(r_cpu.ok()) << r_cpu.status();
      in.set_sequence_ids(0, cu_seq);
      auto r_cu = cuda_->AttentionDecode(in);
      ASSERT_TRUE(r_cu.ok()) << r_cu.status();
      ASSERT_EQ(r_cu->lengths(0), r_cpu->lengths(0));
      ASSERT_NO_FATAL_FAILURE(
          ExpectCloseToCpu(*r_cu, *r_cpu, hq, d, kMaxOutputError,
                           "step " + std::to_string(step) + " layer " + std::to_string(layer),
                           &worst_o, &worst_lse));

      // The same call with every tensor in the worker's buffer, results on the device.
      v1::AttentionDecodeRequest ipc;
      ipc.set_layer(layer);
      ipc.add_sequence_ids(ipc_seq);
      ipc.add_new_tokens(synthetic::Token(9, pos));
      std::vector<float> o, lse;
      ASSERT_NO_FATAL_FAILURE(DeviceDecode(b, ipc, 1, q, k, v, x, &o, &lse));
      for (int i = 0; i < hq * d; ++i)
        ASSERT_FLOAT_EQ(o[i], ElementAsFloat(r_cu->o(), i)) << "layer " << layer << " i " << i;
      for (int i = 0; i < hq; ++i) ASSERT_FLOAT_EQ(lse[i], ElementAsFloat(r_cu->lse(), i));
    }
  }
  std::printf(
      "fsq %s: CUDA vs CPU backend over %d steps x %d layers: max o error %.3g (of the "
      "row's max |o|, >= 1), max lse error %.3g\n",
      GetParam().name, steps, p_.num_layers(), worst_o, worst_lse);
  auto info = cuda_->GetModel(p_.name());
  ASSERT_TRUE(info.ok());
  EXPECT_GE(info->demoted_pages(), 2u);
  const std::string after = Stored(host_.get(), cpu_seq);
  EXPECT_EQ(Stored(cuda_.get(), cu_seq), after) << "demoted codes differ from the CPU backend's";
  EXPECT_EQ(Stored(cuda_.get(), ipc_seq), after);

  // The sink and history pages pushed from the worker's buffer go through the device checks
  // into another tenant and are stored byte for byte.
  v1::FetchPagesRequest f;
  f.set_sequence_id(cu_seq);
  auto fetched = cuda_->FetchPages(f);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  int64_t n_push = 1;  // page 0 (window), then the history pages up to the recent window
  while (n_push < fetched->pages_size() && fetched->pages(n_push).format() == "fsq") ++n_push;
  ASSERT_GE(n_push, 12);
  std::string run;
  for (int64_t i = 0; i < n_push; ++i) run += fetched->pages(static_cast<int>(i)).data();
  ASSERT_LE(run.size(), b.size());
  ToDevice(b.data(), run.data(), run.size());
  std::vector<int32_t> tokens = synthetic::Tokens(3, 0, kPrompt);
  for (int step = 0; step < steps; ++step) tokens.push_back(synthetic::Token(9, kPrompt + step));
  tokens.resize(static_cast<size_t>(n_push * p_.page_size()));
  v1::PushPagesRequest push;
  push.set_model(p_.name());
  push.set_cache_salt("pushed");
  push.mutable_tokens()->Add(tokens.begin(), tokens.end());
  push.set_num_pages(n_push);
  b.Region(push.mutable_pages(), v1::DTYPE_U8, {static_cast<int64_t>(run.size())}, 0);
  ASSERT_TRUE(b.MarkReady(nullptr).ok());
  auto pushed = cuda_->PushPages(push);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  const uint64_t pushed_seq = Open(cuda_.get(), tokens, "pushed");
  std::string want;
  for (int64_t i = 0; i < n_push; ++i) {
    want += fetched->pages(static_cast<int>(i)).format() + ":" +
            fetched->pages(static_cast<int>(i)).data();
  }
  EXPECT_EQ(Stored(cuda_.get(), pushed_seq), want);
}

// NaN, +Inf and -Inf in device residuals: Put and Append fail with INVALID_ARGUMENT naming
// x and store nothing; a pipelined fused call answers, NaN-poisons that sequence's outputs,
// and every later call on it fails naming the input and layer; the other sequence of the
// batch goes on.
TEST_P(FsqDataPlaneTest, NonFiniteDeviceResidualsAreRefused) {
  const auto put = MakePut(5, kPrompt, "a");
  ASSERT_TRUE(cuda_->Put(put).ok());
  const std::string prefix = Stored(cuda_.get(), Open(cuda_.get(), put, "a"));
  const int hq = p_.num_q_heads(), hkv = p_.num_kv_heads(), d = p_.head_dim();
  const int c = p_.fsq_residual_width(), layers = p_.num_layers();
  auto buf = IpcBuffer::Create(cuda_.get(), put.x().inline_data().size() + (1 << 21), "nonfinite");
  ASSERT_TRUE(buf.ok()) << buf.status();
  IpcBuffer& b = **buf;
  std::mt19937_64 rng(std::random_device{}());
  const uint16_t kBad[3] = {0x7fc0, 0x7f80, 0xff80};  // BF16 NaN, +Inf, -Inf
  auto pages_used = [&] {
    int64_t used = 0;
    auto m = cuda_->GetModel(p_.name());
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok())
      for (const auto& pool : m->pools()) used += static_cast<int64_t>(pool.pages_used());
    return used;
  };
  // k, v inline; x with one bad value in the buffer.
  auto bad_x = [&](const std::string& x_bytes, const auto& shape, v1::TensorRef* t, int bad) {
    std::string x = x_bytes;
    const size_t at = 2 * (rng() % (x.size() / 2));
    std::memcpy(&x[at], &kBad[bad], 2);
    ToDevice(b.data(), x.data(), x.size());
    b.Region(t, v1::DTYPE_BF16, shape, 0);
    EXPECT_TRUE(b.MarkReady(nullptr).ok());
  };
  const int64_t used0 = pages_used();
  for (int bad = 0; bad < 3; ++bad) {
    SCOPED_TRACE(bad);
    v1::PutRequest p = MakePut(100 + bad, kPrompt, "b");
    bad_x(p.x().inline_data(), std::vector<int64_t>(p.x().shape().begin(), p.x().shape().end()),
          p.mutable_x(), bad);
    absl::Status st = cuda_->Put(p).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("x["), std::string::npos) << st;
    const std::vector<int32_t> pt(p.tokens().begin(), p.tokens().end());
    EXPECT_EQ(cuda_->Match(p_.name(), "b", pt)->matched_tokens(), 0);

    const uint64_t seq = Open(cuda_.get(), put, "a");
    v1::PutRequest three = MakePut(200 + bad, 3, "");
    v1::AppendRequest app;
    app.set_sequence_id(seq);
    *app.mutable_tokens() = three.tokens();
    *app.mutable_k() = three.k();
    *app.mutable_v() = three.v();
    bad_x(three.x().inline_data(), std::vector<int64_t>{layers, 3, c}, app.mutable_x(), bad);
    st = cuda_->Append(app).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("x["), std::string::npos) << st;
    EXPECT_EQ(Stored(cuda_.get(), seq), prefix);
    ASSERT_TRUE(cuda_->CloseSequence(seq).ok());
    EXPECT_EQ(pages_used(), used0);
  }

  // The pipelined fused call: device q, k_new, v_new, x_new and outputs; x_new of batch
  // entry 1 bad at one layer.
  const uint64_t good = Open(cuda_.get(), put, "a"), hit = Open(cuda_.get(), put, "a");
  const int bad_layer = static_cast<int>(rng() % layers);
  for (int layer = 0; layer <= bad_layer; ++layer) {
    std::vector<float> q(static_cast<size_t>(2) * hq * d);
    std::vector<uint16_t> k(static_cast<size_t>(2) * hkv * d), v(k.size()), x(2 * c);
    for (auto& e : q) e = std::normal_distribution<float>()(rng);
    for (auto& e : k) e = kernels::FloatToBf16(std::normal_distribution<float>()(rng));
    for (auto& e : v) e = kernels::FloatToBf16(std::normal_distribution<float>()(rng));
    for (auto& e : x) e = kernels::FloatToBf16(std::normal_distribution<float>()(rng));
    if (layer == bad_layer) x[c + rng() % c] = kBad[rng() % 3];
    v1::AttentionDecodeRequest req;
    req.set_layer(layer);
    req.add_sequence_ids(good);
    req.add_sequence_ids(hit);
    req.add_new_tokens(1);
    req.add_new_tokens(2);
    std::vector<float> o, lse;
    ASSERT_NO_FATAL_FAILURE(DeviceDecode(b, req, 2, q, k, v, x, &o, &lse));
    for (int i = 0; i < hq * d; ++i) ASSERT_TRUE(std::isfinite(o[i])) << i;
    for (int i = hq * d; i < 2 * hq * d; ++i)
      ASSERT_EQ(std::isnan(o[i]), layer == bad_layer) << "layer " << layer << " i " << i;
    for (int i = 0; i < hq; ++i) ASSERT_TRUE(std::isfinite(lse[i])) << i;
    for (int i = hq; i < 2 * hq; ++i) ASSERT_EQ(std::isnan(lse[i]), layer == bad_layer) << i;
  }
  const std::string want =
      "x_new of an earlier AttentionDecode call (layer " + std::to_string(bad_layer) + ")";
  v1::AttentionDecodeRequest next;
  next.set_layer((bad_layer + 1) % layers);
  next.add_sequence_ids(hit);
  SetF32Tensor(next.mutable_q(), {1, hq, d}, std::vector<float>(hq * d, 0.5f).data());
  absl::Status st = cuda_->AttentionDecode(next).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(want), std::string::npos) << st;
  EXPECT_TRUE(cuda_->CloseSequence(hit).ok());
  next.set_sequence_ids(0, good);
  EXPECT_TRUE(cuda_->AttentionDecode(next).ok());
  EXPECT_TRUE(cuda_->CloseSequence(good).ok());
  EXPECT_EQ(Stored(cuda_.get(), Open(cuda_.get(), put, "a")), prefix);
  EXPECT_EQ(*cuda_->Health(), grpc::health::v1::HealthCheckResponse::SERVING);
}

// The CUDA kernels' sizes: an FSQ model they cannot run is refused at registration, naming
// what they need, and nothing is registered.
TEST_P(FsqDataPlaneTest, UnsupportedGeometryIsRefused) {
  v1::ModelProfile p = Profile(GetParam());
  p.set_name("fsq-odd-page");
  p.set_page_size(8);
  p.set_sink_tokens(8);
  auto r = cuda_->RegisterModel(p, CodecBlob(p, 17));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("expected a multiple of 16"), std::string::npos)
      << r.status();
  EXPECT_EQ(cuda_->GetModel("fsq-odd-page").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(host_->RegisterModel(p, CodecBlob(p, 17)).ok());  // the CPU backend serves it
}

INSTANTIATE_TEST_SUITE_P(Codecs, FsqDataPlaneTest,
                         ::testing::Values(FsqCase{"g33_norm_interleaved", 33, true, true, 64},
                                           FsqCase{"g64_half", 64, false, false, 128}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kvcd
