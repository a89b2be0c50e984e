// The CUDA IPC / NCCL data plane through the real daemon (backend: cuda) and the real
// client, with this test process as the worker. Skips without a GPU (CI); run on the
// device machine. Every IPC path is checked against the inline path of the same call.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "client/client.h"
#include "client/decode_channel.h"
#include "client/workers/ipc_buffer.h"
#include "cuda_cpu_daemons.h"
#include "daemon_process.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/cuda_nccl.h"
#include "kvcd/kernels/cuda_stream_memops.h"
#include "nccl_rank.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace data_plane_test {

using testing_util::DaemonProcess;
using workers::IpcBuffer;

int DeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::vector<uint8_t> DeviceBytes(const uint8_t* p, size_t n) {
  std::vector<uint8_t> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

class DataPlaneTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(daemon_.Start(testing_util::SmallCudaDaemon()));
    ClientOptions o;
    o.target = daemon_.grpc();
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    auto m = client_->GetModel(GetParam());
    ASSERT_TRUE(m.ok()) << m.status();
    profile_ = m->profile();
    for (const auto& pool : m->pools())
      page_bytes_[pool.format() == "bf16" ? 0 : 1] = pool.page_bytes();
  }

  // The pages of a sequence as stored, inline, concatenated.
  std::string StoredBytes(uint64_t seq) {
    v1::FetchPagesRequest f;
    f.set_sequence_id(seq);
    auto r = client_->FetchPages(f);
    EXPECT_TRUE(r.ok()) << r.status();
    std::string all;
    if (r.ok())
      for (const auto& p : r->pages()) all += p.data();
    return all;
  }
  uint64_t Open(const v1::PutRequest& put, const std::string& salt) {
    const std::vector<int32_t> tokens(put.tokens().begin(), put.tokens().end());
    auto o = client_->OpenSequence(GetParam(), salt, tokens);
    EXPECT_TRUE(o.ok()) << o.status();
    return o.ok() ? o->sequence_id() : 0;
  }

  DaemonProcess daemon_;
  std::unique_ptr<Client> client_;
  v1::ModelProfile profile_;
  uint64_t page_bytes_[2] = {0, 0};
};

constexpr int64_t kPrompt = 512;  // 8 pages: 1 BF16 sink page + 7 history pages

TEST_P(DataPlaneTest, PagesMoveThroughIpcByteForByte) {
  const auto put = synthetic::Put(3, profile_, kPrompt, "a");
  ASSERT_TRUE(client_->Put(put).ok());
  const uint64_t seq = Open(put, "a");
  const std::string stored = StoredBytes(seq);
  ASSERT_FALSE(stored.empty());
  const uint64_t total = stored.size();

  const uint64_t kv_bytes = put.k().inline_data().size();  // BF16 K (or V) of the prompt
  auto buf = IpcBuffer::Create(client_.get(), 2 * std::max(total, kv_bytes) + 4096, "test");
  ASSERT_TRUE(buf.ok()) << buf.status();
  IpcBuffer& b = **buf;
  ASSERT_EQ(cudaMemset(b.data(), 0x5a, b.size()), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // Fetch into the buffer: identical to the inline bytes.
  v1::FetchPagesRequest f;
  f.set_sequence_id(seq);
  b.Region(f.mutable_destination(), v1::DTYPE_U8, {static_cast<int64_t>(total)}, 0);
  ASSERT_TRUE(b.MarkReady(nullptr).ok());
  auto fetched = client_->FetchPages(f);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(fetched->pages_size(), kPrompt / profile_.page_size());
  for (const auto& p : fetched->pages()) EXPECT_TRUE(p.data().empty());
  ASSERT_TRUE(b.WaitDone(nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto dev = DeviceBytes(b.data(), total);
  EXPECT_EQ(std::memcmp(dev.data(), stored.data(), total), 0);

  // Push them from the buffer into tenant b: stored bytes identical, attention identical.
  v1::PushPagesRequest push;
  push.set_model(GetParam());
  push.set_cache_salt("b");
  *push.mutable_tokens() = put.tokens();
  push.set_num_pages(kPrompt / profile_.page_size());
  b.Region(push.mutable_pages(), v1::DTYPE_U8, {static_cast<int64_t>(total)}, 0);
  ASSERT_TRUE(b.MarkReady(nullptr).ok());
  auto pushed = client_->PushPages(push);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(*pushed, kPrompt);
  const uint64_t seq_b = Open(put, "b");
  EXPECT_EQ(StoredBytes(seq_b), stored);

  // Put through IPC (K then V in the buffer) into tenant c: the same stored pages.
  ASSERT_LE(2 * kv_bytes, b.size());
  ASSERT_EQ(cudaMemcpy(b.data(), put.k().inline_data().data(), kv_bytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b.data() + kv_bytes, put.v().inline_data().data(), kv_bytes,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  v1::PutRequest ipc_put = put;
  ipc_put.set_cache_salt("c");
  const std::vector<int64_t> shape(put.k().shape().begin(), put.k().shape().end());
  b.Region(ipc_put.mutable_k(), v1::DTYPE_BF16, shape, 0);
  b.Region(ipc_put.mutable_v(), v1::DTYPE_BF16, shape, kv_bytes);
  ASSERT_TRUE(b.MarkReady(nullptr).ok());
  auto put_c = client_->Put(ipc_put);
  ASSERT_TRUE(put_c.ok()) << put_c.status();
  EXPECT_EQ(put_c->inserted_tokens(), kPrompt);
  EXPECT_EQ(StoredBytes(Open(put, "c")), stored);
}

TEST_P(DataPlaneTest, AttentionThroughIpcMatchesInline) {
  const auto put = synthetic::Put(5, profile_, kPrompt, "");
  ASSERT_TRUE(client_->Put(put).ok());
  const uint64_t s1 = Open(put, ""), s2 = Open(put, "");
  const int hq = profile_.num_q_heads(), hkv = profile_.num_kv_heads(), d = profile_.head_dim();
  const int64_t q_bytes = 4LL * hq * d, kv_bytes = 2LL * hkv * d;
  auto buf = IpcBuffer::Create(client_.get(), 1 << 20, "decode");
  ASSERT_TRUE(buf.ok()) << buf.status();
  IpcBuffer& b = **buf;
  const uint64_t q_off = 0, k_off = 4096, v_off = 8192, o_off = 16384, l_off = 65536;
  for (int step = 0; step < 3; ++step) {
    for (int layer = 0; layer < profile_.num_layers(); ++layer) {
      const int64_t pos = kPrompt + step;
      auto q = synthetic::Row(9, profile_, layer, pos, 2);
      auto k = synthetic::Row(9, profile_, layer, pos, 0);
      auto v = synthetic::Row(9, profile_, layer, pos, 1);
      std::vector<uint16_t> kb(k.size()), vb(v.size());
      for (size_t i = 0; i < k.size(); ++i) kb[i] = kernels::FloatToBf16(k[i]);
      for (size_t i = 0; i < v.size(); ++i) vb[i] = kernels::FloatToBf16(v[i]);
      // Inline on sequence 1.
      v1::AttentionDecodeRequest in;
      in.set_layer(layer);
      in.add_sequence_ids(s1);
      SetF32Tensor(in.mutable_q(), {1, hq, d}, q.data());
      SetBf16Tensor(in.mutable_k_new(), {1, hkv, d}, kb.data());
      SetBf16Tensor(in.mutable_v_new(), {1, hkv, d}, vb.data());
      in.add_new_tokens(synthetic::Token(9, pos));
      auto r_in = client_->AttentionDecode(in);
      ASSERT_TRUE(r_in.ok()) << r_in.status();
      // The same through the buffer on sequence 2, results written on the device.
      ASSERT_EQ(cudaMemcpy(b.data() + q_off, q.data(), q_bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(b.data() + k_off, kb.data(), kv_bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(b.data() + v_off, vb.data(), kv_bytes, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemset(b.data() + o_off, 0xff, q_bytes), cudaSuccess);  // NaN poison
      v1::AttentionDecodeRequest ipc = in;
      ipc.set_sequence_ids(0, s2);
      b.Region(ipc.mutable_q(), v1::DTYPE_F32, {1, hq, d}, q_off);
      b.Region(ipc.mutable_k_new(), v1::DTYPE_BF16, {1, hkv, d}, k_off);
      b.Region(ipc.mutable_v_new(), v1::DTYPE_BF16, {1, hkv, d}, v_off);
      b.Region(ipc.mutable_o_out(), v1::DTYPE_F32, {1, hq, d}, o_off);
      b.Region(ipc.mutable_lse_out(), v1::DTYPE_F32, {1, hq}, l_off);
      ASSERT_TRUE(b.MarkReady(nullptr).ok());
      auto r_ipc = client_->AttentionDecode(ipc);
      ASSERT_TRUE(r_ipc.ok()) << r_ipc.status();
      EXPECT_TRUE(r_ipc->o().has_cuda_ipc());
      ASSERT_EQ(r_ipc->lengths(0), r_in->lengths(0));
      ASSERT_TRUE(b.WaitDone(nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> o(static_cast<size_t>(hq) * d), lse(hq);
      ASSERT_EQ(cudaMemcpy(o.data(), b.data() + o_off, q_bytes, cudaMemcpyDeviceToHost),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(lse.data(), b.data() + l_off, 4 * hq, cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (int i = 0; i < hq * d; ++i) {
        ASSERT_TRUE(std::isfinite(o[i])) << i;
        ASSERT_FLOAT_EQ(o[i], ElementAsFloat(r_in->o(), i)) << "layer " << layer << " i " << i;
      }
      for (int i = 0; i < hq; ++i) ASSERT_FLOAT_EQ(lse[i], ElementAsFloat(r_in->lse(), i));
    }
  }
  EXPECT_EQ(StoredBytes(s1), StoredBytes(s2));
}

// Issue #36: the same calls over the decode channel with the hops as stream memory
// operations (device signal words in the buffer instead of its IPC events). The worker's
// side is all asynchronous on one non-blocking stream: its copies of q/k/v, the ready word,
// the wait for the done word and the copy of the results back are queued before the host
// looks, so a missing or early hop shows as the NaN poison or as another call's results.
TEST_P(DataPlaneTest, AttentionThroughChannelSignalWordsMatchesInline) {
  if (!kernels::cuda::StreamMemopsAvailable()) GTEST_SKIP() << "no stream memory operations";
  const auto put = synthetic::Put(5, profile_, kPrompt, "");
  ASSERT_TRUE(client_->Put(put).ok());
  const uint64_t s1 = Open(put, ""), s2 = Open(put, "");
  const int hq = profile_.num_q_heads(), hkv = profile_.num_kv_heads(), d = profile_.head_dim();
  const int64_t q_bytes = 4LL * hq * d, kv_bytes = 2LL * hkv * d;
  auto buf = IpcBuffer::Create(client_.get(), 1 << 20, "decode");
  ASSERT_TRUE(buf.ok()) << buf.status();
  IpcBuffer& b = **buf;
  const uint64_t q_off = 0, k_off = 4096, v_off = 8192, o_off = 16384, l_off = 65536,
                 s_off = 131072;
  // Signal words must lie inside the buffer at a multiple of 8.
  EXPECT_EQ(b.UseSignalWords((1 << 20) - 4).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(b.UseSignalWords(s_off).ok());
  auto ch = DecodeChannel::Open(client_.get());
  ASSERT_TRUE(ch.ok()) << ch.status();
  DecodeChannel& channel = **ch;
  channel.SetDeviceSignal(b.id(), b.signal_offset());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::vector<float> q_h, o(static_cast<size_t>(hq) * d), lse(hq);
  std::vector<uint16_t> kb, vb;
  for (int step = 0; step < 2; ++step) {
    for (int layer = 0; layer < profile_.num_layers(); ++layer) {
      const int64_t pos = kPrompt + step;
      q_h = synthetic::Row(9, profile_, layer, pos, 2);
      auto k = synthetic::Row(9, profile_, layer, pos, 0);
      auto v = synthetic::Row(9, profile_, layer, pos, 1);
      kb.resize(k.size());
      vb.resize(v.size());
      for (size_t i = 0; i < k.size(); ++i) kb[i] = kernels::FloatToBf16(k[i]);
      for (size_t i = 0; i < v.size(); ++i) vb[i] = kernels::FloatToBf16(v[i]);
      v1::AttentionDecodeRequest in;
      in.set_layer(layer);
      in.add_sequence_ids(s1);
      SetF32Tensor(in.mutable_q(), {1, hq, d}, q_h.data());
      SetBf16Tensor(in.mutable_k_new(), {1, hkv, d}, kb.data());
      SetBf16Tensor(in.mutable_v_new(), {1, hkv, d}, vb.data());
      in.add_new_tokens(synthetic::Token(9, pos));
      auto r_in = client_->AttentionDecode(in);
      ASSERT_TRUE(r_in.ok()) << r_in.status();
      // Queued on the stream, the host never waits: inputs, poison, the ready word.
      ASSERT_EQ(
          cudaMemcpyAsync(b.data() + q_off, q_h.data(), q_bytes, cudaMemcpyHostToDevice, stream),
          cudaSuccess);
      ASSERT_EQ(
          cudaMemcpyAsync(b.data() + k_off, kb.data(), kv_bytes, cudaMemcpyHostToDevice, stream),
          cudaSuccess);
      ASSERT_EQ(
          cudaMemcpyAsync(b.data() + v_off, vb.data(), kv_bytes, cudaMemcpyHostToDevice, stream),
          cudaSuccess);
      ASSERT_EQ(cudaMemsetAsync(b.data() + o_off, 0xff, q_bytes, stream), cudaSuccess);
      const uint32_t value = channel.NextSignalValue();
      ASSERT_TRUE(b.SignalReady(stream, value).ok());
      v1::AttentionDecodeRequest ipc = in;
      ipc.set_sequence_ids(0, s2);
      b.Region(ipc.mutable_q(), v1::DTYPE_F32, {1, hq, d}, q_off);
      b.Region(ipc.mutable_k_new(), v1::DTYPE_BF16, {1, hkv, d}, k_off);
      b.Region(ipc.mutable_v_new(), v1::DTYPE_BF16, {1, hkv, d}, v_off);
      b.Region(ipc.mutable_o_out(), v1::DTYPE_F32, {1, hq, d}, o_off);
      b.Region(ipc.mutable_lse_out(), v1::DTYPE_F32, {1, hq}, l_off);
      auto r_ipc = channel.Call(ipc);
      ASSERT_TRUE(r_ipc.ok()) << r_ipc.status();
      ASSERT_EQ(r_ipc->lengths(0), r_in->lengths(0));
      ASSERT_TRUE(b.WaitSignalDone(stream, value).ok());
      ASSERT_EQ(
          cudaMemcpyAsync(o.data(), b.data() + o_off, q_bytes, cudaMemcpyDeviceToHost, stream),
          cudaSuccess);
      ASSERT_EQ(
          cudaMemcpyAsync(lse.data(), b.data() + l_off, 4 * hq, cudaMemcpyDeviceToHost, stream),
          cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      for (int i = 0; i < hq * d; ++i) {
        ASSERT_TRUE(std::isfinite(o[i])) << i;
        ASSERT_FLOAT_EQ(o[i], ElementAsFloat(r_in->o(), i)) << "layer " << layer << " i " << i;
      }
      for (int i = 0; i < hq; ++i) ASSERT_FLOAT_EQ(lse[i], ElementAsFloat(r_in->lse(), i));
    }
  }
  // A signal offset outside the buffer is refused with a clear error, and nothing is stored.
  const std::string before = StoredBytes(s2);
  channel.SetDeviceSignal(b.id(), (1 << 20) - 4);
  v1::AttentionDecodeRequest bad;
  bad.set_layer(0);
  bad.add_sequence_ids(s2);
  b.Region(bad.mutable_q(), v1::DTYPE_F32, {1, hq, d}, q_off);
  b.Region(bad.mutable_k_new(), v1::DTYPE_BF16, {1, hkv, d}, k_off);
  b.Region(bad.mutable_v_new(), v1::DTYPE_BF16, {1, hkv, d}, v_off);
  bad.add_new_tokens(1);
  auto refused = channel.Call(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("signal_offset"), std::string::npos)
      << refused.status();
  EXPECT_EQ(StoredBytes(s2), before);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_TRUE(channel.Close().ok());
  EXPECT_EQ(StoredBytes(s1), StoredBytes(s2));
}

// The daemon keeps the page tables of the previous call on the device and does not send
// them again when the next call's are equal (every layer of one token). Sequence 1 runs its
// layers back to back (tables reused), sequences 2 and 3 alternate call by call (tables
// sent every call); across page boundaries and demotions their results are bit-identical.
TEST_P(DataPlaneTest, ReusedPageTablesGiveTheSameResultsAsFreshOnes) {
  const auto put = synthetic::Put(6, profile_, kPrompt, "");
  ASSERT_TRUE(client_->Put(put).ok());
  const uint64_t s1 = Open(put, ""), s2 = Open(put, ""), s3 = Open(put, "");
  const int hq = profile_.num_q_heads(), hkv = profile_.num_kv_heads(), d = profile_.head_dim();
  auto request = [&](uint64_t seq, int layer, int step) {
    const int64_t pos = kPrompt + step;
    const auto q = synthetic::Row(6, profile_, layer, pos, 2);
    const auto k = synthetic::Row(6, profile_, layer, pos, 0);
    const auto v = synthetic::Row(6, profile_, layer, pos, 1);
    v1::AttentionDecodeRequest r;
    r.set_layer(layer);
    r.add_sequence_ids(seq);
    SetF32Tensor(r.mutable_q(), {1, hq, d}, q.data());
    SetBf16FromFloat(r.mutable_k_new(), {1, hkv, d}, k.data());
    SetBf16FromFloat(r.mutable_v_new(), {1, hkv, d}, v.data());
    r.add_new_tokens(synthetic::Token(6, pos));
    return r;
  };
  const int steps = 140;  // two page boundaries, and recent-window pages demoted
  std::vector<std::string> back_to_back;
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < profile_.num_layers(); ++layer) {
      auto r = client_->AttentionDecode(request(s1, layer, step));
      ASSERT_TRUE(r.ok()) << r.status();
      back_to_back.push_back(r->o().inline_data() + r->lse().inline_data());
    }
  }
  size_t i = 0;
  for (int step = 0; step < steps; ++step) {
    for (int layer = 0; layer < profile_.num_layers(); ++layer, ++i) {
      for (uint64_t seq : {s2, s3}) {
        auto r = client_->AttentionDecode(request(seq, layer, step));
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_EQ(r->o().inline_data() + r->lse().inline_data(), back_to_back[i])
            << "step " << step << " layer " << layer << " sequence " << seq;
      }
    }
  }
  EXPECT_EQ(StoredBytes(s1), StoredBytes(s2));
}

TEST_P(DataPlaneTest, BadIpcRequestsStoreNothing) {
  const auto put = synthetic::Put(7, profile_, kPrompt, "a");
  ASSERT_TRUE(client_->Put(put).ok());
  const std::string stored = StoredBytes(Open(put, "a"));
  auto buf = IpcBuffer::Create(client_.get(), stored.size() + 256, "bad");
  ASSERT_TRUE(buf.ok()) << buf.status();
  IpcBuffer& b = **buf;
  const std::vector<int32_t> tokens(put.tokens().begin(), put.tokens().end());
  auto push_with = [&](const std::string& bytes, uint64_t offset, int64_t size) {
    EXPECT_EQ(cudaMemcpy(b.data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    v1::PushPagesRequest push;
    push.set_model(GetParam());
    push.set_cache_salt("z");
    *push.mutable_tokens() = put.tokens();
    push.set_num_pages(kPrompt / profile_.page_size());
    b.Region(push.mutable_pages(), v1::DTYPE_U8, {size}, offset);
    EXPECT_TRUE(b.MarkReady(nullptr).ok());
    return client_->PushPages(push).status();
  };
  const int64_t total = static_cast<int64_t>(stored.size());
  // A NaN in the BF16 sink page, a negative scale in the last page (INT2 history, or BF16).
  std::string nan_page = stored;
  nan_page[101] = static_cast<char>(0xff);
  nan_page[100] = static_cast<char>(0xff);
  EXPECT_EQ(push_with(nan_page, 0, total).code(), absl::StatusCode::kInvalidArgument);
  if (GetParam() == "small") {
    std::string neg = stored;
    const int64_t last = total - static_cast<int64_t>(page_bytes_[1]);
    // The first K scale of the last page's first layer: after the K and V codes.
    const int64_t scale_off =
        last + 2 * profile_.num_kv_heads() * profile_.page_size() * (profile_.head_dim() / 4);
    neg[scale_off] = 0x00;
    neg[scale_off + 1] = static_cast<char>(0xbc);  // -1.0 in FP16
    EXPECT_EQ(push_with(neg, 0, total).code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(push_with(stored, 272, total).code(),
            absl::StatusCode::kInvalidArgument);  // past the end
  EXPECT_EQ(push_with(stored, 8, total - 8).code(),
            absl::StatusCode::kInvalidArgument);  // wrong size/misaligned
  auto match = client_->Match(GetParam(), "z", tokens);
  ASSERT_TRUE(match.ok());
  EXPECT_EQ(match->matched_tokens(), 0);
  // The good bytes go in.
  EXPECT_TRUE(push_with(stored, 0, total).ok());
  EXPECT_EQ(client_->Match(GetParam(), "z", tokens)->matched_tokens(), kPrompt);

  // A handle that is not one, and an unknown buffer.
  v1::RegisterBufferRequest junk;
  junk.set_ipc_handle(std::string(64, '\x07'));
  junk.set_size(4096);
  EXPECT_EQ(client_->RegisterBuffer(junk).status().code(), absl::StatusCode::kInvalidArgument);
  v1::PutRequest unknown = put;
  unknown.set_cache_salt("u");
  SetIpcTensor(unknown.mutable_k(), v1::DTYPE_BF16,
               {put.k().shape().begin(), put.k().shape().end()}, 424242, 0);
  EXPECT_EQ(client_->Put(unknown).status().code(), absl::StatusCode::kNotFound);
  auto health = client_->Health();
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
}

// NaN, +Inf and -Inf at random places of the device inputs (CUDA IPC) of Put, Append and
// the fused AttentionDecode: Put and Append fail with INVALID_ARGUMENT naming the tensor and
// store nothing; a pipelined fused call (device q and outputs) answers, poisons that
// sequence's outputs with NaN, and every later call on the sequence fails naming the input
// and layer, while the other sequence of the batch and the shared prefix are untouched.
TEST_P(DataPlaneTest, NonFiniteDeviceInputsAreRefused) {
  const auto put = synthetic::Put(11, profile_, kPrompt, "a");
  ASSERT_TRUE(client_->Put(put).ok());
  const std::string prefix_bytes = StoredBytes(Open(put, "a"));
  ASSERT_FALSE(prefix_bytes.empty());
  auto pages_used = [&] {
    int64_t used = 0;
    auto m = client_->GetModel(GetParam());
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok())
      for (const auto& pool : m->pools()) used += static_cast<int64_t>(pool.pages_used());
    return used;
  };
  const int hq = profile_.num_q_heads(), hkv = profile_.num_kv_heads(), d = profile_.head_dim();
  const int layers = profile_.num_layers();
  const uint64_t kv_bytes = put.k().inline_data().size();
  auto buf = IpcBuffer::Create(client_.get(), 2 * kv_bytes + (1 << 20), "nonfinite");
  ASSERT_TRUE(buf.ok()) << buf.status();
  IpcBuffer& b = **buf;
  std::mt19937_64 rng(std::random_device{}());
  const uint16_t kBad[3] = {0x7fc0, 0x7f80, 0xff80};  // BF16 NaN, +Inf, -Inf
  const char* kBadName[3] = {"NaN", "+Inf", "-Inf"};
  // Puts the BF16 bytes of `req` (inline K, V) into the buffer with one bad value at a
  // random element of `which` (0 = k, 1 = v); returns the request with cuda_ipc tensors.
  auto ipc_kv = [&](const auto& req, auto* out, int which, int bad) {
    std::string k = req.k().inline_data(), v = req.v().inline_data();
    std::string& t = which == 0 ? k : v;
    const size_t at = 2 * (rng() % (t.size() / 2));
    std::memcpy(&t[at], &kBad[bad], 2);
    EXPECT_EQ(cudaMemcpy(b.data(), k.data(), k.size(), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(b.data() + k.size(), v.data(), v.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    const std::vector<int64_t> shape(req.k().shape().begin(), req.k().shape().end());
    b.Region(out->mutable_k(), v1::DTYPE_BF16, shape, 0);
    b.Region(out->mutable_v(), v1::DTYPE_BF16, shape, k.size());
    EXPECT_TRUE(b.MarkReady(nullptr).ok());
  };
  const std::vector<int32_t> tokens(put.tokens().begin(), put.tokens().end());
  const int64_t used0 = pages_used();
  for (int which = 0; which < 2; ++which) {
    for (int bad = 0; bad < 3; ++bad) {
      SCOPED_TRACE(std::string(which == 0 ? "k " : "v ") + kBadName[bad]);
      // Put of a new prompt.
      v1::PutRequest p = synthetic::Put(100 + bad, profile_, kPrompt, "b");
      ipc_kv(p, &p, which, bad);
      absl::Status st = client_->Put(p).status();
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_NE(st.message().find(which == 0 ? "k[" : "v["), std::string::npos) << st;
      const std::vector<int32_t> pt(p.tokens().begin(), p.tokens().end());
      EXPECT_EQ(client_->Match(GetParam(), "b", pt)->matched_tokens(), 0);
      // Append of 3 tokens to a sequence on the cached prefix.
      const uint64_t seq = Open(put, "a");
      v1::PutRequest three = synthetic::Put(200 + bad, profile_, 3, "");
      v1::AppendRequest app;
      app.set_sequence_id(seq);
      *app.mutable_tokens() = three.tokens();
      ipc_kv(three, &app, which, bad);
      st = client_->Append(app).status();
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_EQ(StoredBytes(seq), prefix_bytes);  // length and pages unchanged
      ASSERT_TRUE(client_->CloseSequence(seq).ok());
      EXPECT_EQ(pages_used(), used0);  // nothing kept
    }
  }

  // The fused per-layer call, pipelined: device q, k_new, v_new and outputs.
  const int64_t q_bytes = 4LL * 2 * hq * d, row_bytes = 2LL * 2 * hkv * d;
  const uint64_t q_off = 0, k_off = 65536, v_off = 131072, o_off = 196608, l_off = 458752;
  for (int input = 0; input < 3; ++input) {  // k_new, v_new, q
    for (int bad = 0; bad < 3; ++bad) {
      const char* names[3] = {"k_new", "v_new", "q"};
      SCOPED_TRACE(std::string(names[input]) + " " + kBadName[bad]);
      const uint64_t good = Open(put, "a"), hit = Open(put, "a");
      const int bad_layer = static_cast<int>(rng() % layers);
      for (int layer = 0; layer <= bad_layer; ++layer) {
        std::vector<float> q(static_cast<size_t>(2) * hq * d);
        std::vector<uint16_t> k(static_cast<size_t>(2) * hkv * d), v(k.size());
        for (auto& x : q) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
        for (auto& x : k) x = kernels::FloatToBf16(std::normal_distribution<float>()(rng));
        for (auto& x : v) x = kernels::FloatToBf16(std::normal_distribution<float>()(rng));
        if (layer == bad_layer) {  // batch entry 1 only
          const size_t at = rng() % (input == 2 ? hq * d : hkv * d);
          if (input == 2) {
            const float f[3] = {NAN, INFINITY, -INFINITY};
            q[hq * d + at] = f[bad];
          } else {
            (input == 0 ? k : v)[hkv * d + at] = kBad[bad];
          }
        }
        ASSERT_EQ(cudaMemcpy(b.data() + q_off, q.data(), q_bytes, cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(b.data() + k_off, k.data(), row_bytes, cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(b.data() + v_off, v.data(), row_bytes, cudaMemcpyHostToDevice),
                  cudaSuccess);
        v1::AttentionDecodeRequest req;
        req.set_layer(layer);
        req.add_sequence_ids(good);
        req.add_sequence_ids(hit);
        req.add_new_tokens(1);
        req.add_new_tokens(2);
        b.Region(req.mutable_q(), v1::DTYPE_F32, {2, hq, d}, q_off);
        b.Region(req.mutable_k_new(), v1::DTYPE_BF16, {2, hkv, d}, k_off);
        b.Region(req.mutable_v_new(), v1::DTYPE_BF16, {2, hkv, d}, v_off);
        b.Region(req.mutable_o_out(), v1::DTYPE_F32, {2, hq, d}, o_off);
        b.Region(req.mutable_lse_out(), v1::DTYPE_F32, {2, hq}, l_off);
        ASSERT_TRUE(b.MarkReady(nullptr).ok());
        auto r = client_->AttentionDecode(req);
        ASSERT_TRUE(r.ok()) << r.status();  // answered before its kernels ran
        ASSERT_TRUE(b.WaitDone(nullptr).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<float> o(static_cast<size_t>(2) * hq * d), lse(2 * hq);
        ASSERT_EQ(cudaMemcpy(o.data(), b.data() + o_off, q_bytes, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(lse.data(), b.data() + l_off, 8 * hq, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        for (int i = 0; i < hq * d; ++i) ASSERT_TRUE(std::isfinite(o[i])) << i;
        for (int i = 0; i < hq; ++i) ASSERT_TRUE(std::isfinite(lse[i])) << i;
        for (int i = hq * d; i < 2 * hq * d; ++i) {
          ASSERT_EQ(std::isnan(o[i]), layer == bad_layer) << "layer " << layer << " i " << i;
        }
        for (int i = hq; i < 2 * hq; ++i) ASSERT_EQ(std::isnan(lse[i]), layer == bad_layer);
      }
      // Every later call on the faulted sequence names the input and the layer.
      const std::string want = std::string(names[input]) + " of an earlier AttentionDecode " +
                               "call (layer " + std::to_string(bad_layer) + ")";
      v1::AttentionDecodeRequest next;
      next.set_layer((bad_layer + 1) % layers);
      next.add_sequence_ids(hit);
      SetF32Tensor(next.mutable_q(), {1, hq, d}, std::vector<float>(hq * d, 0.5f).data());
      absl::Status st = client_->AttentionDecode(next).status();
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_NE(st.message().find(want), std::string::npos) << st;
      v1::FetchPagesRequest f;
      f.set_sequence_id(hit);
      EXPECT_EQ(client_->FetchPages(f).status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(client_->RenewLease(hit).status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_TRUE(client_->CloseSequence(hit).ok());
      // The other sequence of the batch goes on.
      next.set_sequence_ids(0, good);
      EXPECT_TRUE(client_->AttentionDecode(next).ok());
      EXPECT_TRUE(client_->CloseSequence(good).ok());
      EXPECT_EQ(StoredBytes(Open(put, "a")), prefix_bytes);
    }
  }

  // Host outputs: the call waits for its kernels and fails itself.
  const uint64_t seq = Open(put, "a");
  std::vector<uint16_t> k(static_cast<size_t>(hkv) * d, kernels::FloatToBf16(0.25f));
  const std::vector<uint16_t> v = k;
  k[rng() % k.size()] = kBad[rng() % 3];
  ASSERT_EQ(cudaMemcpy(b.data() + k_off, k.data(), k.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b.data() + v_off, v.data(), v.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  v1::AttentionDecodeRequest req;
  req.set_layer(0);
  req.add_sequence_ids(seq);
  req.add_new_tokens(3);
  SetF32Tensor(req.mutable_q(), {1, hq, d}, std::vector<float>(hq * d, 0.5f).data());
  b.Region(req.mutable_k_new(), v1::DTYPE_BF16, {1, hkv, d}, k_off);
  b.Region(req.mutable_v_new(), v1::DTYPE_BF16, {1, hkv, d}, v_off);
  ASSERT_TRUE(b.MarkReady(nullptr).ok());
  const absl::Status st = client_->AttentionDecode(req).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("k_new"), std::string::npos) << st;
  EXPECT_TRUE(client_->CloseSequence(seq).ok());
  auto health = client_->Health();
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_P(DataPlaneTest, UnregisterAndLeaseExpiryDropTheMapping) {
  auto buf = IpcBuffer::Create(client_.get(), 1 << 16, "short", /*lease_ms=*/100);
  ASSERT_TRUE(buf.ok()) << buf.status();
  const uint64_t id = (*buf)->id();
  // The reaper drops it once the lease ran out: wait for the daemon's counter to say so.
  EXPECT_TRUE(testing_util::WaitFor(
      [&] {
        return testing_util::MetricValue(testing_util::ScrapeMetrics(daemon_),
                                         "kvcd_expired_buffers_total") >= 1;
      },
      std::chrono::seconds(10)));
  EXPECT_EQ(client_->RenewBuffer(id).status().code(), absl::StatusCode::kNotFound);
  auto stats_text = [&] {
    auto s = client_->Stats();
    return s.ok();
  };
  EXPECT_TRUE(stats_text());
  auto kept = IpcBuffer::Create(client_.get(), 1 << 16, "kept");
  ASSERT_TRUE(kept.ok());
  EXPECT_TRUE(client_->RenewBuffer((*kept)->id(), 20000).ok());
  EXPECT_TRUE((*kept)->Unregister().ok());
  EXPECT_EQ(client_->RenewBuffer((*kept)->id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->UnregisterBuffer((*kept)->id()).code(), absl::StatusCode::kNotFound);
}

// NCCL between this process (rank 1) and the daemon (rank 0). With two GPUs the worker
// uses the second one and the pages must arrive byte-identical; with one GPU NCCL refuses
// two ranks on one device and the push must fail cleanly, storing nothing.
TEST_P(DataPlaneTest, NcclPushAndFetch) {
  if (!kernels::cuda::NcclLoad().ok()) GTEST_SKIP() << kernels::cuda::NcclLoad().message();
  const bool two_gpus = DeviceCount() >= 2;
  const auto put = synthetic::Put(11, profile_, kPrompt, "a");
  ASSERT_TRUE(client_->Put(put).ok());
  const std::string stored = StoredBytes(Open(put, "a"));
  const int64_t total = static_cast<int64_t>(stored.size());
  auto conn = client_->NcclConnect("test", 8000);
  ASSERT_TRUE(conn.ok()) << conn.status();
  if (two_gpus) {
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  }
  void* comm = nullptr;
  void* stream = nullptr;
  ASSERT_EQ(kernels::cuda::CreateStream(&stream).message(), "");
  const std::string init = kernels::cuda::NcclInit(conn->unique_id(), 2, 1, 8000, &comm).message();
  uint8_t* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, 2 * total), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, stored.data(), total, cudaMemcpyHostToDevice), cudaSuccess);
  const v1::PushPagesRequest push = testing_util::NcclPush(
      GetParam(), "n", put, kPrompt / profile_.page_size(), conn->communicator_id(), total);
  absl::StatusOr<int64_t> pushed = absl::UnknownError("not run");
  const std::string sent = testing_util::NcclBeside([&] { pushed = client_->PushPages(push); },
                                                    true, comm, dev, total, stream, init);
  const std::vector<int32_t> tokens(put.tokens().begin(), put.tokens().end());
  if (!two_gpus) {
    EXPECT_FALSE(init.empty()) << "NCCL accepted two ranks on one GPU";
    EXPECT_FALSE(pushed.ok());
    EXPECT_EQ(client_->Match(GetParam(), "n", tokens)->matched_tokens(), 0);
    EXPECT_EQ(*client_->Health(), grpc::health::v1::HealthCheckResponse::SERVING);
    std::printf("one GPU: worker init: %s; push: %s\n", init.c_str(),
                pushed.status().ToString().c_str());
  } else {
    ASSERT_EQ(init, "");
    ASSERT_EQ(sent, "");
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    const uint64_t seq = Open(put, "n");
    EXPECT_EQ(StoredBytes(seq), stored);
    const v1::FetchPagesRequest f = testing_util::NcclFetch(seq, conn->communicator_id(), total);
    absl::StatusOr<v1::FetchPagesResponse> fetched = absl::UnknownError("not run");
    const std::string got = testing_util::NcclBeside([&] { fetched = client_->FetchPages(f); },
                                                     false, comm, dev + total, total, stream);
    ASSERT_TRUE(fetched.ok()) << fetched.status();
    ASSERT_EQ(got, "");
    const auto back = DeviceBytes(dev + total, total);
    EXPECT_EQ(std::memcmp(back.data(), stored.data(), total), 0);
  }
  if (comm != nullptr) (void)kernels::cuda::NcclDestroy(comm);
  EXPECT_TRUE(client_->NcclDisconnect(conn->communicator_id()).ok());
  cudaFree(dev);
  cudaSetDevice(0);
}

INSTANTIATE_TEST_SUITE_P(Models, DataPlaneTest, ::testing::Values("small", "small-bf16"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

}  // namespace data_plane_test
}  // namespace kvcd
