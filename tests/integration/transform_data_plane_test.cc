// int2-transform models (codec file version 3: transform-coded keys, INT2 values with a
// rotation per KV head) served from GPU memory (backend: cuda) through the real daemon and
// client, against the same model on the CPU backend (a second daemon). Skips without a GPU
// (CI); run on the device machine (bench/run-h200-int2-transform.sh).
//
// What must be equal, and what only close:
//   - stored pages (BF16 windows as sent, key codes and gains, INT2 value codes and
//     parameters): byte for byte, whatever the path (inline or CUDA IPC, CPU or CUDA backend,
//     put straight into the history or demoted): the device store reproduces the CPU codecs
//     bit for bit (cuda_transform.h);
//   - CUDA IPC against inline on the CUDA daemon: the same kernels on the same bytes, equal
//     to 4 ULP;
//   - CUDA against CPU attention: close. Both attend on the codes in FP32 in different orders
//     (the CPU's AVX2 path rounds the projected query to int16, bench/results/
//     2026-12-05-int2-transform-daemon.md: <= 3e-4 of the scalar path; the CUDA kernels, the
//     int8 tensor-core one by default or the FP32 one with KVCD_TRANSFORM_KERNEL=fp32, sum the
//     codes uncentred: <= 5e-4 of the float64 oracle in cuda_transform_test).
//     kMaxOutputError bounds the error on o relative to the row's largest |o| (>= 1) and on
//     lse, with room for both; the test prints what it measured.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/synthetic.h"
#include "client/workers/ipc_buffer.h"
#include "common/key_transform_profile.h"
#include "common/rotation.h"
#include "common/tensor_ref.h"
#include "cuda_cpu_daemons.h"
#include "daemon_process.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/transform_attention.h"

namespace kvcd {
namespace {

using testing_util::DecodeThroughBuffer;
using testing_util::ExpectCloseToCpu;
using testing_util::ToDevice;
using workers::IpcBuffer;

constexpr double kMaxOutputError = 3e-3;

// SmolLM2-135M's attention shape (9 query / 3 KV heads, head_dim 64) on 2 layers.
v1::ModelProfile Profile(const std::string& name, int page_size, int head_dim) {
  v1::ModelProfile p;
  p.set_name(name);
  p.set_num_layers(2);
  p.set_num_q_heads(9);
  p.set_num_kv_heads(3);
  p.set_head_dim(head_dim);
  p.set_page_size(page_size);
  p.set_sink_tokens(page_size);
  p.set_recent_tokens(page_size);
  p.set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);  // a version-3 codec: int2-transform
  p.set_memory_bytes(64 << 20);
  p.set_bf16_fraction(0.5);
  return p;
}

// A synthetic version-3 codec file; head 1 of every layer gets the Hadamard value rotation
// (the store's butterfly path), the others random orthogonal ones.
std::string CodecBlob(const v1::ModelProfile& p, uint32_t seed) {
  const int layers = p.num_layers(), heads = p.num_kv_heads(), d = p.head_dim();
  auto hs = KeyTransformProfile::SyntheticHeads(layers, heads, d, seed);
  for (int l = 0; l < layers; ++l) hs[static_cast<size_t>(l) * heads + 1].r_v = HadamardMatrix(d);
  return KeyTransformProfile::ToSafetensors(hs, layers, heads, d, "test").Serialize();
}

class TransformDataPlaneTest : public testing_util::CudaCpuDaemonsTest<::testing::Test> {
 protected:
  void SetUp() override {
    StartDaemons();
    if (IsSkipped() || HasFatalFailure()) return;
    p_ = Profile("smollm2-shape-transform", 32, 64);
    blob_ = CodecBlob(p_, 23);
    RegisterOnBoth(blob_, "bf16", "int2-transform");
  }

  // The fused call `req` with q (F32), k_new, v_new (BF16) of `batch` entries in the worker's
  // buffer b (>= 1 MiB) and the outputs (poisoned with NaN first) written there.
  void DeviceDecode(IpcBuffer& b, const v1::AttentionDecodeRequest& req, int64_t batch,
                    const std::vector<float>& q, const std::vector<uint16_t>& k,
                    const std::vector<uint16_t>& v, std::vector<float>* o,
                    std::vector<float>* lse) {
    DecodeThroughBuffer(cuda_.get(), b, req, batch, p_.num_q_heads(), p_.num_kv_heads(),
                        p_.head_dim(), q, k, v, {}, 0, o, lse);
  }

  std::string blob_;
};

constexpr int64_t kPrompt = 320;  // 10 pages: the sink page, then 9 history pages

// Put (inline and over CUDA IPC), then the fused per-layer decode loop past two demotions,
// on both backends: stored bytes equal everywhere, attention close to the CPU backend's and
// equal between the IPC and inline paths of the CUDA daemon; then the pages pushed from a
// worker's buffer through the device checks, stored byte for byte, and pushed pages with a
// bad key gain or value scale refused.
TEST_F(TransformDataPlaneTest, CudaBackendMatchesCpuBackend) {
  const auto put = MakePut(3, kPrompt, "");
  auto on_cuda = cuda_->Put(put);
  ASSERT_TRUE(on_cuda.ok()) << on_cuda.status();
  ASSERT_TRUE(host_->Put(put).ok());
  const uint64_t cpu_seq = Open(host_.get(), put, "");
  const uint64_t cu_seq = Open(cuda_.get(), put, "");
  const std::string prefix = Stored(host_.get(), cpu_seq);
  ASSERT_FALSE(prefix.empty());
  ASSERT_NE(prefix.find("int2-transform:"), std::string::npos);
  EXPECT_EQ(Stored(cuda_.get(), cu_seq), prefix) << "codes differ from the CPU backend's";

  // The same Put with k and v in a worker buffer (tenant "ipc"): the same pages.
  const std::string& kb = put.k().inline_data();
  const std::string& vb = put.v().inline_data();
  auto buf = IpcBuffer::Create(cuda_.get(), kb.size() + vb.size() + (1 << 20), "xform");
  ASSERT_TRUE(buf.ok()) << buf.status();
  IpcBuffer& b = **buf;
  ToDevice(b.data(), kb.data(), kb.size());
  ToDevice(b.data() + kb.size(), vb.data(), vb.size());
  v1::PutRequest ipc_put = put;
  ipc_put.set_cache_salt("ipc");
  const std::vector<int64_t> kv_shape(put.k().shape().begin(), put.k().shape().end());
  b.Region(ipc_put.mutable_k(), v1::DTYPE_BF16, kv_shape, 0);
  b.Region(ipc_put.mutable_v(), v1::DTYPE_BF16, kv_shape, kb.size());
  ASSERT_TRUE(b.MarkReady(nullptr).ok());
  auto ipc_r = cuda_->Put(ipc_put);
  ASSERT_TRUE(ipc_r.ok()) << ipc_r.status();
  const uint64_t ipc_seq = Open(cuda_.get(), put, "ipc");
  EXPECT_EQ(Stored(cuda_.get(), ipc_seq), prefix);

  // The decode loop: inline on cpu_seq and cu_seq, everything on the device for ipc_seq.
  const int hq = p_.num_q_heads(), hkv = p_.num_kv_heads(), d = p_.head_dim();
  double worst_o = 0, worst_lse = 0;
  // Pages 10 and 11 leave the 32-token window at lengths 384 and 416: demoted.
  const int steps = 100;
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < p_.num_layers(); ++layer) {
      const int64_t pos = kPrompt + step;
      const auto q = synthetic::Row(9, p_, layer, pos, 2);
      std::vector<uint16_t> k(static_cast<size_t>(hkv) * d), v(k.size());
      const auto kf = synthetic::Row(9, p_, layer, pos, 0);
      const auto vf = synthetic::Row(9, p_, layer, pos, 1);
      for (size_t i = 0; i < k.size(); ++i) k[i] = kernels::FloatToBf16(kf[i]);
      for (size_t i = 0; i < v.size(); ++i) v[i] = kernels::FloatToBf16(vf[i]);
      v1::AttentionDecodeRequest in;
      in.set_layer(layer);
      in.add_sequence_ids(cpu_seq);
      SetF32Tensor(in.mutable_q(), {1, hq, d}, q.data());
      SetBf16Tensor(in.mutable_k_new(), {1, hkv, d}, k.data());
      SetBf16Tensor(in.mutable_v_new(), {1, hkv, d}, v.data());
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
      ASSERT_NO_FATAL_FAILURE(DeviceDecode(b, ipc, 1, q, k, v, &o, &lse));
      for (int i = 0; i < hq * d; ++i)
        ASSERT_FLOAT_EQ(o[i], ElementAsFloat(r_cu->o(), i)) << "layer " << layer << " i " << i;
      for (int i = 0; i < hq; ++i) ASSERT_FLOAT_EQ(lse[i], ElementAsFloat(r_cu->lse(), i));
    }
  }
  std::printf(
      "int2-transform: CUDA vs CPU backend over %d steps x %d layers: max o error %.3g (of the "
      "row's max |o|, >= 1), max lse error %.3g\n",
      steps, p_.num_layers(), worst_o, worst_lse);
  auto info = cuda_->GetModel(p_.name());
  ASSERT_TRUE(info.ok());
  EXPECT_GE(info->demoted_pages(), 2u);
  const std::string after = Stored(host_.get(), cpu_seq);
  EXPECT_EQ(Stored(cuda_.get(), cu_seq), after) << "demoted pages differ from the CPU backend's";
  EXPECT_EQ(Stored(cuda_.get(), ipc_seq), after);

  // The sink and history pages pushed from the worker's buffer go through the device checks
  // into another tenant and are stored byte for byte.
  v1::FetchPagesRequest f;
  f.set_sequence_id(cu_seq);
  auto fetched = cuda_->FetchPages(f);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  int64_t n_push = 1;  // page 0 (window), then the history pages up to the recent window
  while (n_push < fetched->pages_size() && fetched->pages(n_push).format() == "int2-transform")
    ++n_push;
  ASSERT_GE(n_push, 12);
  std::string run;
  for (int64_t i = 0; i < n_push; ++i) run += fetched->pages(static_cast<int>(i)).data();
  ASSERT_LE(run.size(), b.size());
  std::vector<int32_t> tokens = synthetic::Tokens(3, 0, kPrompt);
  for (int step = 0; step < steps; ++step) tokens.push_back(synthetic::Token(9, kPrompt + step));
  tokens.resize(static_cast<size_t>(n_push * p_.page_size()));
  auto push = [&](const std::string& bytes, const std::string& salt) {
    ToDevice(b.data(), bytes.data(), bytes.size());
    v1::PushPagesRequest r;
    r.set_model(p_.name());
    r.set_cache_salt(salt);
    r.mutable_tokens()->Add(tokens.begin(), tokens.end());
    r.set_num_pages(n_push);
    b.Region(r.mutable_pages(), v1::DTYPE_U8, {static_cast<int64_t>(bytes.size())}, 0);
    EXPECT_TRUE(b.MarkReady(nullptr).ok());
    return cuda_->PushPages(r).status();
  };
  ASSERT_TRUE(push(run, "pushed").ok());
  const uint64_t pushed_seq = Open(cuda_.get(), tokens, "pushed");
  std::string want;
  for (int64_t i = 0; i < n_push; ++i) {
    want += fetched->pages(static_cast<int>(i)).format() + ":" +
            fetched->pages(static_cast<int>(i)).data();
  }
  EXPECT_EQ(Stored(cuda_.get(), pushed_seq), want);

  // A history page (page 3, layer 1) with a zero key gain, then with a NaN value scale:
  // refused, naming the page, and nothing stored for the tenant.
  const kernels::TransformPageLayout layout{hkv, p_.page_size(), d, (2 * d + 16) / 8};
  const size_t layer_bytes = static_cast<size_t>(layout.Bytes());
  const size_t page3 = fetched->pages(0).data().size() + 2 * fetched->pages(1).data().size();
  ASSERT_EQ(fetched->pages(3).data().size(), p_.num_layers() * layer_bytes);
  struct Bad {
    int64_t at;
    uint16_t value;
    const char* what;
  };
  for (const Bad& bad : {Bad{layout.KGains(2) + 2 * 5, 0x0000, "key gain"},
                         Bad{layout.KGains(0), 0xfc00, "key gain"},
                         Bad{layout.VParams(1) + 2 * 7, 0x7e00, "value parameter"}}) {
    std::string broken = run;
    std::memcpy(&broken[page3 + layer_bytes + static_cast<size_t>(bad.at)], &bad.value, 2);
    const absl::Status st = push(broken, "broken");
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("page 3"), std::string::npos) << st;
    EXPECT_NE(st.message().find(bad.what), std::string::npos) << st;
    EXPECT_EQ(cuda_->Match(p_.name(), "broken", tokens)->matched_tokens(), 0);
  }
}

// The CUDA kernels' sizes: an int2-transform model they cannot run is refused at
// registration, naming what they need, and nothing is registered; the CPU backend serves it.
TEST_F(TransformDataPlaneTest, UnsupportedGeometryIsRefused) {
  for (const auto& [p, needle] :
       {std::pair{Profile("xform-page16", 16, 64), std::string("expected a multiple of 32")},
        std::pair{Profile("xform-d32", 32, 32), std::string("expected 64, 128 or 256")}}) {
    const std::string blob = CodecBlob(p, 5);
    auto r = cuda_->RegisterModel(p, blob);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
    EXPECT_EQ(cuda_->GetModel(p.name()).status().code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE(host_->RegisterModel(p, blob).ok());
  }
}

}  // namespace
}  // namespace kvcd
