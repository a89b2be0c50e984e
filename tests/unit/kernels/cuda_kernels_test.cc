// CUDA kernels against the CPU references, on the device (skipped without a GPU): demotion
// bit for bit, INT2 and BF16 decode attention with the merge and rotations, on fresh
// random inputs with NaN-poisoned outputs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kvcd/kernels/attention_state.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_demote.h"
#include "kvcd/kernels/cuda_device.h"
#include "kvcd/kernels/cuda_device_copy.h"
#include "kvcd/kernels/cuda_page_copy.h"
#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/int2_attention.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd::kernels {
namespace {

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
  template <class T>
  T* Up(const std::vector<T>& v) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(1, v.size() * sizeof(T))), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    owned_.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  std::vector<T> Down(const T* p, size_t n) {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  void TearDown() override {
    for (void* p : owned_) cudaFree(p);
  }
  std::vector<void*> owned_;
  std::mt19937 rng_{std::random_device{}()};
};

TEST_F(CudaKernelsTest, DemoteIsBitIdenticalToTheCpu) {
  std::normal_distribution<float> normal(0.0f, 1.5f);
  for (int d : {64, 128, 256}) {
    const int n = 37;
    std::vector<uint16_t> rows(n * d);
    std::vector<float> rows_f(n * d);
    for (int i = 0; i < n * d; ++i) {
      // Odd rows take few distinct values (ties at the clip threshold); an outlier channel.
      const float x = (i / d) % 2 == 1 ? std::round(normal(rng_)) : normal(rng_);
      rows[i] = FloatToBf16(x + (i % d == 5 ? 12.0f : 0.0f));
      rows_f[i] = Bf16ToFloat(rows[i]);
    }
    std::vector<float> r(d * d);
    for (auto& x : r) x = normal(rng_) / std::sqrt(static_cast<float>(d));
    // rho 0.5 takes the radix select; the others the repeated warp maxima (d - 1 - floor(rho
    // d) <= 16 elements above the threshold), except at d = 256 and rho 0.92.
    for (const float* rot :
         {static_cast<const float*>(r.data()), static_cast<const float*>(nullptr)}) {
      for (float rho : {0.96f, 0.92f, 1.0f, 0.5f}) {
        std::vector<uint8_t> cpu_codes(n * d / 4, 0xAA);
        std::vector<uint16_t> cpu_params(2 * n, 0xFFFF);
        DemoteRowsToInt2(rows_f.data(), n, d, rot, rho,
                         Int2RowRef::RowMajor(cpu_codes.data(), d / 4, cpu_params.data(),
                                              cpu_params.data() + 1, 2));
        uint8_t* codes = Up(std::vector<uint8_t>(n * d / 4, 0xAA));
        uint16_t* params = Up(std::vector<uint16_t>(2 * n, 0xFFFF));
        ASSERT_EQ(cuda::LaunchDemoteInt2(Up(rows), n, d, rot != nullptr ? Up(r) : nullptr, rho,
                                         Int2RowRef::RowMajor(codes, d / 4, params, params + 1, 2),
                                         0, nullptr),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::string where = "d=" + std::to_string(d) + " rho=" + std::to_string(rho) +
                                  (rot != nullptr ? " rotated" : " unrotated");
        EXPECT_EQ(Down(codes, cpu_codes.size()), cpu_codes) << where;
        EXPECT_EQ(Down(params, cpu_params.size()), cpu_params) << where;
      }
    }
  }
}

// One sequence per batch entry with an INT2 page list and a BF16 page list (as the daemon
// splits a sequence): GPU rotate + parts + merge against the CPU kernels.
TEST_F(CudaKernelsTest, MixedInt2AndBf16AttentionMatchesTheCpu) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int hq = 16, hkv = 4, d = 128, ps = 64, g = hq / hkv;
  const std::vector<int> int2_len = {0, 640, 4096 + 64, 64};
  const std::vector<int> bf16_len = {5, 64 + 17, 0, 200};
  const int batch = static_cast<int>(int2_len.size());
  const int max_pages = 70;
  // Pools with shuffled page ids.
  const int64_t int2_bytes = Int2PageBytes(hkv, ps, d);
  const int64_t bf16_elems = Bf16PageElems(hkv, ps, d);
  std::vector<uint8_t> int2_pool(batch * max_pages * int2_bytes);
  std::vector<uint16_t> bf16_pool(batch * max_pages * bf16_elems);
  for (auto& b : int2_pool) b = static_cast<uint8_t>(rng_());
  for (auto& b : bf16_pool) b = FloatToBf16(normal(rng_));
  std::vector<int32_t> ids(batch * max_pages);
  for (int i = 0; i < batch * max_pages; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng_);
  const Int2PageLayout layout{hkv, ps, d};
  std::vector<float> row(d);
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < int2_len[b]; ++t) {
      uint8_t* page = int2_pool.data() + ids[b * max_pages + t / ps] * int2_bytes;
      for (int h = 0; h < hkv; ++h)
        for (int which = 0; which < 2; ++which) {
          for (auto& x : row) x = normal(rng_);
          DemoteRowsToInt2(row.data(), 1, d, nullptr, 0.96f,
                           which == 0 ? layout.K(page, h) : layout.V(page, h), t % ps);
        }
    }
  }
  std::vector<float> q(batch * hq * d), rk(d * d), rvt(d * d);
  for (auto& x : q) x = normal(rng_);
  for (auto& x : rk) x = normal(rng_) / std::sqrt(static_cast<float>(d));
  for (auto& x : rvt) x = normal(rng_) / std::sqrt(static_cast<float>(d));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // GPU.
  const int rows = batch * hq;
  const cuda::DecodeGeometry geo{batch, hq, hkv, d, ps};
  const int max_int2 = *std::max_element(int2_len.begin(), int2_len.end());
  const int max_bf16 = *std::max_element(bf16_len.begin(), bf16_len.end());
  const int s_int2 = cuda::Int2DecodeSplits(batch, hkv, max_int2, 132);
  const int s_bf16 = cuda::Int2DecodeSplits(batch, hkv, max_bf16, 132);
  float* part_o = Up(std::vector<float>((s_int2 + s_bf16) * rows * d, NAN));
  float* part_lse = Up(std::vector<float>((s_int2 + s_bf16) * rows, NAN));
  float* o = Up(std::vector<float>(rows * d, NAN));
  float* lse = Up(std::vector<float>(rows, NAN));
  const float* d_q = Up(q);
  const float* d_rk = Up(rk);
  const cuda::PagedList int2_list{Up(int2_pool), int2_bytes, Up(ids), max_pages,
                                  Up(std::vector<int32_t>(int2_len.begin(), int2_len.end()))};
  const cuda::PagedList bf16_list{reinterpret_cast<const uint8_t*>(Up(bf16_pool)), bf16_elems * 2,
                                  Up(ids), max_pages,
                                  Up(std::vector<int32_t>(bf16_len.begin(), bf16_len.end()))};
  const float* d_rvt = Up(rvt);
  void* state = nullptr;
  ASSERT_EQ(cudaMalloc(&state, cuda::Int2StateBytes(batch, hkv)), cudaSuccess);
  // The daemon's order: BF16 windows first, then the INT2 launch, which also launches the
  // merge of every part (as its programmatic dependent); with and without L2 prefetch, and
  // with the merge launched on its own.
  struct Way {
    bool merge_in_launch;
    int prefetch;
  };
  std::vector<std::vector<float>> got_o_ways, got_lse_ways;
  for (const Way way : {Way{true, -1}, Way{true, 0}, Way{false, 5}}) {
    ASSERT_EQ(cudaMemcpy(part_lse, std::vector<float>((s_int2 + s_bf16) * rows, NAN).data(),
                         sizeof(float) * (s_int2 + s_bf16) * rows, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(o, std::vector<float>(rows * d, NAN).data(), sizeof(float) * rows * d,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cuda::LaunchBf16DecodeParts(bf16_list, geo, d_q, d_rk, scale, s_bf16, max_bf16,
                                          part_o, part_lse, 0, nullptr),
              cudaSuccess);
    const cuda::MergeTarget merge{s_int2 + s_bf16, d_rvt, o, lse};
    cuda::Int2PartsOptions opt;
    opt.state = state;
    opt.merge = way.merge_in_launch ? &merge : nullptr;
    opt.prefetch_tiles = way.prefetch;
    ASSERT_EQ(cuda::LaunchInt2DecodeParts(int2_list, geo, d_q, d_rk, scale, s_int2, max_int2,
                                          part_o, part_lse, s_bf16, nullptr, opt),
              cudaSuccess);
    if (!way.merge_in_launch) {
      ASSERT_EQ(cuda::LaunchMergeParts(part_o, part_lse, s_int2 + s_bf16, rows, d, d_rvt, o, lse,
                                       nullptr),
                cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    got_o_ways.push_back(Down(o, rows * d));
    got_lse_ways.push_back(Down(lse, rows));
  }
  // Prefetching and how the merge is launched change nothing: bit-identical results.
  for (size_t w = 1; w < got_o_ways.size(); ++w) {
    EXPECT_EQ(got_o_ways[w], got_o_ways[0]) << "way " << w;
    EXPECT_EQ(got_lse_ways[w], got_lse_ways[0]) << "way " << w;
  }
  const auto& got_o = got_o_ways[0];
  const auto& got_lse = got_lse_ways[0];
  // CPU: the same stages with the CPU kernels.
  for (int b = 0; b < batch; ++b) {
    std::vector<float> qr(hq * d), acc_o(hq * d), acc_l(hq), po(g * d), pl(g), want(hq * d);
    RotateRows(q.data() + b * hq * d, hq, d, rk.data(), qr.data());
    ResetStates(hq, d, acc_o.data(), acc_l.data());
    Int2PageTable it{
        int2_pool.data(), int2_bytes, ids.data() + b * max_pages, max_pages, ps, hkv, d};
    Bf16PageTable bt{
        bf16_pool.data(), bf16_elems, ids.data() + b * max_pages, max_pages, ps, hkv, d};
    for (int h = 0; h < hkv; ++h) {
      AttendInt2PagesReference(it, h, qr.data() + h * g * d, g, scale, 0, int2_len[b], po.data(),
                               pl.data());
      MergeStates(g, d, acc_o.data() + h * g * d, acc_l.data() + h * g, po.data(), pl.data());
      AttendBf16Pages(bt, h, qr.data() + h * g * d, g, scale, 0, bf16_len[b], po.data(), pl.data());
      MergeStates(g, d, acc_o.data() + h * g * d, acc_l.data() + h * g, po.data(), pl.data());
    }
    RotateRows(acc_o.data(), hq, d, rvt.data(), want.data());
    for (int h = 0; h < hq; ++h) {
      double err = 0, norm = 0;
      for (int c = 0; c < d; ++c) {
        const double a = got_o[(b * hq + h) * d + c], w = want[h * d + c];
        ASSERT_FALSE(std::isnan(a));
        err += (a - w) * (a - w);
        norm += w * w;
      }
      // Two-digit int8 query/weights in the INT2 part: ~2e-4 measured; FP32 otherwise.
      EXPECT_LE(std::sqrt(err), 2e-3 * std::sqrt(norm) + 1e-6) << "b=" << b << " h=" << h;
      EXPECT_NEAR(got_lse[b * hq + h], acc_l[h], 2e-3 * (1 + std::fabs(acc_l[h])));
    }
  }
}

// Scalar reference of the copy checks (the daemon's host path applies the same rules).
uint64_t CountBad(const std::vector<uint8_t>& bytes, size_t begin, size_t n, uint32_t check,
                  uint32_t block) {
  uint64_t bad = 0;
  for (size_t i = 0; i + 1 < n; i += 2) {
    const uint16_t h = static_cast<uint16_t>(bytes[begin + i] | (bytes[begin + i + 1] << 8));
    if (check == cuda::kCheckBf16Finite) {
      bad += (h & 0x7f80u) == 0x7f80u;
    } else if (check == cuda::kCheckF32Finite) {
      bad += ((i / 2) & 1) != 0 && (h & 0x7f80u) == 0x7f80u;  // the F32's high half
    } else if (check == cuda::kCheckFp16ScaleMin) {
      const bool scale = ((i / 2) / block) % 2 == 0;
      bad += (h & 0x7c00u) == 0x7c00u || (scale && (h & 0x8000u) && (h & 0x7fffu));
    }
  }
  return bad;
}

// The paged row stores against the host path (RotateRows + FloatToBf16N into the BF16
// page layout; DemoteRowsToInt2 into the INT2 page layout): every layer of 37 tokens of a
// [layers][tokens][heads][d] source, scattered over the slots of poisoned pages.
TEST_F(CudaKernelsTest, PagedRowStoresAreBitIdenticalToTheHostPath) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int layers = 2, hkv = 3, ps = 16, tokens = 37, pool_pages = 7;
  for (int d : {64, 128, 256}) {
    for (int src_bf16 = 0; src_bf16 < 2; ++src_bf16) {
      for (int rotate = 0; rotate < 2; ++rotate) {
        const int64_t row_elems = int64_t{layers} * tokens * hkv * d;
        // K rows then V rows; odd rows take few distinct values (ties at the clip threshold).
        std::vector<float> x(2 * row_elems);
        std::vector<uint16_t> xb(2 * row_elems);
        for (int64_t i = 0; i < 2 * row_elems; ++i) {
          const float f = normal(rng_);
          x[i] = (i / d) % 2 == 1 ? std::round(f) : f;
          xb[i] = FloatToBf16(x[i]);
          if (src_bf16) x[i] = Bf16ToFloat(xb[i]);
        }
        std::vector<float> rot(static_cast<size_t>(layers) * 2 * d * d);
        for (auto& r : rot) r = normal(rng_) / std::sqrt(static_cast<float>(d));
        std::vector<float> rho = {0.96f, 0.9f, 0.92f, 1.0f};  // k: layers 0, 1; v: layers 0, 1
        // Token t goes to slot (5 t) mod (pages * page_size): scattered, distinct.
        std::vector<int64_t> slots(tokens);
        for (int t = 0; t < tokens; ++t) slots[t] = (t * 5) % (pool_pages * ps);
        const void* d_src = src_bf16 ? static_cast<const void*>(Up(xb)) : Up(x);
        cuda::RowBlock k, v;
        k.data = d_src;
        k.bf16 = v.bf16 = src_bf16;
        k.layer_stride = v.layer_stride = int64_t{tokens} * hkv * d;
        k.token_stride = v.token_stride = int64_t{hkv} * d;
        k.head_stride = v.head_stride = d;
        v.data = static_cast<const uint8_t*>(d_src) + row_elems * (src_bf16 ? 2 : 4);
        cuda::RowCodec codec;
        const float* d_rot = Up(rot);
        if (rotate) {
          codec.r_k = d_rot;
          codec.r_v = d_rot + int64_t{layers} * d * d;
          codec.r_layer_stride = int64_t{d} * d;
        }
        codec.rho_k = Up(rho);
        codec.rho_v = codec.rho_k + 2;
        auto host_row = [&](int which, int l, int t, int h, float* out) {
          const float* src =
              x.data() + which * row_elems + ((int64_t{l} * tokens + t) * hkv + h) * d;
          std::copy(src, src + d, out);
        };
        for (int fmt = 0; fmt < 2; ++fmt) {
          const int64_t page_bytes =
              fmt == 0 ? Bf16PageElems(hkv, ps, d) * 2 : Int2PageBytes(hkv, ps, d);
          std::vector<uint8_t> poison(static_cast<size_t>(layers * pool_pages * page_bytes), 0xA5);
          uint8_t* d_pool = Up(poison);
          cuda::PagedRows dst;
          dst.num_layers = layers;
          dst.num_tokens = tokens;
          dst.num_kv_heads = hkv;
          dst.head_dim = d;
          dst.page_size = ps;
          dst.base = d_pool;
          dst.layer_stride = pool_pages * page_bytes;
          dst.page_bytes = page_bytes;
          dst.slots = Up(slots);
          ASSERT_EQ(fmt == 0 ? cuda::LaunchStoreBf16Rows(k, v, dst, codec, nullptr)
                             : cuda::LaunchStoreInt2Rows(k, v, dst, codec, nullptr),
                    cudaSuccess);
          const auto got = Down(d_pool, poison.size());
          // The host path into a host copy of the same pool.
          std::vector<uint8_t> want = poison;
          std::vector<float> row(d), rotated(d), page_rows(static_cast<size_t>(ps) * d);
          for (int l = 0; l < layers; ++l) {
            for (int t = 0; t < tokens; ++t) {
              const int64_t page = slots[t] / ps, slot = slots[t] % ps;
              uint8_t* base = want.data() + (l * pool_pages + page) * page_bytes;
              for (int which = 0; which < 2; ++which) {
                for (int h = 0; h < hkv; ++h) {
                  host_row(which, l, t, h, row.data());
                  const float* r = rot.data() + (int64_t{which} * layers + l) * d * d;
                  if (fmt == 0) {
                    const float* in = row.data();
                    if (rotate) {
                      RotateRows(row.data(), 1, d, r, rotated.data());
                      in = rotated.data();
                    }
                    FloatToBf16N(in,
                                 reinterpret_cast<uint16_t*>(base) +
                                     ((int64_t{which} * hkv + h) * ps + slot) * d,
                                 d);
                  } else {
                    const Int2PageLayout layout{hkv, ps, d};
                    DemoteRowsToInt2(row.data(), 1, d, rotate ? r : nullptr, rho[which * 2 + l],
                                     which == 0 ? layout.K(base, h) : layout.V(base, h), slot);
                  }
                }
              }
            }
          }
          ASSERT_TRUE(got == want)
              << "format " << fmt << " d " << d << " bf16 " << src_bf16 << " rotate " << rotate;
        }
      }
    }
  }
}

// Paged copies against a host reference: scatter a run into scattered pool pages of every
// layer, gather them back, and count FP16 parameter failures in a sub-range of each page,
// on the vector path and the byte path (odd layer sizes).
TEST_F(CudaKernelsTest, PagedCopyScattersGathersAndChecksLikeTheReference) {
  std::uniform_int_distribution<int> byte(0, 255);
  for (int64_t layer_bytes : {int64_t{4096}, int64_t{1030}}) {
    const int layers = 3, pool_pages = 9;
    const std::vector<int32_t> ids = {7, 0, 4, 2};
    const int64_t pages = static_cast<int64_t>(ids.size());
    std::vector<uint8_t> run(static_cast<size_t>(pages * layers * layer_bytes));
    for (auto& b : run) b = static_cast<uint8_t>(byte(rng_));
    std::vector<uint8_t> pool(static_cast<size_t>(pool_pages * layers * layer_bytes), 0x5a);
    uint8_t* d_pool = Up(pool);
    uint8_t* d_run = Up(run);
    cuda::PagedCopyArgs a;
    a.pool = d_pool;
    a.pool_layer_stride = pool_pages * layer_bytes;
    a.layer_bytes = layer_bytes;
    a.num_layers = layers;
    a.page_ids = Up(ids);
    a.num_pages = pages;
    a.run = d_run;
    a.check = cuda::kCheckFp16ScaleMin;
    a.check_block = 16;
    a.check_offset = 512;
    a.check_bytes = 256;
    unsigned long long* d_bad = Up(std::vector<unsigned long long>{0});
    ASSERT_EQ(cuda::LaunchPagedCopy(cuda::PageCopy::kScatter, a, d_bad, nullptr), cudaSuccess);
    std::vector<uint8_t> want = pool;
    unsigned long long want_bad = 0;
    for (int64_t p = 0; p < pages; ++p) {
      for (int l = 0; l < layers; ++l) {
        const uint8_t* src = run.data() + (p * layers + l) * layer_bytes;
        std::copy(src, src + layer_bytes,
                  want.begin() + l * pool_pages * layer_bytes + ids[p] * layer_bytes);
        want_bad +=
            CountBad(run, static_cast<size_t>((p * layers + l) * layer_bytes + a.check_offset),
                     static_cast<size_t>(a.check_bytes), a.check, a.check_block);
      }
    }
    EXPECT_TRUE(Down(d_pool, pool.size()) == want) << "layer_bytes " << layer_bytes;
    EXPECT_EQ(Down(d_bad, 1)[0], want_bad);
    EXPECT_GT(want_bad, 0u);  // random bytes: the check is exercised
    // Check only: the same count, nothing written.
    ASSERT_EQ(cudaMemset(d_bad, 0, sizeof(unsigned long long)), cudaSuccess);
    ASSERT_EQ(cuda::LaunchPagedCopy(cuda::PageCopy::kCheck, a, d_bad, nullptr), cudaSuccess);
    EXPECT_EQ(Down(d_bad, 1)[0], want_bad);
    // The BF16 check over whole layer pages: random bytes hold Inf/NaN patterns.
    const uint64_t want_bf16 = CountBad(run, 0, run.size(), cuda::kCheckBf16Finite, 0);
    a.check = cuda::kCheckBf16Finite;
    a.check_offset = 0;
    a.check_bytes = layer_bytes;
    ASSERT_EQ(cudaMemset(d_bad, 0, sizeof(unsigned long long)), cudaSuccess);
    ASSERT_EQ(cuda::LaunchPagedCopy(cuda::PageCopy::kCheck, a, d_bad, nullptr), cudaSuccess);
    EXPECT_EQ(Down(d_bad, 1)[0], want_bf16);
    EXPECT_GT(want_bf16, 0u);
    // The F32 check (the daemon's check of device K/V and queries, CountNonFinite): the
    // high half of every 32-bit word, counted from the start of each layer page.
    uint64_t want_f32 = 0;
    for (int64_t item = 0; item < pages * layers; ++item) {
      want_f32 += CountBad(run, static_cast<size_t>(item * layer_bytes),
                           static_cast<size_t>(layer_bytes), cuda::kCheckF32Finite, 0);
    }
    a.check = cuda::kCheckF32Finite;
    ASSERT_EQ(cudaMemset(d_bad, 0, sizeof(unsigned long long)), cudaSuccess);
    ASSERT_EQ(cuda::LaunchPagedCopy(cuda::PageCopy::kCheck, a, d_bad, nullptr), cudaSuccess);
    EXPECT_EQ(Down(d_bad, 1)[0], want_f32);
    EXPECT_GT(want_f32, 0u);
    EXPECT_LT(want_f32, want_bf16);
    // Gather into a poisoned run: the original run comes back.
    ASSERT_EQ(cudaMemset(d_run, 0xee, run.size()), cudaSuccess);
    a.check = cuda::kCheckNone;
    ASSERT_EQ(cuda::LaunchPagedCopy(cuda::PageCopy::kGather, a, nullptr, nullptr), cudaSuccess);
    EXPECT_TRUE(Down(d_run, run.size()) == run) << "layer_bytes " << layer_bytes;
  }
}

TEST_F(CudaKernelsTest, ToFloatMatchesTheCpu) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t n = 4099;
  std::vector<uint16_t> bf(n);
  std::vector<float> f(n);
  for (int64_t i = 0; i < n; ++i) {
    f[i] = normal(rng_);
    bf[i] = FloatToBf16(f[i]);
  }
  std::vector<float> poison(n, NAN);
  float* d_out = Up(poison);
  ASSERT_EQ(cuda::LaunchToFloat(Up(bf), true, n, d_out, nullptr), cudaSuccess);
  auto out = Down(d_out, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], Bf16ToFloat(bf[i])) << i;
  ASSERT_EQ(cuda::LaunchToFloat(Up(f), false, n, d_out, nullptr), cudaSuccess);
  out = Down(d_out, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], f[i]) << i;
}

}  // namespace
}  // namespace kvcd::kernels
