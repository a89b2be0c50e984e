// What the daemon tests of a format on the CUDA backend against the same model on the CPU
// backend share (cuda_cpu_decode_test.cc): the two daemons'
// configuration, connecting a client, uploads into a worker's device buffer, a sequence's
// stored pages for byte comparisons, and the fixture (CudaCpuDaemonsTest). Header-only,
// test code.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/workers/ipc_buffer.h"
#include "daemon_process.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

namespace kvcd::testing_util {

inline int CudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// A daemon on loopback with `backend` (cuda or cpu), 512 MiB, short drain.
inline std::string BackendConfig(const std::string& backend) {
  return "listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\nbackend: " + backend +
         "\nmemory_budget: 512MiB\nlease: {default_ms: 60000, max_ms: 120000}\n"
         "drain_timeout_ms: 300\n";
}

// One model entry of the CUDA tests' small geometry (2 layers, 8 q / 2 KV heads, head_dim
// 128, pages of 64 tokens, a sink of 64 and a recent window of 128), then `rest`: its further
// keys, each line indented by four spaces.
inline std::string SmallModel(const std::string& name, const std::string& rest) {
  return "  - name: " + name +
         "\n    num_layers: 2\n    num_q_heads: 8\n    num_kv_heads: 2\n    head_dim: 128\n"
         "    page_size: 64\n    sink_tokens: 64\n    recent_tokens: 128\n" +
         rest;
}
// The keys of an INT2 history beside BF16 windows that hold half the model's memory.
inline constexpr char kSmallInt2[] =
    "    history_format: int2-oscar\n    memory: 96MiB\n    bf16_fraction: 0.5\n";

// A CUDA daemon holding two small models of one geometry: `small` (INT2 history, half its
// memory BF16) and `small-bf16` (the data-plane and device-pull tests).
inline std::string SmallCudaDaemon() {
  return "listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\nbackend: cuda\nmemory_budget: 512MiB\n"
         "lease: {default_ms: 30000, max_ms: 60000}\ndrain_timeout_ms: 300\nmodels:\n" +
         SmallModel("small", kSmallInt2) + SmallModel("small-bf16", "    memory: 64MiB\n");
}

inline std::unique_ptr<Client> ConnectTo(const DaemonProcess& d) {
  ClientOptions o;
  o.target = d.grpc();
  auto c = Client::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

template <typename T>
void ToDevice(uint8_t* dst, const T* src, size_t bytes) {
  ASSERT_EQ(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

// The bytes of `put`'s inline k, v and x.
inline size_t PutBytes(const v1::PutRequest& put) {
  return put.k().inline_data().size() + put.v().inline_data().size() + put.x().inline_data().size();
}

// `put` under tenant `salt` with its k, v (and x, when set) copied into worker buffer `b`, which
// must hold PutBytes(put): the regions are k at 0, v after it, x after v. The caller marks `b`
// ready.
inline v1::PutRequest PutFromBuffer(workers::IpcBuffer& b, const v1::PutRequest& put,
                                    const std::string& salt) {
  const std::string& kb = put.k().inline_data();
  const std::string& vb = put.v().inline_data();
  const std::string& xb = put.x().inline_data();
  ToDevice(b.data(), kb.data(), kb.size());
  ToDevice(b.data() + kb.size(), vb.data(), vb.size());
  v1::PutRequest ipc_put = put;
  ipc_put.set_cache_salt(salt);
  const std::vector<int64_t> kv_shape(put.k().shape().begin(), put.k().shape().end());
  b.Region(ipc_put.mutable_k(), v1::DTYPE_BF16, kv_shape, 0);
  b.Region(ipc_put.mutable_v(), v1::DTYPE_BF16, kv_shape, kb.size());
  if (put.has_x()) {
    ToDevice(b.data() + kb.size() + vb.size(), xb.data(), xb.size());
    const std::vector<int64_t> x_shape(put.x().shape().begin(), put.x().shape().end());
    b.Region(ipc_put.mutable_x(), v1::DTYPE_BF16, x_shape, kb.size() + vb.size());
  }
  return ipc_put;
}

inline uint64_t OpenOn(Client* c, const std::string& model, const std::vector<int32_t>& tokens,
                       const std::string& salt) {
  auto o = c->OpenSequence(model, salt, tokens, 60000);
  EXPECT_TRUE(o.ok()) << o.status();
  return o.ok() ? o->sequence_id() : 0;
}

// A sequence's full pages as stored (formats and bytes), inline. (The slots of a partial
// last page past the sequence's length hold whatever the page held before: a page freed
// by a demotion is reused, on each daemon in its own order.)
inline std::string StoredPages(Client* c, uint64_t seq, int32_t page_size) {
  v1::FetchPagesRequest f;
  f.set_sequence_id(seq);
  auto r = c->FetchPages(f);
  EXPECT_TRUE(r.ok()) << r.status();
  std::string all;
  if (!r.ok()) return all;
  for (const auto& pg : r->pages()) {
    if (pg.num_tokens() == page_size) all += pg.format() + ":" + pg.data();
  }
  return all;
}

// The fused call `req` (its layer, sequences and new tokens) of `batch` entries through
// `cuda` with every tensor in the worker's buffer b (>= 1 MiB): q (F32, [batch][hq][d]),
// k_new and v_new (BF16, [batch][hkv][d]) and, when x is not empty, x_new (BF16,
// [batch][x_width]); the outputs (poisoned with NaN first) are written there and read back
// into *o and *lse once the call's done event fired.
inline void DecodeThroughBuffer(Client* cuda, workers::IpcBuffer& b, v1::AttentionDecodeRequest req,
                                int64_t batch, int64_t hq, int64_t hkv, int64_t d,
                                const std::vector<float>& q, const std::vector<uint16_t>& k,
                                const std::vector<uint16_t>& v, const std::vector<uint16_t>& x,
                                int64_t x_width, std::vector<float>* o, std::vector<float>* lse) {
  const uint64_t q_off = 0, k_off = 65536, v_off = 131072, x_off = 196608, o_off = 262144,
                 l_off = 524288;
  ToDevice(b.data() + q_off, q.data(), q.size() * 4);
  ToDevice(b.data() + k_off, k.data(), k.size() * 2);
  ToDevice(b.data() + v_off, v.data(), v.size() * 2);
  if (!x.empty()) ToDevice(b.data() + x_off, x.data(), x.size() * 2);
  o->assign(static_cast<size_t>(batch * hq * d), 0.0f);
  lse->assign(static_cast<size_t>(batch * hq), 0.0f);
  ASSERT_EQ(cudaMemset(b.data() + o_off, 0xff, o->size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(b.data() + l_off, 0xff, lse->size() * 4), cudaSuccess);
  b.Region(req.mutable_q(), v1::DTYPE_F32, {batch, hq, d}, q_off);
  b.Region(req.mutable_k_new(), v1::DTYPE_BF16, {batch, hkv, d}, k_off);
  b.Region(req.mutable_v_new(), v1::DTYPE_BF16, {batch, hkv, d}, v_off);
  if (!x.empty()) b.Region(req.mutable_x_new(), v1::DTYPE_BF16, {batch, x_width}, x_off);
  b.Region(req.mutable_o_out(), v1::DTYPE_F32, {batch, hq, d}, o_off);
  b.Region(req.mutable_lse_out(), v1::DTYPE_F32, {batch, hq}, l_off);
  ASSERT_TRUE(b.MarkReady(nullptr).ok());
  auto r = cuda->AttentionDecode(req);
  ASSERT_TRUE(r.ok()) << r.status();  // a pipelined call answers before its kernels ran
  EXPECT_TRUE(r->o().has_cuda_ipc());
  ASSERT_TRUE(b.WaitDone(nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(o->data(), b.data() + o_off, o->size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(lse->data(), b.data() + l_off, lse->size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
}

// The CUDA backend's answer against the CPU backend's, query head by query head (hq heads of
// d values): every o finite, the largest |o_cuda - o_cpu| relative to max(1, the head's
// largest |o_cpu|) and |lse_cuda - lse_cpu| at most `bound`; *worst_o and *worst_lse keep the
// largest seen. Fatal failures name `where` and the head (callers: ASSERT_NO_FATAL_FAILURE).
inline void ExpectCloseToCpu(const v1::AttentionDecodeResponse& cu,
                             const v1::AttentionDecodeResponse& cpu, int hq, int d, double bound,
                             const std::string& where, double* worst_o, double* worst_lse) {
  for (int h = 0; h < hq; ++h) {
    double row_max = 1.0, err = 0;
    for (int i = h * d; i < (h + 1) * d; ++i)
      row_max = std::max(row_max, std::fabs(double{ElementAsFloat(cpu.o(), i)}));
    for (int i = h * d; i < (h + 1) * d; ++i) {
      const float got = ElementAsFloat(cu.o(), i);
      ASSERT_TRUE(std::isfinite(got)) << where << " i " << i;
      err = std::max(err, std::fabs(got - double{ElementAsFloat(cpu.o(), i)}));
    }
    const double lse_err =
        std::fabs(double{ElementAsFloat(cu.lse(), h)} - ElementAsFloat(cpu.lse(), h));
    *worst_o = std::max(*worst_o, err / row_max);
    *worst_lse = std::max(*worst_lse, lse_err);
    ASSERT_LE(err / row_max, bound) << where << " head " << h;
    ASSERT_LE(lse_err, bound) << where << " head " << h;
  }
}

// The fixture: a cuda daemon and a cpu daemon (skipped without a device), the
// model p_ registered on both with its codec blob and checked to get the window and history
// pool formats expected; Puts of synthetic K/V (and residuals for FSQ models), sequences
// opened on them, their stored pages. Base is ::testing::Test or ::testing::TestWithParam<T>.
template <class Base>
class CudaCpuDaemonsTest : public Base {
 protected:
  // Starts both daemons and connects; call first in the derived SetUp (a skip returns early).
  void StartDaemons() {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(gpu_.Start(BackendConfig("cuda")));
    ASSERT_TRUE(cpu_.Start(BackendConfig("cpu")));
    cuda_ = ConnectTo(gpu_);
    host_ = ConnectTo(cpu_);
    ASSERT_TRUE(cuda_ != nullptr && host_ != nullptr);
  }

  // Registers p_ with `blob` on both daemons and checks its pools' formats: the window's,
  // then the history's (none for a model that keeps its history in the window format).
  void RegisterOnBoth(const std::string& blob, const std::vector<std::string>& pool_formats) {
    for (Client* c : {cuda_.get(), host_.get()}) {
      auto info = c->RegisterModel(p_, blob);
      ASSERT_TRUE(info.ok()) << info.status();
      ASSERT_EQ(info->pools_size(), static_cast<int>(pool_formats.size()));
      for (int i = 0; i < info->pools_size(); ++i)
        EXPECT_EQ(info->pools(i).format(), pool_formats[static_cast<size_t>(i)]) << "pool " << i;
    }
  }

  v1::PutRequest MakePut(uint64_t seed, int64_t n, const std::string& salt) const {
    return synthetic::Put(seed, p_, n, salt);
  }

  uint64_t Open(Client* c, const std::vector<int32_t>& tokens, const std::string& salt) const {
    return OpenOn(c, p_.name(), tokens, salt);
  }
  uint64_t Open(Client* c, const v1::PutRequest& put, const std::string& salt) const {
    return Open(c, std::vector<int32_t>(put.tokens().begin(), put.tokens().end()), salt);
  }

  // A sequence's full pages as stored (formats and bytes), inline.
  std::string Stored(Client* c, uint64_t seq) const { return StoredPages(c, seq, p_.page_size()); }

  DaemonProcess gpu_, cpu_;
  std::unique_ptr<Client> cuda_, host_;
  v1::ModelProfile p_;
};

}  // namespace kvcd::testing_util
