// The CUDA backend on the second GPU (`cuda_device: 1`): the daemon's pools, copies, kernels,
// CUDA IPC mappings and NCCL communicator must all be on device 1 whichever daemon thread
// reaches CUDA (gRPC callback threads, the request executor, a decode channel's thread, an
// NCCL link's thread), not on device 0, each thread's default. One real daemon with
// backend: cuda on device 1 and one with backend: cpu, driven by the real client:
//   - every page pool is on device 1, of the model in the configuration (allocated on the
//     daemon's main thread at start-up) and of one registered over gRPC (the daemon checks
//     each with cudaPointerGetAttributes, kernels' PointerDevice, and logs where it is);
//   - Put (inline and from a worker buffer on device 1 over CUDA IPC), FetchPages and
//     PushPages store and return the CPU backend's bytes;
//   - the per-layer decode loop, over gRPC, over a decode channel and over CUDA IPC, answers
//     close to the CPU backend (the bound of cuda_cpu_decode_test.cc's int2-oscar case) and
//     the three CUDA paths equal to each other;
//   - pages pushed and fetched over NCCL between the daemon (rank 0, device 1) and this
//     process (rank 1, device 0) arrive byte for byte;
// and, in this process, kernels' SetDevice binding every thread (CudaDeviceOneBinding).
// Skips without two GPUs: with one, cuda_device 0 is every thread's default anyway and
// proves nothing. Run on the device machine (bench/run-h200-cluster-xfer.sh, 2-GPU part).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/decode_channel.h"
#include "client/workers/ipc_buffer.h"
#include "cuda_cpu_daemons.h"
#include "daemon_process.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/cuda_nccl.h"
#include "kvcd/kernels/cuda_runtime_api.h"
#include "nccl_rank.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace cuda_device_test {

using testing_util::CudaDeviceCount;
using testing_util::DecodeThroughBuffer;
using testing_util::ExpectCloseToCpu;
using testing_util::PutBytes;
using testing_util::PutFromBuffer;
using testing_util::ToDevice;
using workers::IpcBuffer;

constexpr int kDevice = 1;
constexpr int64_t kPrompt = 512;
// Two pages past the prompt: pages leave the recent window (128 tokens, pages of 64) and
// are demoted to INT2.
constexpr int kSteps = 140;
// cuda_cpu_decode_test.cc's int2-oscar bound (INT2 history beside BF16 windows).
constexpr double kBound = 3e-3;

// The INT2 history beside BF16 windows of the data-plane tests' geometry.
std::string Model() {
  return "models:\n" + testing_util::SmallModel("device-one", testing_util::kSmallInt2);
}

// Lines of `text` holding `needle`.
int Lines(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// The bytes of every page of a sequence, back to back (the run PushPages takes).
std::string PageRun(Client* c, uint64_t seq) {
  v1::FetchPagesRequest f;
  f.set_sequence_id(seq);
  auto r = c->FetchPages(f);
  EXPECT_TRUE(r.ok()) << r.status();
  std::string all;
  if (r.ok())
    for (const auto& p : r->pages()) all += p.data();
  return all;
}

// The binding itself, in this process (which picks devices with cudaSetDevice elsewhere):
// after kernels' SetDevice(1) a thread that never chose a device reports device 1 current
// and allocates there; once another thread calls SetDevice(0), a thread bound to 1 follows
// at its next call.
TEST(CudaDeviceOneBinding, EveryThreadBindsTheProcessDevice) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices";
  namespace kc = kernels::cuda;
  auto on_new_thread = [](int* current, int* holder) {
    std::thread t([current, holder] {
      void* p = nullptr;
      if (!kc::GetDevice(current).ok() || !kc::Malloc(&p, 4096).ok()) return;
      (void)kc::PointerDevice(p, holder);
      (void)kc::Free(p);
    });
    t.join();
  };
  ASSERT_EQ(kc::SetDevice(kDevice).message(), "");
  int current = -1, holder = -1;
  on_new_thread(&current, &holder);
  EXPECT_EQ(current, kDevice);
  EXPECT_EQ(holder, kDevice);
  std::thread([] { EXPECT_EQ(kc::SetDevice(0).message(), ""); }).join();
  ASSERT_EQ(kc::GetDevice(&current).message(), "");
  EXPECT_EQ(current, 0);
  on_new_thread(&current, &holder);
  EXPECT_EQ(current, 0);
  EXPECT_EQ(holder, 0);
}

class CudaDeviceOneTest : public testing_util::CudaCpuDaemonsTest<::testing::Test> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices (cuda_device: 1)";
    // The model is in both configurations: its pools are allocated on the daemon's main
    // thread at start-up and used from the threads that serve the calls.
    ASSERT_TRUE(gpu_.CaptureStderr());
    ASSERT_TRUE(gpu_.Start(testing_util::BackendConfig("cuda") + "cuda_device: 1\n" + Model()));
    ASSERT_TRUE(cpu_.Start(testing_util::BackendConfig("cpu") + Model()));
    cuda_ = testing_util::ConnectTo(gpu_);
    host_ = testing_util::ConnectTo(cpu_);
    ASSERT_TRUE(cuda_ != nullptr && host_ != nullptr);
    auto info = cuda_->GetModel("device-one");
    ASSERT_TRUE(info.ok()) << info.status();
    p_ = info->profile();
  }
  void TearDown() override { cudaSetDevice(0); }

  // Layer `layer` of decode step `step`: q (F32) and the new token's k, v (BF16).
  struct Step {
    std::vector<float> q;
    std::vector<uint16_t> k, v;
    int32_t token = 0;
  };
  Step MakeStep(int step, int layer) const {
    const int64_t pos = kPrompt + step;
    Step s;
    s.q = synthetic::Row(9, p_, layer, pos, 2);
    const auto kf = synthetic::Row(9, p_, layer, pos, 0);
    const auto vf = synthetic::Row(9, p_, layer, pos, 1);
    for (float f : kf) s.k.push_back(kernels::FloatToBf16(f));
    for (float f : vf) s.v.push_back(kernels::FloatToBf16(f));
    s.token = synthetic::Token(9, pos);
    return s;
  }
  v1::AttentionDecodeRequest Inline(const Step& s, int layer, uint64_t seq) const {
    const int hq = p_.num_q_heads(), hkv = p_.num_kv_heads(), d = p_.head_dim();
    v1::AttentionDecodeRequest in;
    in.set_layer(layer);
    in.add_sequence_ids(seq);
    SetF32Tensor(in.mutable_q(), {1, hq, d}, s.q.data());
    SetBf16Tensor(in.mutable_k_new(), {1, hkv, d}, s.k.data());
    SetBf16Tensor(in.mutable_v_new(), {1, hkv, d}, s.v.data());
    in.add_new_tokens(s.token);
    return in;
  }
};

// Pools on device 1; pages stored, fetched and pushed as the CPU backend stores them; the
// decode loop over gRPC, a decode channel and CUDA IPC close to the CPU backend.
TEST_F(CudaDeviceOneTest, EveryPathRunsOnTheConfiguredDevice) {
  // The same model registered over gRPC (its pools allocated by a thread serving the call).
  v1::ModelProfile rpc = p_;
  rpc.set_name("device-one-rpc");
  rpc.set_memory_bytes(16 << 20);
  auto registered = cuda_->RegisterModel(rpc, "");
  ASSERT_TRUE(registered.ok()) << registered.status();
  ASSERT_EQ(registered->pools_size(), 2);
  // Every pool (each model's BF16 window and INT2 history) where the daemon found it: on
  // device 1 (a pool on another device is refused with INTERNAL, naming both).
  const std::string log = gpu_.Stderr();
  EXPECT_EQ(Lines(log, "bytes on CUDA device 1"), 4) << log;
  EXPECT_EQ(Lines(log, "bytes on CUDA device 0"), 0) << log;

  // The worker (this process) on the daemon's GPU, as a colocated worker is.
  ASSERT_EQ(cudaSetDevice(kDevice), cudaSuccess);
  const auto put = MakePut(3, kPrompt, "");
  ASSERT_TRUE(host_->Put(put).ok());
  auto on_cuda = cuda_->Put(put);
  ASSERT_TRUE(on_cuda.ok()) << on_cuda.status();
  EXPECT_EQ(on_cuda->inserted_tokens(), kPrompt);
  const uint64_t cpu_seq = Open(host_.get(), put, "");
  const uint64_t cu_seq = Open(cuda_.get(), put, "");
  const uint64_t ch_seq = Open(cuda_.get(), put, "");
  const std::string prefix = Stored(host_.get(), cpu_seq);
  ASSERT_FALSE(prefix.empty());
  EXPECT_EQ(Stored(cuda_.get(), cu_seq), prefix);

  // The same Put from a worker buffer on device 1 (CUDA IPC, tenant "ipc").
  auto buf = IpcBuffer::Create(cuda_.get(), PutBytes(put) + (1 << 20), "device-one");
  ASSERT_TRUE(buf.ok()) << buf.status();
  IpcBuffer& b = **buf;
  int holder = -1;
  ASSERT_EQ(kernels::cuda::PointerDevice(b.data(), &holder).message(), "");
  ASSERT_EQ(holder, kDevice);
  const v1::PutRequest ipc_put = PutFromBuffer(b, put, "ipc");
  ASSERT_TRUE(b.MarkReady(nullptr).ok());
  auto ipc_r = cuda_->Put(ipc_put);
  ASSERT_TRUE(ipc_r.ok()) << ipc_r.status();
  EXPECT_EQ(ipc_r->inserted_tokens(), kPrompt);
  const uint64_t ipc_seq = Open(cuda_.get(), put, "ipc");
  EXPECT_EQ(Stored(cuda_.get(), ipc_seq), prefix);

  // The prompt's pages pushed from the worker buffer into tenant "pushed": stored as sent.
  const std::string run = PageRun(cuda_.get(), cu_seq);
  ASSERT_FALSE(run.empty());
  ToDevice(b.data(), run.data(), run.size());
  v1::PushPagesRequest push;
  push.set_model(p_.name());
  push.set_cache_salt("pushed");
  *push.mutable_tokens() = put.tokens();
  push.set_num_pages(kPrompt / p_.page_size());
  b.Region(push.mutable_pages(), v1::DTYPE_U8, {static_cast<int64_t>(run.size())}, 0);
  ASSERT_TRUE(b.MarkReady(nullptr).ok());
  auto pushed = cuda_->PushPages(push);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(Stored(cuda_.get(), Open(cuda_.get(), put, "pushed")), prefix);

  // The decode loop: gRPC on cu_seq (and the CPU daemon's cpu_seq), the decode channel's
  // thread on ch_seq, CUDA IPC on ipc_seq.
  auto ch = DecodeChannel::Open(cuda_.get());
  ASSERT_TRUE(ch.ok()) << ch.status();
  const int hq = p_.num_q_heads(), hkv = p_.num_kv_heads(), d = p_.head_dim();
  double worst_o = 0, worst_lse = 0;
  for (int step = 0; step < kSteps; ++step) {
    for (int layer = 0; layer < p_.num_layers(); ++layer) {
      const std::string where = "step " + std::to_string(step) + " layer " + std::to_string(layer);
      const Step s = MakeStep(step, layer);
      auto r_cpu = host_->AttentionDecode(Inline(s, layer, cpu_seq));
      ASSERT_TRUE(r_cpu.ok()) << r_cpu.status();
      auto r_cu = cuda_->AttentionDecode(Inline(s, layer, cu_seq));
      ASSERT_TRUE(r_cu.ok()) << where << ": " << r_cu.status();
      ASSERT_EQ(r_cu->lengths(0), r_cpu->lengths(0));
      ASSERT_NO_FATAL_FAILURE(
          ExpectCloseToCpu(*r_cu, *r_cpu, hq, d, kBound, where, &worst_o, &worst_lse));

      auto r_ch = (*ch)->Call(Inline(s, layer, ch_seq));
      ASSERT_TRUE(r_ch.ok()) << where << ": " << r_ch.status();
      for (int i = 0; i < hq * d; ++i)
        ASSERT_FLOAT_EQ(ElementAsFloat(r_ch->o(), i), ElementAsFloat(r_cu->o(), i)) << where;
      for (int i = 0; i < hq; ++i)
        ASSERT_FLOAT_EQ(ElementAsFloat(r_ch->lse(), i), ElementAsFloat(r_cu->lse(), i)) << where;

      v1::AttentionDecodeRequest ipc;
      ipc.set_layer(layer);
      ipc.add_sequence_ids(ipc_seq);
      ipc.add_new_tokens(s.token);
      std::vector<float> o, lse;
      ASSERT_NO_FATAL_FAILURE(
          DecodeThroughBuffer(cuda_.get(), b, ipc, 1, hq, hkv, d, s.q, s.k, s.v, {}, 0, &o, &lse));
      for (int i = 0; i < hq * d; ++i)
        ASSERT_FLOAT_EQ(o[i], ElementAsFloat(r_cu->o(), i)) << where << " i " << i;
      for (int i = 0; i < hq; ++i) ASSERT_FLOAT_EQ(lse[i], ElementAsFloat(r_cu->lse(), i)) << where;
    }
  }
  std::printf(
      "cuda_device 1: CUDA vs CPU backend over %d steps x %d layers: max o error %.3g (of the "
      "row's max |o|, >= 1), max lse error %.3g\n",
      kSteps, p_.num_layers(), worst_o, worst_lse);
  auto info = cuda_->GetModel(p_.name());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_GE(info->demoted_pages(), 1u);
  const std::string after = Stored(host_.get(), cpu_seq);
  EXPECT_EQ(Stored(cuda_.get(), cu_seq), after);
  EXPECT_EQ(Stored(cuda_.get(), ch_seq), after);
  EXPECT_EQ(Stored(cuda_.get(), ipc_seq), after);
  EXPECT_EQ(*cuda_->Health(), grpc::health::v1::HealthCheckResponse::SERVING);
}

// NCCL between the daemon (rank 0: its communicator is created on an NCCL link's thread) on
// device 1 and this process (rank 1) on device 0: pages pushed and fetched back byte for byte.
TEST_F(CudaDeviceOneTest, NcclLinkRunsOnTheConfiguredDevice) {
  if (!kernels::cuda::NcclLoad().ok()) GTEST_SKIP() << kernels::cuda::NcclLoad().message();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const auto put = MakePut(11, kPrompt, "");
  ASSERT_TRUE(cuda_->Put(put).ok());
  const std::string stored = PageRun(cuda_.get(), Open(cuda_.get(), put, ""));
  const auto total = static_cast<int64_t>(stored.size());
  ASSERT_GT(total, 0);
  auto conn = cuda_->NcclConnect("device-one", 8000);
  ASSERT_TRUE(conn.ok()) << conn.status();
  void* comm = nullptr;
  void* stream = nullptr;
  ASSERT_EQ(kernels::cuda::CreateStream(&stream).message(), "");
  uint8_t* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, 2 * total), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, stored.data(), total, cudaMemcpyHostToDevice), cudaSuccess);
  const std::string init = kernels::cuda::NcclInit(conn->unique_id(), 2, 1, 8000, &comm).message();
  const v1::PushPagesRequest push = testing_util::NcclPush(
      p_.name(), "nccl", put, kPrompt / p_.page_size(), conn->communicator_id(), total);
  absl::StatusOr<int64_t> pushed = absl::UnknownError("not run");
  const std::string sent = testing_util::NcclBeside([&] { pushed = cuda_->PushPages(push); }, true,
                                                    comm, dev, total, stream, init);
  ASSERT_EQ(init, "");
  ASSERT_EQ(sent, "");
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  const uint64_t seq = Open(cuda_.get(), put, "nccl");
  EXPECT_EQ(PageRun(cuda_.get(), seq), stored);
  const v1::FetchPagesRequest f = testing_util::NcclFetch(seq, conn->communicator_id(), total);
  absl::StatusOr<v1::FetchPagesResponse> fetched = absl::UnknownError("not run");
  const std::string got = testing_util::NcclBeside([&] { fetched = cuda_->FetchPages(f); }, false,
                                                   comm, dev + total, total, stream);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  ASSERT_EQ(got, "");
  std::string back(static_cast<size_t>(total), '\0');
  ASSERT_EQ(cudaMemcpy(back.data(), dev + total, total, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, stored);
  if (comm != nullptr) (void)kernels::cuda::NcclDestroy(comm);
  (void)kernels::cuda::DestroyStream(stream);
  EXPECT_TRUE(cuda_->NcclDisconnect(conn->communicator_id()).ok());
  cudaFree(dev);
  EXPECT_EQ(*cuda_->Health(), grpc::health::v1::HealthCheckResponse::SERVING);
}

}  // namespace cuda_device_test
}  // namespace kvcd
