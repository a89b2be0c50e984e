// CUDA kernels against the CPU references, on the device (skipped without a GPU): demotion
// bit for bit, INT2 and BF16 decode attention with the merge and rotations, on fresh
// random inputs with NaN-poisoned outputs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_fixture.h"
#include "kvcd/kernels/attention_state.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cuda_bf16_split_attention.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_demote.h"
#include "kvcd/kernels/cuda_device.h"
#include "kvcd/kernels/cuda_device_copy.h"
#include "kvcd/kernels/cuda_page_copy.h"
#include "kvcd/kernels/cuda_store_rows.h"
#include "kvcd/kernels/cuda_stream_memops.h"
#include "kvcd/kernels/device_fault.h"
#include "kvcd/kernels/fp16.h"
#include "kvcd/kernels/int2_attention.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd::kernels {
namespace cuda_kernels_test {

class CudaKernelsTest : public CudaTestFixture {
 protected:
  // Random split-K parts of `rows` rows (o N(0, 1), lse N(0, 16)) and an R_v^T of d x d, as
  // the merge tests feed them to the merge kernel.
  struct MergeInputs {
    std::vector<float> part_o, part_lse, r_v_t;
  };
  MergeInputs RandomMergeInputs(int parts, int rows, int d) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    MergeInputs in{std::vector<float>(parts * rows * d), std::vector<float>(parts * rows),
                   std::vector<float>(d * d)};
    for (auto& x : in.part_o) x = normal(rng_);
    for (auto& x : in.part_lse) x = 4 * normal(rng_);
    for (auto& x : in.r_v_t) x = normal(rng_) / std::sqrt(static_cast<float>(d));
    return in;
  }
};

TEST_F(CudaKernelsTest, DemoteIsBitIdenticalToTheCpu) {
  std::normal_distribution<float> normal(0.0f, 1.5f);
  for (int d : {64, 128, 256}) {
    for (int n : {37, 301}) {
      std::vector<uint16_t> rows(n * d);
      std::vector<float> rows_f(n * d);
      for (int i = 0; i < n * d; ++i) {
        // Odd rows take few distinct values (ties at the clip threshold); an outlier channel.
        const float x = (i / d) % 2 == 1 ? std::round(normal(rng_)) : normal(rng_);
        rows[i] = FloatToBf16(x + (i % d == 5 ? 12.0f : 0.0f));
        rows_f[i] = Bf16ToFloat(rows[i]);
      }
      std::vector<float> dense(d * d), hadamard(d * d);
      for (auto& x : dense) x = normal(rng_) / std::sqrt(static_cast<float>(d));
      const float c = 1.0f / std::sqrt(static_cast<float>(d));
      for (int i = 0; i < d; ++i) {
        for (int j = 0; j < d; ++j) hadamard[i * d + j] = __builtin_popcount(i & j) % 2 ? -c : c;
      }
      ASSERT_EQ(ClassifyRotation(hadamard.data(), d), Rotation::kHadamard);
      ASSERT_EQ(ClassifyRotation(dense.data(), d), Rotation::kDense);
      const float* d_dense = Up(dense);
      const float* d_hadamard = Up(hadamard);
      const uint16_t* d_rows = Up(rows);
      // rho 0.5 takes the radix select; the others the repeated group maxima (d - 1 -
      // floor(rho d) <= 16 elements above the threshold), except at d = 256 and rho 0.92.
      for (Rotation kind : {Rotation::kNone, Rotation::kDense, Rotation::kHadamard}) {
        const float* rot = kind == Rotation::kDense      ? dense.data()
                           : kind == Rotation::kHadamard ? hadamard.data()
                                                         : nullptr;
        const float* d_rot = kind == Rotation::kDense      ? d_dense
                             : kind == Rotation::kHadamard ? d_hadamard
                                                           : nullptr;
        for (float rho : {0.96f, 0.92f, 1.0f, 0.5f}) {
          // Row-major codes (vector stores) and codes two bytes apart (byte stores).
          for (int stride : {1, 2}) {
            const int row_bytes = stride * d / 4;
            std::vector<uint8_t> cpu_codes(n * row_bytes, 0xAA);
            std::vector<uint16_t> cpu_params(2 * n, 0xFFFF);
            Int2RowRef ref = Int2RowRef::RowMajor(cpu_codes.data(), row_bytes, cpu_params.data(),
                                                  cpu_params.data() + 1, 2);
            ref.byte_stride = stride;
            DemoteRowsToInt2(rows_f.data(), n, d, rot, rho, ref);
            for (auto kernel : {cuda::DemoteKernel::kGrouped, cuda::DemoteKernel::kWarpPerRow}) {
              uint8_t* codes = Up(std::vector<uint8_t>(n * row_bytes, 0xAA));
              uint16_t* params = Up(std::vector<uint16_t>(2 * n, 0xFFFF));
              Int2RowRef dev = Int2RowRef::RowMajor(codes, row_bytes, params, params + 1, 2);
              dev.byte_stride = stride;
              ASSERT_EQ(
                  cuda::LaunchDemoteInt2(d_rows, n, d, d_rot, kind, rho, dev, 0, nullptr, kernel)
                      .device_code(),
                  cudaSuccess);
              ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
              const std::string where =
                  "d=" + std::to_string(d) + " n=" + std::to_string(n) +
                  " rho=" + std::to_string(rho) + " rotation " +
                  std::to_string(static_cast<int>(kind)) + " stride " + std::to_string(stride) +
                  (kernel == cuda::DemoteKernel::kGrouped ? " grouped" : " warp");
              EXPECT_EQ(Down(codes, cpu_codes.size()), cpu_codes) << where;
              EXPECT_EQ(Down(params, cpu_params.size()), cpu_params) << where;
            }
          }
        }
      }
    }
  }
}

// Issue #35.2: rows beyond FP16's range saturate on the GPU as on the CPU (N(0,1)·1e6 rows,
// rows near BF16's largest value whose rotation overflows FP32 to Inf and NaN): the same
// codes and parameters, all finite.
TEST_F(CudaKernelsTest, DemoteSaturatesBeyondFp16RangeLikeTheCpu) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int d : {64, 128, 256}) {
    const int n = 12;
    std::vector<uint16_t> rows(n * d);
    std::vector<float> rows_f(n * d);
    for (int i = 0; i < n * d; ++i) {
      const int t = i / d;
      const float x = t % 3 == 0   ? 1e6f * normal(rng_)
                      : t % 3 == 1 ? 3.3e38f
                                   : (i % 2 ? 3.3e38f : -3.3e38f);
      rows[i] = FloatToBf16(x);
      rows_f[i] = Bf16ToFloat(rows[i]);
    }
    std::vector<float> hadamard(d * d);
    const float c = 1.0f / std::sqrt(static_cast<float>(d));
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j) hadamard[i * d + j] = __builtin_popcount(i & j) % 2 ? -c : c;
    }
    const float* d_hadamard = Up(hadamard);
    const uint16_t* d_rows = Up(rows);
    for (Rotation kind : {Rotation::kNone, Rotation::kHadamard}) {
      const float* rot = kind == Rotation::kHadamard ? hadamard.data() : nullptr;
      const float* d_rot = kind == Rotation::kHadamard ? d_hadamard : nullptr;
      const int row_bytes = d / 4;
      std::vector<uint8_t> cpu_codes(n * row_bytes, 0xAA);
      std::vector<uint16_t> cpu_params(2 * n, 0xFFFF);
      DemoteRowsToInt2(rows_f.data(), n, d, rot, 0.96f,
                       Int2RowRef::RowMajor(cpu_codes.data(), row_bytes, cpu_params.data(),
                                            cpu_params.data() + 1, 2));
      for (uint16_t p : cpu_params) ASSERT_TRUE(std::isfinite(HalfToFloat(p))) << d;
      for (auto kernel : {cuda::DemoteKernel::kGrouped, cuda::DemoteKernel::kWarpPerRow}) {
        uint8_t* codes = Up(std::vector<uint8_t>(n * row_bytes, 0xAA));
        uint16_t* params = Up(std::vector<uint16_t>(2 * n, 0xFFFF));
        const Int2RowRef dev = Int2RowRef::RowMajor(codes, row_bytes, params, params + 1, 2);
        ASSERT_EQ(cuda::LaunchDemoteInt2(d_rows, n, d, d_rot, kind, 0.96f, dev, 0, nullptr, kernel)
                      .device_code(),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(Down(codes, cpu_codes.size()), cpu_codes) << d;
        EXPECT_EQ(Down(params, cpu_params.size()), cpu_params) << d;
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
  // The worker's queries as BF16 with one NaN, converted (LaunchQueriesToFloat) or read raw
  // by the launches; each way gets its own fault words.
  std::vector<uint16_t> qb(q.size());
  for (size_t i = 0; i < q.size(); ++i) qb[i] = FloatToBf16(q[i]);
  qb[hq * d + 3] = 0x7fc0;  // NaN in sequence 1
  const uint16_t* d_qb = Up(qb);
  float* d_qc = Up(std::vector<float>(q.size(), NAN));
  // The daemon's order: BF16 windows first, then the INT2 launch, which also launches the
  // merge of every part (as its programmatic dependent); with dependent or plain launches,
  // and with the merge launched on its own; queries as F32 or read raw (F32 or BF16); the BF16
  // pages by the split kernel (the daemon's) or the first one (same split count here).
  enum Queries { kF32, kRawF32, kConvertedBf16, kRawBf16 };
  const auto kWarp = cuda::Bf16Kernel::kWarp;
  const auto kSplit = cuda::Bf16Kernel::kSplit;
  struct Way {
    bool merge_in_launch;
    bool dependent;
    Queries queries = kF32;
    cuda::Bf16Kernel bf16 = cuda::Bf16Kernel::kSplit;
    // The merge folded into both launches (MergeTarget::fold_counters), with the fault words
    // in its target: sequence 1 is poisoned where its queries hold the NaN.
    bool fold = false;
    // Folded, the BF16 launch after the INT2 one: every group's last CTA is a BF16 CTA
    // (its ring as scratch, its raw queries read by the merging CTA).
    bool bf16_last = false;
  };
  const std::vector<Way> ways = {Way{true, true},
                                 Way{true, false},
                                 Way{false, true},
                                 Way{true, true, kRawF32},
                                 Way{false, false, kRawF32},
                                 Way{true, true, kConvertedBf16},
                                 Way{true, true, kRawBf16},
                                 Way{false, false, kRawBf16},
                                 Way{true, true, kF32, kWarp},
                                 Way{false, true, kRawF32, kWarp},
                                 Way{true, true, kConvertedBf16, kWarp},
                                 Way{true, true, kRawBf16, kWarp},
                                 Way{true, true, kF32, kSplit, true},
                                 Way{true, false, kRawF32, kSplit, true},
                                 Way{true, true, kConvertedBf16, kSplit, true},
                                 Way{true, true, kRawBf16, kSplit, true},
                                 Way{true, true, kRawBf16, kWarp, true},
                                 Way{true, true, kRawBf16, kSplit, true, true},
                                 Way{true, true, kF32, kSplit, true, true},
                                 Way{true, true, kRawF32, kWarp, true, true}};
  unsigned int* counters = Up(std::vector<unsigned int>(batch * hkv, 0));
  ASSERT_EQ(s_bf16, cuda::Bf16DecodeSplits(cuda::Bf16Kernel::kSplit, batch, hkv, d, max_bf16, 132));
  std::vector<std::vector<float>> got_o_ways, got_lse_ways;
  std::vector<std::vector<unsigned long long>> words_ways;
  for (const Way way : ways) {
    unsigned long long* d_words = Up(std::vector<unsigned long long>(2 * batch, 0));
    std::vector<DeviceFault> faults(batch);
    for (int b = 0; b < batch; ++b)
      faults[b] = DeviceFault{d_words + b, d_words + batch + b, FaultTag(7 + b, 0)};
    const DeviceFault* d_faults = Up(faults);
    const float* way_q = d_q;
    cuda::RawQueries raw;
    const cuda::RawQueries* raw_q = nullptr;
    if (way.queries == kRawF32 || way.queries == kRawBf16) {
      raw = cuda::RawQueries{way.queries == kRawF32 ? static_cast<const void*>(d_q) : d_qb,
                             way.queries == kRawBf16, d_faults, 9};
      raw_q = &raw;
      way_q = nullptr;
    } else if (way.queries == kConvertedBf16) {
      ASSERT_EQ(cuda::LaunchQueriesToFloat(d_qb, true, batch, hq * d, d_qc, d_faults, nullptr, 9)
                    .device_code(),
                cudaSuccess);
      way_q = d_qc;
    }
    ASSERT_EQ(cudaMemcpy(part_lse, std::vector<float>((s_int2 + s_bf16) * rows, NAN).data(),
                         sizeof(float) * (s_int2 + s_bf16) * rows, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(o, std::vector<float>(rows * d, NAN).data(), sizeof(float) * rows * d,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    const cuda::MergeTarget merge{s_int2 + s_bf16, d_rvt, o, lse};
    const cuda::MergeTarget folded{s_int2 + s_bf16, d_rvt, o, lse, d_faults, hq, counters};
    cuda::Int2PartsOptions opt;
    opt.state = state;
    opt.merge = way.fold ? &folded : way.merge_in_launch ? &merge : nullptr;
    opt.dependent_launch = way.dependent;
    opt.raw = raw_q;
    // A folded way runs twice: the counters its first call leaves (zero) serve the second,
    // whose results are the same bits (the merging CTA sums the parts in one order).
    std::vector<float> first_o;
    for (int run = 0; run < (way.fold ? 2 : 1); ++run) {
      if (run == 1) {  // every part and output poisoned again: the second call writes all
        first_o = Down(o, rows * d);
        ASSERT_EQ(cudaMemcpy(o, std::vector<float>(rows * d, -1.0f).data(),
                             sizeof(float) * rows * d, cudaMemcpyHostToDevice),
                  cudaSuccess);
        const size_t n = static_cast<size_t>(s_int2 + s_bf16) * rows;
        ASSERT_EQ(cudaMemcpy(part_o, std::vector<float>(n * d, NAN).data(), sizeof(float) * n * d,
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(part_lse, std::vector<float>(n, NAN).data(), sizeof(float) * n,
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
      auto bf16 = [&] {
        ASSERT_EQ(
            cuda::LaunchBf16Parts(way.bf16, bf16_list, geo, way_q, d_rk, scale, s_bf16, max_bf16,
                                  part_o, part_lse, 0, nullptr, raw_q, way.fold ? &folded : nullptr)
                .device_code(),
            cudaSuccess);
      };
      if (!way.bf16_last) bf16();
      ASSERT_EQ(cuda::LaunchInt2DecodeParts(int2_list, geo, way_q, d_rk, scale, s_int2, max_int2,
                                            part_o, part_lse, s_bf16, nullptr, opt)
                    .device_code(),
                cudaSuccess);
      if (way.bf16_last) bf16();
    }
    if (way.fold) {
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(Down(counters, batch * hkv), std::vector<unsigned int>(batch * hkv, 0));
      const std::vector<float> second_o = Down(o, rows * d);
      ASSERT_EQ(first_o.size(), second_o.size());
      EXPECT_EQ(0, std::memcmp(first_o.data(), second_o.data(), sizeof(float) * rows * d));
    }
    if (!way.merge_in_launch) {
      ASSERT_EQ(
          cuda::LaunchMergeParts(part_o, part_lse, s_int2 + s_bf16, rows, d, d_rvt, o, lse, nullptr)
              .device_code(),
          cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    got_o_ways.push_back(Down(o, rows * d));
    got_lse_ways.push_back(Down(lse, rows));
    words_ways.push_back(Down(d_words, 2 * batch));
  }
  // Dependent or plain launches, how the merge is launched and whether the launches read the
  // queries raw change nothing: bit-identical results (F32 ways against way 0, BF16 ways against
  // the converted BF16 way), and raw BF16 reads set the same fault words as the conversion. Bases:
  // the first way of the same BF16 kernel and the same query values.
  const size_t bf16_base = 5, warp_base = 8, warp_bf16_base = 10;
  for (size_t w = 1; w < ways.size(); ++w) {
    const bool bf16_q = ways[w].queries == kConvertedBf16 || ways[w].queries == kRawBf16;
    const size_t base =
        ways[w].bf16 == kWarp ? (bf16_q ? warp_bf16_base : warp_base) : (bf16_q ? bf16_base : 0);
    if (w == base) continue;
    if (ways[w].fold) {
      // The folded merge sums the parts in another order: equal to float rounding, except
      // that sequence 1, whose BF16 queries hold a NaN, is poisoned by its fault word.
      EXPECT_EQ(words_ways[w], words_ways[base]) << "way " << w;
      for (int r = 0; r < rows; ++r) {
        const bool poisoned = bf16_q && r / hq == 1;
        ASSERT_EQ(std::isnan(got_lse_ways[w][r]), poisoned) << "way " << w << " row " << r;
        if (!poisoned) {
          EXPECT_NEAR(got_lse_ways[w][r], got_lse_ways[base][r],
                      1e-5 * (1 + std::fabs(got_lse_ways[base][r])));
        }
        for (int c = 0; c < d; ++c) {
          const float got = got_o_ways[w][r * d + c], want = got_o_ways[base][r * d + c];
          ASSERT_EQ(std::isnan(got), poisoned) << "way " << w << " row " << r;
          if (!poisoned) {
            ASSERT_NEAR(got, want, 1e-5 * (1 + std::fabs(want))) << "way " << w << " row " << r;
          }
        }
      }
      continue;
    }
    EXPECT_EQ(got_o_ways[w], got_o_ways[base]) << "way " << w;
    EXPECT_EQ(got_lse_ways[w], got_lse_ways[base]) << "way " << w;
    EXPECT_EQ(words_ways[w], words_ways[base]) << "way " << w;
  }
  EXPECT_NE(got_o_ways[bf16_base], got_o_ways[0]);  // the BF16 queries are other queries
  for (int b = 0; b < batch; ++b) {
    const unsigned long long want =
        b == 1 ? (FaultTag(7 + b, 9) | (kFaultQuery << kFaultInputShift)) : 0;
    EXPECT_EQ(words_ways[bf16_base][b], want) << "b " << b;
    EXPECT_EQ(words_ways[bf16_base][batch + b], want) << "b " << b;
    EXPECT_EQ(words_ways[0][b], 0u) << "b " << b;
  }
  EXPECT_EQ(words_ways[warp_bf16_base], words_ways[bf16_base]);
  // The first BF16 kernel (FP32 on CUDA cores) and the split one (two BF16 digits of q and p
  // on tensor cores) agree to ~1e-5.
  for (size_t i = 0; i < got_o_ways[0].size(); ++i) {
    EXPECT_NEAR(got_o_ways[warp_base][i], got_o_ways[0][i],
                1e-4 * (1 + std::fabs(got_o_ways[0][i])))
        << "element " << i;
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

// A folded merge target the launches cannot honour is refused before anything runs: no
// counters, more parts than the merging CTA holds, parts past the target's count, fault
// words per entry other than per sequence.
TEST_F(CudaKernelsTest, FoldedMergeRefusesTargetsItCannotFold) {
  const int hq = 8, hkv = 2, d = 128, ps = 64, batch = 2, rows = batch * hq;
  const cuda::DecodeGeometry geo{batch, hq, hkv, d, ps};
  const int max_parts = cuda::MaxFoldedMergeParts(d);
  ASSERT_EQ(max_parts, 3 * d - 16);
  EXPECT_EQ(cuda::MaxFoldedMergeParts(96), 0);
  float* part_o = Up(std::vector<float>(static_cast<size_t>(max_parts + 1) * rows * d, 0.0f));
  float* part_lse = Up(std::vector<float>(static_cast<size_t>(max_parts + 1) * rows, 0.0f));
  void* state = Up(std::vector<uint8_t>(cuda::Int2StateBytes(batch, hkv), 0));
  const float* q = Up(std::vector<float>(rows * d, 0.5f));
  float* o = Up(std::vector<float>(rows * d, NAN));
  float* lse = Up(std::vector<float>(rows, NAN));
  unsigned int* counters = Up(std::vector<unsigned int>(batch * hkv, 0));
  const std::vector<uint8_t> pool(static_cast<size_t>(batch) * Bf16PageElems(hkv, ps, d) * 2, 0);
  const cuda::PagedList list{Up(pool), Bf16PageElems(hkv, ps, d) * 2,
                             Up(std::vector<int32_t>{0, 1}), 1, Up(std::vector<int32_t>{10, 20})};
  const DeviceFault* faults = Up(std::vector<DeviceFault>(batch));
  auto launch = [&](const cuda::MergeTarget& m, int splits, int part_base) {
    return cuda::LaunchBf16Parts(cuda::Bf16Kernel::kSplit, list, geo, q, nullptr, 1.0f, splits, 20,
                                 part_o, part_lse, part_base, nullptr, nullptr, &m)
        .device_code();
  };
  auto launch_int2 = [&](const cuda::MergeTarget& m, int splits, int part_base) {
    cuda::Int2PartsOptions opt;
    opt.state = state;
    opt.merge = &m;
    return cuda::LaunchInt2DecodeParts(list, geo, q, nullptr, 1.0f, splits, 20, part_o, part_lse,
                                       part_base, nullptr, opt)
        .device_code();
  };
  // The target that fits: zero pages (K = V = 0) give every query uniform weights, so o = 0
  // and lse = ln(length), merged in the launch.
  const cuda::MergeTarget good{4, nullptr, o, lse, faults, hq, counters};
  EXPECT_EQ(launch(good, 4, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(Down(counters, batch * hkv), std::vector<unsigned int>(batch * hkv, 0));
  const std::vector<float> got_o = Down(o, rows * d), got_lse = Down(lse, rows);
  for (int r = 0; r < rows; ++r) {
    EXPECT_NEAR(got_lse[r], std::log(r < hq ? 10.0f : 20.0f), 1e-5) << "row " << r;
    for (int c = 0; c < d; ++c) ASSERT_EQ(got_o[r * d + c], 0.0f) << "row " << r;
  }
  cuda::MergeTarget bad = good;
  bad.fold_counters = nullptr;
  EXPECT_EQ(launch(bad, 4, 0), cudaErrorInvalidValue);  // no counters: not a fold target
  bad = good;
  bad.parts = max_parts + 1;
  EXPECT_EQ(launch(bad, 4, 0), cudaErrorInvalidValue);
  EXPECT_EQ(launch_int2(bad, 4, 0), cudaErrorInvalidValue);
  EXPECT_EQ(launch(good, 3, 2), cudaErrorInvalidValue);       // parts 2..4 of 4
  EXPECT_EQ(launch_int2(good, 4, 1), cudaErrorInvalidValue);  // parts 1..4 of 4
  bad = good;
  bad.rows_per_entry = hkv;
  EXPECT_EQ(launch(bad, 4, 0), cudaErrorInvalidValue);
  EXPECT_EQ(launch_int2(bad, 4, 0), cudaErrorInvalidValue);
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
      // rotate 2: K layer 0 and V layer 1 take the Hadamard (INT2: butterflies), the others
      // dense matrices.
      for (int rotate = 0; rotate < 3; ++rotate) {
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
        std::vector<uint8_t> hadamard(2 * layers, 0);  // [K, V][layer]
        if (rotate == 2) {
          const float c = 1.0f / std::sqrt(static_cast<float>(d));
          for (int m : {0, 3}) {
            for (int i = 0; i < d; ++i) {
              for (int j = 0; j < d; ++j) {
                rot[(int64_t{m} * d + i) * d + j] = __builtin_popcount(i & j) % 2 ? -c : c;
              }
            }
          }
          for (int m = 0; m < 2 * layers; ++m) {
            hadamard[m] =
                ClassifyRotation(rot.data() + int64_t{m} * d * d, d) == Rotation::kHadamard;
          }
          ASSERT_EQ(hadamard, (std::vector<uint8_t>{1, 0, 0, 1}));
        }
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
          codec.hadamard_k = Up(hadamard);
          codec.hadamard_v = codec.hadamard_k + layers;
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
          ASSERT_EQ((fmt == 0 ? cuda::LaunchStoreBf16Rows(k, v, dst, codec, nullptr)
                              : cuda::LaunchStoreInt2Rows(k, v, dst, codec, nullptr))
                        .device_code(),
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
    ASSERT_EQ(cuda::LaunchPagedCopy(cuda::PageCopy::kScatter, a, d_bad, nullptr).device_code(),
              cudaSuccess);
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
    ASSERT_EQ(cuda::LaunchPagedCopy(cuda::PageCopy::kCheck, a, d_bad, nullptr).device_code(),
              cudaSuccess);
    EXPECT_EQ(Down(d_bad, 1)[0], want_bad);
    // The BF16 check over whole layer pages: random bytes hold Inf/NaN patterns.
    const uint64_t want_bf16 = CountBad(run, 0, run.size(), cuda::kCheckBf16Finite, 0);
    a.check = cuda::kCheckBf16Finite;
    a.check_offset = 0;
    a.check_bytes = layer_bytes;
    ASSERT_EQ(cudaMemset(d_bad, 0, sizeof(unsigned long long)), cudaSuccess);
    ASSERT_EQ(cuda::LaunchPagedCopy(cuda::PageCopy::kCheck, a, d_bad, nullptr).device_code(),
              cudaSuccess);
    EXPECT_EQ(Down(d_bad, 1)[0], want_bf16);
    EXPECT_GT(want_bf16, 0u);
    // The F32 check (F32 values in device memory, e.g. a pushed run of F32 words): the
    // high half of every 32-bit word, counted from the start of each layer page.
    uint64_t want_f32 = 0;
    for (int64_t item = 0; item < pages * layers; ++item) {
      want_f32 += CountBad(run, static_cast<size_t>(item * layer_bytes),
                           static_cast<size_t>(layer_bytes), cuda::kCheckF32Finite, 0);
    }
    a.check = cuda::kCheckF32Finite;
    ASSERT_EQ(cudaMemset(d_bad, 0, sizeof(unsigned long long)), cudaSuccess);
    ASSERT_EQ(cuda::LaunchPagedCopy(cuda::PageCopy::kCheck, a, d_bad, nullptr).device_code(),
              cudaSuccess);
    EXPECT_EQ(Down(d_bad, 1)[0], want_f32);
    EXPECT_GT(want_f32, 0u);
    EXPECT_LT(want_f32, want_bf16);
    // Gather into a poisoned run: the original run comes back.
    ASSERT_EQ(cudaMemset(d_run, 0xee, run.size()), cudaSuccess);
    a.check = cuda::kCheckNone;
    ASSERT_EQ(cuda::LaunchPagedCopy(cuda::PageCopy::kGather, a, nullptr, nullptr).device_code(),
              cudaSuccess);
    EXPECT_TRUE(Down(d_run, run.size()) == run) << "layer_bytes " << layer_bytes;
  }
}

// The non-finite check fused into the paged row stores against a scalar reference: random
// rows with NaN, +Inf and -Inf injected at random places (or none); the synchronous report
// (count, first bad row in launch order), the pipelined one (per-token fault words, inline
// and uploaded targets), and the pool: bad rows stored as zeros, every other row exactly as
// the host path stores it.
TEST_F(CudaKernelsTest, FusedStoreCheckMatchesAScalarReference) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const float kBad[3] = {NAN, INFINITY, -INFINITY};
  const int layers = 2, hkv = 3, ps = 16, pool_pages = 8, first_layer = 3;
  for (int tokens : {5, 37}) {
    for (int d : {64, 128, 256}) {
      for (int src_bf16 = 0; src_bf16 < 2; ++src_bf16) {
        for (int injections : {0, 1, 7}) {
          const int64_t row_elems = int64_t{layers} * tokens * hkv * d;
          std::vector<float> x(2 * row_elems);
          for (auto& f : x) f = normal(rng_);
          for (int i = 0; i < injections; ++i) {
            x[rng_() % x.size()] = kBad[rng_() % 3];
          }
          std::vector<uint16_t> xb(x.size());
          for (size_t i = 0; i < x.size(); ++i) {
            xb[i] = FloatToBf16(x[i]);
            if (src_bf16) x[i] = Bf16ToFloat(xb[i]);
          }
          // Scalar reference: per row (layer, token, which, head) its non-finite count.
          uint64_t want_count = 0, want_first = ~0ull;
          std::vector<int> token_bad(tokens, 0);  // bit 0: a K row, bit 1: a V row
          std::vector<char> row_bad(2 * layers * tokens * hkv, 0);  // by launch row index
          for (int l = 0; l < layers; ++l)
            for (int t = 0; t < tokens; ++t)
              for (int which = 0; which < 2; ++which)
                for (int h = 0; h < hkv; ++h) {
                  const int64_t at = which * row_elems + ((int64_t{l} * tokens + t) * hkv + h) * d;
                  int n = 0;
                  for (int e = 0; e < d; ++e) n += !std::isfinite(x[at + e]);
                  if (n == 0) continue;
                  want_count += n;
                  const uint64_t r =
                      ((static_cast<uint64_t>(l) * tokens + t) * 2 + which) * hkv + h;
                  want_first = std::min(want_first, r);
                  token_bad[t] |= 1 << which;
                  row_bad[r] = 1;
                }
          ASSERT_EQ(want_count > 0, injections > 0);
          std::vector<float> rot(static_cast<size_t>(layers) * 2 * d * d);
          for (auto& r : rot) r = normal(rng_) / std::sqrt(static_cast<float>(d));
          std::vector<float> rho = {0.96f, 0.9f, 0.92f, 1.0f};
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
          codec.r_k = d_rot;
          codec.r_v = d_rot + int64_t{layers} * d * d;
          codec.r_layer_stride = int64_t{d} * d;
          codec.rho_k = Up(rho);
          codec.rho_v = codec.rho_k + 2;
          for (int fmt = 0; fmt < 2; ++fmt) {
            const std::string where = "tokens " + std::to_string(tokens) + " d " +
                                      std::to_string(d) + " bf16 " + std::to_string(src_bf16) +
                                      " injections " + std::to_string(injections) + " format " +
                                      std::to_string(fmt);
            const int64_t page_bytes =
                fmt == 0 ? Bf16PageElems(hkv, ps, d) * 2 : Int2PageBytes(hkv, ps, d);
            const std::vector<uint8_t> poison(static_cast<size_t>(layers * pool_pages * page_bytes),
                                              0xA5);
            // The host path over the clean rows.
            std::vector<uint8_t> want = poison;
            std::vector<float> rotated(d), zeros(d, 0.0f);
            for (int l = 0; l < layers; ++l)
              for (int t = 0; t < tokens; ++t) {
                uint8_t* base = want.data() + (l * pool_pages + slots[t] / ps) * page_bytes;
                const int64_t slot = slots[t] % ps;
                for (int which = 0; which < 2; ++which)
                  for (int h = 0; h < hkv; ++h) {
                    // A bad row is stored as a row of zeros (not rotated).
                    const bool bad = row_bad[((int64_t{l} * tokens + t) * 2 + which) * hkv + h];
                    const float* row = bad ? zeros.data()
                                           : x.data() + which * row_elems +
                                                 ((int64_t{l} * tokens + t) * hkv + h) * d;
                    const float* r =
                        bad ? nullptr : rot.data() + (int64_t{which} * layers + l) * d * d;
                    if (fmt == 0) {
                      if (r != nullptr) RotateRows(row, 1, d, r, rotated.data());
                      FloatToBf16N(r != nullptr ? rotated.data() : row,
                                   reinterpret_cast<uint16_t*>(base) +
                                       ((int64_t{which} * hkv + h) * ps + slot) * d,
                                   d);
                    } else {
                      const Int2PageLayout layout{hkv, ps, d};
                      DemoteRowsToInt2(row, 1, d, r, rho[which * 2 + l],
                                       which == 0 ? layout.K(base, h) : layout.V(base, h), slot);
                    }
                  }
              }
            cuda::PagedRows dst;
            dst.num_layers = layers;
            dst.num_tokens = tokens;
            dst.num_kv_heads = hkv;
            dst.head_dim = d;
            dst.page_size = ps;
            dst.layer_stride = pool_pages * page_bytes;
            dst.page_bytes = page_bytes;
            dst.slots = Up(slots);
            auto launch = [&](const cuda::StoreCheck* c) {
              return (fmt == 0 ? cuda::LaunchStoreBf16Rows(k, v, dst, codec, nullptr, c)
                               : cuda::LaunchStoreInt2Rows(k, v, dst, codec, nullptr, c))
                  .device_code();
            };
            // Synchronous report.
            dst.base = Up(poison);
            cuda::StoreCheck sync;
            sync.count = Up(std::vector<unsigned long long>{0, ~0ull});
            sync.first_row = sync.count + 1;
            ASSERT_EQ(launch(&sync), cudaSuccess);
            const auto report = Down(sync.count, 2);
            EXPECT_EQ(report[0], want_count) << where;
            EXPECT_EQ(report[1], want_first) << where;
            ASSERT_TRUE(Down(dst.base, poison.size()) == want) << where;
            // Pipelined report: one fault target per token (owner 100 + t, layer 3).
            std::vector<unsigned long long> words(2 * tokens, 0);
            unsigned long long* d_words = Up(words);
            std::vector<DeviceFault> faults(tokens);
            for (int t = 0; t < tokens; ++t) {
              faults[t].host_word = d_words + t;
              faults[t].device_word = d_words + tokens + t;
              faults[t].tag = FaultTag(100 + t, first_layer);
            }
            cuda::StoreCheck piped;
            if (tokens <= cuda::PagedRows::kInlineSlots) {
              std::copy(faults.begin(), faults.end(), piped.inline_faults);
              piped.use_inline_faults = true;
            } else {
              piped.faults = Up(faults);
            }
            dst.base = Up(poison);
            ASSERT_EQ(launch(&piped), cudaSuccess);
            ASSERT_TRUE(Down(dst.base, poison.size()) == want) << where;
            const auto got_words = Down(d_words, words.size());
            // Both words of a bad token name its owner and layer and one of its bad inputs.
            // When its K row and its V row are both bad, the two rows' writers race and each
            // word may name either (seen under compute-sanitizer): both name a bad input.
            for (int t = 0; t < tokens; ++t) {
              for (const uint64_t w : {got_words[t], got_words[tokens + t]}) {
                if (token_bad[t] == 0) {
                  EXPECT_EQ(w, 0u) << where << " token " << t;
                  continue;
                }
                ASSERT_TRUE(FaultMatches(w, faults[t].tag)) << where << " token " << t;
                EXPECT_EQ(FaultLayerOf(w), first_layer);
                const FaultInput in = FaultInputOf(w);
                EXPECT_TRUE((in == kFaultKNew && (token_bad[t] & 1)) ||
                            (in == kFaultVNew && (token_bad[t] & 2)))
                    << where << " token " << t << " input " << in;
              }
              if (token_bad[t] != 3) {
                EXPECT_EQ(got_words[t], got_words[tokens + t]) << where;
              }
            }
            // Without the check compiled in, clean rows store the same bytes.
            if (injections == 0) {
              dst.base = Up(poison);
              ASSERT_EQ(launch(nullptr), cudaSuccess);
              ASSERT_TRUE(Down(dst.base, poison.size()) == want) << where;
            }
          }
        }
      }
    }
  }
}

// The query conversion with the fused check against a scalar reference: non-finite values
// become 0, exactly the sequences holding one get their fault words set (input q), a
// target with tag 0 is left alone. The layer comes in the tags or (in_call) from the launch.
TEST_F(CudaKernelsTest, QueryConversionCheckMatchesAScalarReference) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const float kBad[3] = {NAN, INFINITY, -INFINITY};
  for (int bf16 = 0; bf16 < 2; ++bf16) {
    for (int64_t batch : {1, 5, 67}) {
      const bool in_call = batch != 5;
      const int64_t row = 8 * 128;
      std::vector<float> f(batch * row);
      for (auto& x : f) x = normal(rng_);
      const int injections = static_cast<int>(rng_() % 6);
      for (int i = 0; i < injections; ++i) f[rng_() % f.size()] = kBad[rng_() % 3];
      std::vector<uint16_t> h(f.size());
      for (size_t i = 0; i < f.size(); ++i) {
        h[i] = FloatToBf16(f[i]);
        if (bf16) f[i] = Bf16ToFloat(h[i]);
      }
      std::vector<unsigned long long> words(2 * batch, 0);
      unsigned long long* d_words = Up(words);
      std::vector<DeviceFault> faults(batch);
      for (int64_t b = 0; b < batch; ++b) {
        faults[b].host_word = d_words + b;
        faults[b].device_word = d_words + batch + b;
        // some sequences untracked
        faults[b].tag = b % 7 == 3 ? 0 : FaultTag(1000 + b, in_call ? 0 : 5);
      }
      float* d_out = Up(std::vector<float>(f.size(), NAN));
      const void* src = bf16 ? static_cast<const void*>(Up(h)) : Up(f);
      ASSERT_EQ(cuda::LaunchQueriesToFloat(src, bf16, batch, row, d_out, Up(faults), nullptr,
                                           in_call ? 5 : 0)
                    .device_code(),
                cudaSuccess);
      const auto out = Down(d_out, f.size());
      const auto got = Down(d_words, words.size());
      for (int64_t b = 0; b < batch; ++b) {
        bool any = false;
        for (int64_t i = b * row; i < (b + 1) * row; ++i) {
          const bool bad = !std::isfinite(f[i]);
          any = any || bad;
          ASSERT_EQ(out[i], bad ? 0.0f : f[i]) << "b " << b << " i " << i;
        }
        const bool tracked = faults[b].tag != 0;
        EXPECT_EQ(got[b] != 0, any && tracked) << "b " << b;
        EXPECT_EQ(got[b], got[batch + b]);
        if (any && tracked) {
          EXPECT_TRUE(FaultMatches(got[b], faults[b].tag));
          EXPECT_EQ(FaultInputOf(got[b]), kFaultQuery);
          EXPECT_EQ(FaultLayerOf(got[b]), 5);
        }
      }
    }
  }
}

// The merge poisons exactly the rows of sequences whose device word is set for their own
// owner (a stale owner's word, a clean word and an untracked sequence are merged as usual,
// bit for bit as without fault targets).
TEST_F(CudaKernelsTest, MergePoisonsFaultedSequences) {
  for (int d : {64, 128, 256}) {
    const int batch = 5, hq = 4, rows = batch * hq, parts = 3;
    MergeInputs in = RandomMergeInputs(parts, rows, d);
    in.part_lse[rows + 2] = -INFINITY;  // an empty part
    const float* d_po = Up(in.part_o);
    const float* d_pl = Up(in.part_lse);
    const float* d_rvt = Up(in.r_v_t);
    float* o = Up(std::vector<float>(rows * d, 1.0f));
    float* lse = Up(std::vector<float>(rows, 1.0f));
    ASSERT_EQ(
        cuda::LaunchMergeParts(d_po, d_pl, parts, rows, d, d_rvt, o, lse, nullptr).device_code(),
        cudaSuccess);
    const auto base_o = Down(o, rows * d);
    const auto base_lse = Down(lse, rows);
    // b0 clean, b1 set for its owner, b2 set by an earlier owner, b3 untracked (tag 0) with
    // a set word, b4 set for its owner at another layer.
    std::vector<unsigned long long> words = {0, FaultTag(21, 4) | (kFaultKNew << kFaultInputShift),
                                             FaultTag(30, 0) | (kFaultQuery << kFaultInputShift),
                                             FaultTag(40, 1), FaultTag(50, 9) | kFaultVNew << 14};
    unsigned long long* d_words = Up(words);
    std::vector<DeviceFault> faults(batch);
    const uint64_t owners[5] = {10, 21, 31, 0, 50};
    for (int b = 0; b < batch; ++b) {
      faults[b].device_word = d_words + b;
      faults[b].host_word = d_words + b;
      faults[b].tag = owners[b] == 0 ? 0 : FaultTag(owners[b], 2);
    }
    const DeviceFault* d_faults = Up(faults);
    ASSERT_EQ(
        cuda::LaunchMergeParts(d_po, d_pl, parts, rows, d, d_rvt, o, lse, nullptr, d_faults, hq)
            .device_code(),
        cudaSuccess);
    const auto got_o = Down(o, rows * d);
    const auto got_lse = Down(lse, rows);
    for (int r = 0; r < rows; ++r) {
      const int b = r / hq;
      const bool poisoned = b == 1 || b == 4;
      EXPECT_EQ(std::isnan(got_lse[r]), poisoned) << "d " << d << " row " << r;
      if (!poisoned) {
        EXPECT_EQ(got_lse[r], base_lse[r]);
      }
      for (int j = 0; j < d; ++j) {
        if (poisoned) {
          ASSERT_TRUE(std::isnan(got_o[r * d + j])) << "row " << r;
        } else {
          ASSERT_EQ(got_o[r * d + j], base_o[r * d + j]) << "row " << r;
        }
      }
    }
  }
}

// A merge whose parts are partly written on another stream waits on the device for that
// stream's word (MergeTarget::wait_word): it gives the merge of the final parts bit for bit,
// though launched before they were written; a word that never comes poisons every row after
// kMergeWaitNs; targets it cannot take are refused.
TEST_F(CudaKernelsTest, MergeWaitsForTheOtherStreamsWord) {
  if (!cuda::StreamMemopsAvailable()) GTEST_SKIP() << "no stream memory operations";
  const int d = 128, batch = 2, hq = 4, rows = batch * hq, parts = 3;
  const MergeInputs in = RandomMergeInputs(parts, rows, d);
  const std::vector<float>& po = in.part_o;
  const std::vector<float>& pl = in.part_lse;
  const float* d_final_po = Up(po);
  const float* d_final_pl = Up(pl);
  const float* d_rvt = Up(in.r_v_t);
  float* o = Up(std::vector<float>(rows * d, 1.0f));
  float* lse = Up(std::vector<float>(rows, 1.0f));
  ASSERT_EQ(cuda::LaunchMergeParts(d_final_po, d_final_pl, parts, rows, d, d_rvt, o, lse, nullptr)
                .device_code(),
            cudaSuccess);
  const auto want_o = Down(o, rows * d);
  const auto want_lse = Down(lse, rows);

  // The last part is garbage until stream `side` copies it in, which it does only once the
  // host releases its gate; then it raises the word to 7.
  std::vector<float> po_early = po, pl_early = pl;
  for (int i = 2 * rows * d; i < parts * rows * d; ++i) po_early[i] = 1e30f;
  for (int i = 2 * rows; i < parts * rows; ++i) pl_early[i] = 1e30f;
  float* d_po = Up(po_early);
  float* d_pl = Up(pl_early);
  uint32_t* words = Up(std::vector<uint32_t>{0, 0});  // [0] the merge's word, [1] the gate
  cudaStream_t main_stream = nullptr, side = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_TRUE(cuda::StreamWaitValue32(side, words + 1, 1).ok());
  const size_t part_o = static_cast<size_t>(rows) * d;
  ASSERT_EQ(cudaMemcpyAsync(d_po + 2 * part_o, d_final_po + 2 * part_o, part_o * sizeof(float),
                            cudaMemcpyDeviceToDevice, side),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(d_pl + 2 * rows, d_final_pl + 2 * rows, rows * sizeof(float),
                            cudaMemcpyDeviceToDevice, side),
            cudaSuccess);
  ASSERT_TRUE(cuda::StreamWriteValue32(side, words, 7).ok());
  cuda::MergeTarget m{parts, d_rvt, o, lse};  // no fault targets, no fold
  m.wait_word = words;
  m.wait_value = 7;
  ASSERT_EQ(cudaMemset(o, 0, rows * d * sizeof(float)), cudaSuccess);
  ASSERT_TRUE(cuda::LaunchMergeTarget(m, d_po, d_pl, rows, d, main_stream, false).ok());
  EXPECT_EQ(cudaStreamQuery(main_stream), cudaErrorNotReady);  // it cannot pass the gate
  ASSERT_TRUE(cuda::ReleaseValue32(words + 1, 1).ok());
  ASSERT_EQ(cudaStreamSynchronize(main_stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
  EXPECT_EQ(Down(o, rows * d), want_o);
  EXPECT_EQ(Down(lse, rows), want_lse);

  // A value the word never reaches (it stays at 7): every row poisoned after the bound.
  m.wait_value = 8;
  ASSERT_TRUE(cuda::LaunchMergeTarget(m, d_po, d_pl, rows, d, main_stream, true).ok());
  ASSERT_EQ(cudaStreamSynchronize(main_stream), cudaSuccess);
  for (float x : Down(o, rows * d)) ASSERT_TRUE(std::isnan(x));
  for (float x : Down(lse, rows)) ASSERT_TRUE(std::isnan(x));
  // Values compare cyclically: 7 has passed 0xfffffff0 (wrapped).
  m.wait_value = 0xfffffff0u;
  ASSERT_TRUE(cuda::LaunchMergeTarget(m, d_po, d_pl, rows, d, main_stream, false).ok());
  ASSERT_EQ(cudaStreamSynchronize(main_stream), cudaSuccess);
  EXPECT_EQ(Down(o, rows * d), want_o);

  // Refused: a fold target, no parts, no rows.
  cuda::MergeTarget bad = m;
  unsigned int* counters = Up(std::vector<unsigned int>(8, 0));
  bad.fold_counters = counters;
  EXPECT_EQ(cuda::LaunchMergeTarget(bad, d_po, d_pl, rows, d, main_stream, false).device_code(),
            cudaErrorInvalidValue);
  bad = m;
  bad.parts = 0;
  EXPECT_EQ(cuda::LaunchMergeTarget(bad, d_po, d_pl, rows, d, main_stream, false).device_code(),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchMergeTarget(m, d_po, d_pl, 0, d, main_stream, false).device_code(),
            cudaErrorInvalidValue);
  cudaStreamDestroy(side);
  cudaStreamDestroy(main_stream);
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
  ASSERT_EQ(cuda::LaunchToFloat(Up(bf), true, n, d_out, nullptr).device_code(), cudaSuccess);
  auto out = Down(d_out, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], Bf16ToFloat(bf[i])) << i;
  ASSERT_EQ(cuda::LaunchToFloat(Up(f), false, n, d_out, nullptr).device_code(), cudaSuccess);
  out = Down(d_out, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], f[i]) << i;
}

}  // namespace cuda_kernels_test
}  // namespace kvcd::kernels
