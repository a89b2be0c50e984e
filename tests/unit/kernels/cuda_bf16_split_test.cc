// The split tensor-core BF16 decode kernel (cuda_bf16_split_attention.h) against the scalar
// CPU kernel on random inputs: head_dim 64/128/256, GQA groups 1..8, odd lengths, partial
// pages and page sizes that are not multiples of a tile, NaN in every slot past a sequence,
// NaN-poisoned outputs; raw queries bit for bit against converted ones. Device tests skip
// without a GPU; the split count and argument checks run anywhere.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_fixture.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/cuda_bf16_split_attention.h"
#include "kvcd/kernels/cuda_decode_attention.h"
#include "kvcd/kernels/cuda_device_copy.h"
#include "kvcd/kernels/device_fault.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd::kernels {
namespace cuda_bf16_split_test {

constexpr uint16_t kBf16Nan = 0x7fc0;

class CudaBf16SplitTest : public CudaTestFixture {};

// A BF16 pool holding `lengths` sequences on shuffled pages; every slot past a sequence,
// and the padding between pages, is NaN.
struct PagedSequences {
  int hkv, ps, d, max_pages;
  int64_t stride;  // elements between pages
  std::vector<int32_t> lengths;
  std::vector<uint16_t> pool;
  std::vector<int32_t> ids;  // [batch][max_pages]

  PagedSequences(int hkv_, int ps_, int d_, const std::vector<int>& lens, int pad_elems,
                 std::mt19937& rng)
      : hkv(hkv_), ps(ps_), d(d_), lengths(lens.begin(), lens.end()) {
    const int batch = static_cast<int>(lens.size());
    const int max_len = *std::max_element(lens.begin(), lens.end());
    max_pages = std::max(1, (max_len + ps - 1) / ps);
    stride = Bf16PageElems(hkv, ps, d) + pad_elems;
    const int pages = batch * max_pages + 3;
    pool.assign(static_cast<size_t>(pages) * stride, kBf16Nan);
    std::vector<int32_t> perm(pages);
    for (int i = 0; i < pages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    ids.assign(perm.begin(), perm.begin() + batch * max_pages);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int b = 0; b < batch; ++b) {
      for (int t = 0; t < lens[b]; ++t) {
        const int64_t page = ids[b * max_pages + t / ps] * stride;
        for (int which = 0; which < 2; ++which) {
          for (int h = 0; h < hkv; ++h) {
            uint16_t* row =
                pool.data() + page + (int64_t{which} * hkv + h) * ps * d + int64_t{t % ps} * d;
            for (int e = 0; e < d; ++e) row[e] = FloatToBf16(normal(rng));
          }
        }
      }
    }
  }
  Bf16PageTable Table(int b) const {
    return Bf16PageTable{pool.data(), stride, ids.data() + b * max_pages, max_pages, ps, hkv, d};
  }
};

// Host merge of parts [first, first + n) of one row (float64): o and natural-log lse.
void MergeRow(const std::vector<float>& part_o, const std::vector<float>& part_lse, int first,
              int n, int rows, int row, int d, std::vector<double>* o, double* lse) {
  double m = -INFINITY;
  for (int s = first; s < first + n; ++s) m = std::max(m, double{part_lse[s * rows + row]});
  o->assign(d, 0.0);
  *lse = -INFINITY;
  if (m == -INFINITY) return;
  double den = 0;
  for (int s = first; s < first + n; ++s) {
    const double w = std::exp(part_lse[s * rows + row] - m);
    den += w;
    for (int e = 0; e < d; ++e) (*o)[e] += w * part_o[(int64_t{s} * rows + row) * d + e];
  }
  for (double& x : *o) x /= den;
  *lse = m + std::log(den);
}

struct Case {
  int d, hkv, group, ps;
  std::vector<int> lengths;
  bool rotate;
  int pad_elems;  // between pages: 4 (8 bytes) makes rows unaligned, so the first kernel runs
};

std::string Name(const Case& c) {
  std::string s = "d=" + std::to_string(c.d) + " hkv=" + std::to_string(c.hkv) +
                  " group=" + std::to_string(c.group) + " ps=" + std::to_string(c.ps) +
                  " rotate=" + std::to_string(c.rotate) + " pad=" + std::to_string(c.pad_elems) +
                  " lengths";
  for (int l : c.lengths) s += " " + std::to_string(l);
  return s;
}

TEST_F(CudaBf16SplitTest, PartsMatchTheScalarCpuKernel) {
  const std::vector<Case> cases = {
      {128, 2, 4, 64, {1037, 1, 0, 64, 65}, true, 0}, {128, 1, 8, 16, {333, 4103}, false, 0},
      {64, 3, 1, 5, {17, 250, 2}, false, 0},          {64, 2, 7, 32, {515}, true, 8},
      {256, 2, 3, 24, {200, 31}, false, 0},           {256, 1, 5, 64, {700, 3}, true, 0},
      {128, 4, 2, 48, {96, 1500}, false, 4},          {64, 1, 6, 128, {129, 0}, false, 0},
  };
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Case& c : cases) {
    const std::string where = Name(c);
    const int batch = static_cast<int>(c.lengths.size()), d = c.d;
    const int hq = c.hkv * c.group, rows = batch * hq;
    const PagedSequences seqs(c.hkv, c.ps, d, c.lengths, c.pad_elems, rng_);
    std::vector<float> q(static_cast<size_t>(rows) * d), rk(static_cast<size_t>(d) * d);
    for (auto& x : q) x = normal(rng_);
    for (auto& x : rk) x = normal(rng_) / std::sqrt(static_cast<float>(d));
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    // CPU: rotate, then the scalar BF16 kernel per (sequence, KV head).
    std::vector<float> want_o(static_cast<size_t>(rows) * d), want_lse(rows);
    for (int b = 0; b < batch; ++b) {
      std::vector<float> qr(q.begin() + int64_t{b} * hq * d, q.begin() + int64_t{b + 1} * hq * d);
      if (c.rotate) RotateRows(q.data() + int64_t{b} * hq * d, hq, d, rk.data(), qr.data());
      for (int h = 0; h < c.hkv; ++h) {
        const int r0 = b * hq + h * c.group;
        AttendBf16Pages(seqs.Table(b), h, qr.data() + int64_t{h} * c.group * d, c.group, scale, 0,
                        c.lengths[b], want_o.data() + int64_t{r0} * d, want_lse.data() + r0,
                        CpuIsa::kScalar);
      }
    }
    // GPU.
    const int max_len = *std::max_element(c.lengths.begin(), c.lengths.end());
    const cuda::DecodeGeometry geo{batch, hq, c.hkv, d, c.ps};
    const cuda::PagedList list{reinterpret_cast<const uint8_t*>(Up(seqs.pool)), seqs.stride * 2,
                               Up(seqs.ids), seqs.max_pages, Up(seqs.lengths)};
    const float* d_q = Up(q);
    const float* d_rk = c.rotate ? Up(rk) : nullptr;
    const int fill =
        cuda::Bf16DecodeSplits(cuda::Bf16Kernel::kSplit, batch, c.hkv, d, max_len, 132);
    for (const int splits : {1, fill, 5}) {
      // Parts [1, 1 + splits); part 0 must stay as it was (NaN).
      const int parts = 1 + splits;
      float* part_o = Up(std::vector<float>(static_cast<size_t>(parts) * rows * d, NAN));
      float* part_lse = Up(std::vector<float>(static_cast<size_t>(parts) * rows, NAN));
      ASSERT_EQ(cuda::LaunchBf16SplitDecodeParts(list, geo, d_q, d_rk, scale, splits, max_len,
                                                 part_o, part_lse, 1, nullptr)
                    .device_code(),
                cudaSuccess)
          << where;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << where;
      const auto got_o = Down(part_o, static_cast<size_t>(parts) * rows * d);
      const auto got_lse = Down(part_lse, static_cast<size_t>(parts) * rows);
      for (int i = 0; i < rows * d; ++i) ASSERT_TRUE(std::isnan(got_o[i])) << where;
      for (int i = 0; i < rows; ++i) ASSERT_TRUE(std::isnan(got_lse[i])) << where;
      for (size_t i = static_cast<size_t>(rows) * d; i < got_o.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got_o[i])) << where << " splits " << splits;
      }
      // Part 0 as the empty state, then the merge kernel over every part.
      ASSERT_EQ(cudaMemcpy(part_o, std::vector<float>(static_cast<size_t>(rows) * d, 0.0f).data(),
                           sizeof(float) * rows * d, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(part_lse, std::vector<float>(rows, -INFINITY).data(),
                           sizeof(float) * rows, cudaMemcpyHostToDevice),
                cudaSuccess);
      float* o = Up(std::vector<float>(static_cast<size_t>(rows) * d, NAN));
      float* lse = Up(std::vector<float>(rows, NAN));
      ASSERT_EQ(cuda::LaunchMergeParts(part_o, part_lse, parts, rows, d, nullptr, o, lse, nullptr)
                    .device_code(),
                cudaSuccess);
      const auto merged_o = Down(o, static_cast<size_t>(rows) * d);
      const auto merged_lse = Down(lse, rows);
      std::vector<double> host_o;
      double host_lse = 0;
      for (int r = 0; r < rows; ++r) {
        const int b = r / hq;
        MergeRow(got_o, got_lse, 1, splits, rows, r, d, &host_o, &host_lse);
        const float wl = want_lse[r];
        if (c.lengths[b] == 0) {
          EXPECT_TRUE(std::isinf(host_lse) && host_lse < 0) << where << " row " << r;
          EXPECT_TRUE(std::isinf(merged_lse[r]) && merged_lse[r] < 0) << where << " row " << r;
          for (int e = 0; e < d; ++e) ASSERT_EQ(merged_o[int64_t{r} * d + e], 0.0f) << where;
          continue;
        }
        double err = 0, merr = 0, norm = 0;
        for (int e = 0; e < d; ++e) {
          const double w = want_o[int64_t{r} * d + e];
          err += (host_o[e] - w) * (host_o[e] - w);
          merr += (merged_o[int64_t{r} * d + e] - w) * (merged_o[int64_t{r} * d + e] - w);
          norm += w * w;
        }
        // Two BF16 digits of q and p, FP32 accumulation: ~1e-5 expected.
        EXPECT_LE(std::sqrt(err), 1e-4 * std::sqrt(norm) + 1e-6)
            << where << " splits " << splits << " row " << r;
        EXPECT_LE(std::sqrt(merr), 1e-4 * std::sqrt(norm) + 1e-6)
            << where << " splits " << splits << " row " << r << " (merge kernel)";
        EXPECT_NEAR(host_lse, wl, 1e-4 * (1 + std::fabs(wl))) << where << " row " << r;
        EXPECT_NEAR(merged_lse[r], wl, 1e-4 * (1 + std::fabs(wl))) << where << " row " << r;
      }
    }
  }
}

// Raw queries (F32, or BF16 with a NaN and an Inf) give the parts and fault words of the
// conversion followed by the launch, bit for bit; a sequence with no tokens in the list
// still has its queries checked.
TEST_F(CudaBf16SplitTest, RawQueriesAreBitIdenticalToConvertedOnes) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int d = 128, hkv = 2, group = 4, ps = 64, hq = hkv * group;
  const std::vector<int> lengths = {300, 0, 77};
  const int batch = static_cast<int>(lengths.size()), rows = batch * hq;
  const PagedSequences seqs(hkv, ps, d, lengths, 0, rng_);
  std::vector<float> q(static_cast<size_t>(rows) * d), rk(static_cast<size_t>(d) * d);
  for (auto& x : q) x = normal(rng_);
  for (auto& x : rk) x = normal(rng_) / std::sqrt(static_cast<float>(d));
  std::vector<uint16_t> qb(q.size());
  for (size_t i = 0; i < q.size(); ++i) qb[i] = FloatToBf16(q[i]);
  qb[int64_t{1} * hq * d + 5] = kBf16Nan;         // sequence 1 (no tokens)
  qb[int64_t{2} * hq * d + 3 * d + 17] = 0x7f80;  // +Inf in sequence 2
  const float* d_q = Up(q);
  const uint16_t* d_qb = Up(qb);
  const float* d_rk = Up(rk);
  const cuda::DecodeGeometry geo{batch, hq, hkv, d, ps};
  const cuda::PagedList list{reinterpret_cast<const uint8_t*>(Up(seqs.pool)), seqs.stride * 2,
                             Up(seqs.ids), seqs.max_pages, Up(seqs.lengths)};
  const int splits = 3, layer = 11;
  const float scale = 0.09f;
  enum Way { kF32, kRawF32, kConvertedBf16, kRawBf16 };
  std::vector<std::vector<uint32_t>> bits;
  std::vector<std::vector<unsigned long long>> words;
  for (const Way way : {kF32, kRawF32, kConvertedBf16, kRawBf16}) {
    unsigned long long* d_words = Up(std::vector<unsigned long long>(2 * batch, 0));
    std::vector<DeviceFault> faults(batch);
    for (int b = 0; b < batch; ++b)
      faults[b] = DeviceFault{d_words + b, d_words + batch + b, FaultTag(7 + b, 0)};
    const DeviceFault* d_faults = Up(faults);
    float* part_o = Up(std::vector<float>(static_cast<size_t>(splits) * rows * d, NAN));
    float* part_lse = Up(std::vector<float>(static_cast<size_t>(splits) * rows, NAN));
    const float* way_q = d_q;
    cuda::RawQueries raw;
    const cuda::RawQueries* raw_q = nullptr;
    if (way == kRawF32 || way == kRawBf16) {
      raw = cuda::RawQueries{way == kRawF32 ? static_cast<const void*>(d_q) : d_qb, way == kRawBf16,
                             d_faults, layer};
      raw_q = &raw;
      way_q = nullptr;
    } else if (way == kConvertedBf16) {
      float* d_qc = Up(std::vector<float>(q.size(), NAN));
      ASSERT_EQ(cuda::LaunchQueriesToFloat(d_qb, true, batch, int64_t{hq} * d, d_qc, d_faults,
                                           nullptr, layer)
                    .device_code(),
                cudaSuccess);
      way_q = d_qc;
    }
    ASSERT_EQ(cuda::LaunchBf16SplitDecodeParts(list, geo, way_q, d_rk, scale, splits, 300, part_o,
                                               part_lse, 0, nullptr, raw_q)
                  .device_code(),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto o = Down(part_o, static_cast<size_t>(splits) * rows * d);
    const auto l = Down(part_lse, static_cast<size_t>(splits) * rows);
    std::vector<uint32_t> b(o.size() + l.size());
    std::memcpy(b.data(), o.data(), sizeof(float) * o.size());
    std::memcpy(b.data() + o.size(), l.data(), sizeof(float) * l.size());
    bits.push_back(std::move(b));
    words.push_back(Down(d_words, 2 * batch));
  }
  EXPECT_EQ(bits[kRawF32], bits[kF32]);
  EXPECT_EQ(bits[kRawBf16], bits[kConvertedBf16]);
  EXPECT_NE(bits[kConvertedBf16], bits[kF32]);  // BF16 queries (and zeros) are other queries
  EXPECT_EQ(words[kRawF32], words[kF32]);
  EXPECT_EQ(words[kRawBf16], words[kConvertedBf16]);
  for (int b = 0; b < batch; ++b) {
    const unsigned long long want =
        b == 0 ? 0 : (FaultTag(7 + b, layer) | (uint64_t{kFaultQuery} << kFaultInputShift));
    EXPECT_EQ(words[kRawBf16][b], want) << "b " << b;
    EXPECT_EQ(words[kRawBf16][batch + b], want) << "b " << b;
    EXPECT_EQ(words[kF32][b], 0u) << "b " << b;
  }
}

// No device needed: the split counts and the argument checks come before any CUDA call.
TEST(Bf16SplitArgsTest, SplitsFillOneCtaPerSmAndBadArgumentsAreRefused) {
  using cuda::Bf16DecodeSplits;
  using cuda::Bf16Kernel;
  // Qwen3-8B geometry on 132 SMs: one CTA per SM at every head_dim.
  EXPECT_EQ(Bf16DecodeSplits(Bf16Kernel::kSplit, 1, 8, 128, 32768, 132), 16);
  EXPECT_EQ(Bf16DecodeSplits(Bf16Kernel::kSplit, 8, 8, 128, 32768, 132), 2);
  EXPECT_EQ(Bf16DecodeSplits(Bf16Kernel::kSplit, 64, 8, 128, 32768, 132), 1);
  EXPECT_EQ(Bf16DecodeSplits(Bf16Kernel::kSplit, 1, 8, 64, 32768, 132), 16);
  EXPECT_EQ(Bf16DecodeSplits(Bf16Kernel::kSplit, 1, 8, 256, 32768, 132), 16);
  EXPECT_EQ(Bf16DecodeSplits(Bf16Kernel::kSplit, 1, 8, 96, 32768, 132), 1);  // no such kernel
  // Short lists: at least 2 tiles of 16 tokens per warp per split.
  EXPECT_EQ(Bf16DecodeSplits(Bf16Kernel::kSplit, 1, 8, 128, 100, 132), 1);
  EXPECT_EQ(Bf16DecodeSplits(Bf16Kernel::kSplit, 1, 8, 128, 300, 132), 3);
  EXPECT_EQ(Bf16DecodeSplits(Bf16Kernel::kSplit, 1, 8, 128, 0, 132), 1);
  EXPECT_EQ(Bf16DecodeSplits(Bf16Kernel::kWarp, 1, 8, 128, 32768, 132),
            cuda::Int2DecodeSplits(1, 8, 32768, 132));
  EXPECT_EQ(cuda::Bf16SplitCtasPerSm(96), 0);

  float part[8];
  const int32_t zero = 0;
  const cuda::PagedList list{reinterpret_cast<const uint8_t*>(part), 1024, &zero, 1, &zero};
  auto launch = [&](cuda::DecodeGeometry g, int splits) {
    return cuda::LaunchBf16SplitDecodeParts(list, g, part, nullptr, 1.0f, splits, 16, part, part, 0,
                                            nullptr)
        .device_code();
  };
  EXPECT_EQ(launch({1, 32, 8, 96, 64}, 1), cudaErrorInvalidValue);   // head_dim
  EXPECT_EQ(launch({1, 32, 2, 128, 64}, 1), cudaErrorInvalidValue);  // group 16
  EXPECT_EQ(launch({1, 30, 8, 128, 64}, 1), cudaErrorInvalidValue);  // heads not a multiple
  EXPECT_EQ(launch({1, 4, 8, 128, 64}, 1), cudaErrorInvalidValue);   // fewer q heads than kv
  EXPECT_EQ(launch({1, 32, 8, 128, 0}, 1), cudaErrorInvalidValue);   // page_size
  EXPECT_EQ(launch({0, 32, 8, 128, 64}, 1), cudaErrorInvalidValue);  // batch
  EXPECT_EQ(launch({1, 32, 8, 128, 64}, 0), cudaErrorInvalidValue);  // splits
}

}  // namespace cuda_bf16_split_test
}  // namespace kvcd::kernels
