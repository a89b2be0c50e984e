// The CUDA int2-transform kernels (cuda_transform.h) against the CPU definitions: the row
// store's pages byte for byte against EncodeTransformKeys + DemoteRowsToInt2 (fresh random
// rows, odd token counts, scattered slots, F32 and BF16 sources, the fused non-finite check),
// the decode attention's merged parts against the float64 oracle
// AttendTransformPagesReference (odd lengths, empty sequences, poisoned parts). The host
// side (codec image, layout offsets, argument checks) runs without a GPU; the rest skips.
#include "kvcd/kernels/cuda_transform.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/key_transform_profile.h"
#include "common/rotation.h"
#include "cuda_test_fixture.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/int2_codec.h"
#include "kvcd/kernels/transform_attention.h"

namespace kvcd::kernels {
namespace cuda_transform_test {

namespace kc = cuda;

// A synthetic version-3 profile ([layer][kv head]); with `hadamard`, head 1 of every layer
// (if any) gets the normalized Hadamard value rotation (the butterfly path of the store).
KeyTransformProfile Profile(int layers, int heads, int d, uint32_t seed, bool hadamard) {
  auto hs = KeyTransformProfile::SyntheticHeads(layers, heads, d, seed);
  if (hadamard && heads > 1) {
    for (int l = 0; l < layers; ++l) hs[static_cast<size_t>(l) * heads + 1].r_v = HadamardMatrix(d);
  }
  auto file = SafetensorsFile::Parse(
      KeyTransformProfile::ToSafetensors(hs, layers, heads, d, "test").Serialize());
  auto p = KeyTransformProfile::FromSafetensors(*file, layers, heads, d);
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(*p);
}

std::vector<kc::TransformHeadSource> Sources(const KeyTransformProfile& p) {
  std::vector<kc::TransformHeadSource> s;
  for (int l = 0; l < p.num_layers(); ++l) {
    for (int h = 0; h < p.num_kv_heads(); ++h) {
      kc::TransformHeadSource x;
      x.key = p.KeyCode(l, h);
      x.r_v = p.head(l, h).r_v.data();
      x.rho_v = p.head(l, h).rho_v;
      s.push_back(x);
    }
  }
  return s;
}

// A key row from the code's own distribution (times `spread`: some rows saturate).
void SampleKey(const KeyTransformProfile::Head& h, int d, float spread, std::mt19937& rng,
               float* k) {
  std::normal_distribution<float> g;
  std::vector<float> y(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) y[i] = g(rng) * h.k_sigma[i] * spread;
  for (int j = 0; j < d; ++j) {
    k[j] = h.k_mean[j];
    for (int i = 0; i < d; ++i) k[j] += h.k_decode[static_cast<size_t>(j) * d + i] * y[i];
  }
}

// --- Host side (no GPU) -------------------------------------------------------------------

TEST(CudaTransformHostTest, CodecImageTablesFollowTheCpuDefinitions) {
  for (int d : {64, 128, 256}) {
    const KeyTransformProfile p = Profile(2, 3, d, 11 + d, /*hadamard=*/true);
    const auto src = Sources(p);
    std::vector<uint8_t> image(kc::TransformCodecBytes(static_cast<int>(src.size()), d));
    // Device base = the image itself: the views point into it.
    const kc::TransformHeadCodec* views = kc::BuildTransformCodecImage(
        src.data(), static_cast<int>(src.size()), image.data(), image.data());
    ASSERT_GE(reinterpret_cast<const uint8_t*>(views), image.data());
    ASSERT_LE(reinterpret_cast<const uint8_t*>(views + src.size()), image.data() + image.size());
    std::mt19937 rng(d);
    for (size_t n = 0; n < src.size(); ++n) {
      const kc::TransformHeadCodec& v = views[n];
      const TransformKeyCode& key = src[n].key;
      SCOPED_TRACE("d " + std::to_string(d) + " head " + std::to_string(n));
      EXPECT_EQ(v.code_bytes, key.code_bytes);
      EXPECT_EQ(v.rho_v, src[n].rho_v);
      EXPECT_EQ(v.hadamard_v, n % 3 == 1 ? src[n].r_v[0] : 0.0f);
      int pos = 0, coded = 0;
      for (int i = 0; i < d; ++i) {
        const int b = key.bits[i];
        EXPECT_EQ(v.k_bits[i], b);
        EXPECT_EQ(v.k_dirs[i] >> 16, static_cast<uint32_t>(pos >> 5)) << i;
        EXPECT_EQ(v.k_dirs[i] & 31u, static_cast<uint32_t>(pos & 31)) << i;
        EXPECT_EQ((v.k_dirs[i] >> 8) & 0xffu, (1u << b) - 1u) << i;
        EXPECT_EQ(v.k_unit[i], b > 0 ? key.sigma[i] * static_cast<float>(TransformStep(b)) : 0.0f);
        EXPECT_EQ(v.k_mean[i], key.mean[i]);
        EXPECT_EQ(v.k_sigma[i], key.sigma[i]);
        for (int j = 0; j < d; ++j) {
          ASSERT_EQ(v.k_encode_t[j * d + i], key.encode[i * d + j]);
          ASSERT_EQ(v.k_decode[j * d + i], key.decode[j * d + i]);
          ASSERT_EQ(v.r_v_t[j * d + i], src[n].r_v[i * d + j]);
          ASSERT_EQ(v.r_v[i * d + j], src[n].r_v[i * d + j]);
        }
        pos += b;
        if (b > 0) coded = i + 1;
      }
      EXPECT_EQ(v.coded, coded);
      EXPECT_EQ(pos, 8 * key.code_bytes);
      // The kernel's bit stream over a row re-aligned to words (the extra word is zero)
      // yields every direction's code as TransformCodeAt does.
      for (int trial = 0; trial < 20; ++trial) {
        std::vector<uint8_t> row(static_cast<size_t>(key.code_bytes));
        for (auto& byte : row) byte = static_cast<uint8_t>(rng());
        std::vector<uint32_t> words(static_cast<size_t>((key.code_bytes + 3) / 4 + 1), 0u);
        std::memcpy(words.data(), row.data(), row.size());
        uint32_t cur = words[0], nxt = words[1];
        uint32_t cw = 0;
        int at = 0;
        for (int i = 0; i < v.coded; ++i) {
          const uint32_t dw = v.k_dirs[i];
          if ((dw >> 16) != cw) {
            ASSERT_EQ(dw >> 16, cw + 1) << "a stream advance skips a word";
            cur = nxt;
            nxt = words[(dw >> 16) + 1];
            cw = dw >> 16;
          }
          const uint64_t pair = (uint64_t{nxt} << 32) | cur;
          const auto code = static_cast<int>((pair >> (dw & 31u)) & ((dw >> 8) & 0xffu));
          ASSERT_EQ(code, TransformCodeAt(row.data(), at, key.bits[i])) << "direction " << i;
          at += key.bits[i];
        }
      }
    }
  }
}

TEST(CudaTransformHostTest, PageOffsetsAreTheCpuLayout) {
  for (int d : {64, 128, 256}) {
    for (int heads : {1, 3, 8}) {
      for (int ps : {32, 64, 96}) {
        for (int cb : {1, 18, 34, d}) {
          const TransformPageLayout l{heads, ps, d, cb};
          const kc::TransformPageOffsets o(l);
          for (int h = 0; h < heads; ++h) {
            EXPECT_EQ(o.k_codes + h * o.k_codes_head, l.KCodes(h));
            EXPECT_EQ(o.k_gains + h * o.k_gains_head, l.KGains(h));
            EXPECT_EQ(o.v_codes + h * o.v_codes_head, l.VCodes(h));
            EXPECT_EQ(o.v_params + h * o.v_params_head, l.VParams(h));
          }
          // What the kernels rely on: 4-byte aligned regions and pages, tiles of 32 rows of
          // key codes starting on a word.
          EXPECT_EQ(l.Bytes() % 4, 0);
          EXPECT_EQ(o.k_codes_head % 4, 0);
          EXPECT_EQ(o.v_codes % 4, 0);
          EXPECT_EQ(o.v_codes_head % 4, 0);
          EXPECT_EQ((32 * cb) % 4, 0);
          // The last re-aligned word of the last row of a head stays inside the page.
          EXPECT_LE(l.KCodes(heads - 1) + int64_t{ps} * cb + 8, l.Bytes());
        }
      }
    }
  }
}

TEST(CudaTransformHostTest, LaunchersRefuseWhatTheKernelsDoNotServe) {
  // Refused before anything reaches a device (no GPU needed).
  const int d = 64, ps = 32;
  const TransformPageLayout l{3, ps, d, 18};
  const kc::TransformPageOffsets o(l);
  std::vector<uint8_t> fake(64);
  const auto* heads = reinterpret_cast<const kc::TransformHeadCodec*>(fake.data());
  float f = 0;
  int32_t i32 = 0;
  const kc::PagedList list{fake.data(), l.Bytes(), &i32, 1, &i32};
  auto decode = [&](kc::DecodeGeometry g, const kc::TransformPageOffsets& lo, int splits) {
    return kc::LaunchTransformDecodeParts(list, g, lo, heads, &f, 1.0f, splits, 32, &f, &f, 0,
                                          nullptr)
        .device_code();
  };
  const kc::DecodeGeometry good{1, 9, 3, d, ps};
  EXPECT_EQ(decode({1, 9, 3, d, 16}, kc::TransformPageOffsets({3, 16, d, 18}), 1),
            cudaErrorInvalidValue);  // page_size not a multiple of 32
  EXPECT_EQ(decode({1, 27, 3, d, ps}, o, 1), cudaErrorInvalidValue);  // group 9
  EXPECT_EQ(decode({1, 10, 3, d, ps}, o, 1), cudaErrorInvalidValue);  // not a multiple
  EXPECT_EQ(decode({1, 6, 3, 96, ps}, kc::TransformPageOffsets({3, ps, 96, 18}), 1),
            cudaErrorInvalidValue);  // head_dim 96
  EXPECT_EQ(decode(good, kc::TransformPageOffsets({3, ps, 128, 18}), 1), cudaErrorInvalidValue);
  EXPECT_EQ(decode(good, o, 0), cudaErrorInvalidValue);  // no split
  EXPECT_EQ(decode(good, kc::TransformPageOffsets({3, ps, d, 65}), 1), cudaErrorInvalidValue);

  kc::RowBlock rows;
  rows.data = fake.data();
  kc::PagedRows dst;
  dst.num_layers = 1;
  dst.num_tokens = 1;
  dst.num_kv_heads = 3;
  dst.head_dim = d;
  dst.page_size = ps;
  dst.base = fake.data();
  EXPECT_EQ(kc::LaunchStoreTransformRows(rows, rows, dst, o, nullptr, nullptr).device_code(),
            cudaErrorInvalidValue);  // no codec
  kc::PagedRows bad = dst;
  bad.head_dim = 96;
  EXPECT_EQ(kc::LaunchStoreTransformRows(rows, rows, bad, kc::TransformPageOffsets({3, ps, 96, 18}),
                                         heads, nullptr)
                .device_code(),
            cudaErrorInvalidValue);
  bad = dst;
  bad.num_kv_heads = 2;  // the layout says 3
  EXPECT_EQ(kc::LaunchStoreTransformRows(rows, rows, bad, o, heads, nullptr).device_code(),
            cudaErrorInvalidValue);
  bad = dst;
  bad.num_tokens = kc::PagedRows::kInlineSlots + 1;  // no slot array
  EXPECT_EQ(kc::LaunchStoreTransformRows(rows, rows, bad, o, heads, nullptr).device_code(),
            cudaErrorInvalidValue);
}

TEST(CudaTransformHostTest, SplitsFillOneWaveAndKeepFourTilesEach) {
  EXPECT_EQ(kc::TransformDecodeSplits(1, 3, 0, 132), 1);
  EXPECT_EQ(kc::TransformDecodeSplits(1, 3, 100, 132), 1);
  EXPECT_EQ(kc::TransformDecodeSplits(1, 3, 100000, 132), 176);  // 132 * 4 / 3
  EXPECT_EQ(kc::TransformDecodeSplits(1, 8, 32768, 132), 66);
  EXPECT_EQ(kc::TransformDecodeSplits(64, 8, 32768, 132), 2);
  EXPECT_EQ(kc::TransformDecodeSplits(512, 8, 32768, 132), 1);
  for (int n : {1, 127, 128, 129, 5000}) {
    const int s = kc::TransformDecodeSplits(1, 1, n, 132);
    EXPECT_GE(s, 1);
    EXPECT_LE(s, (n + 127) / 128) << n;
  }
}

// --- On the device -------------------------------------------------------------------------

class CudaTransformTest : public CudaTestFixture {
 public:  // for the case runners below
  using CudaTestFixture::Down;
  using CudaTestFixture::Up;
  // The profile's head codecs in device memory.
  const kc::TransformHeadCodec* UpCodec(const KeyTransformProfile& p) {
    const auto src = Sources(p);
    const int n = static_cast<int>(src.size());
    std::vector<uint8_t> image(kc::TransformCodecBytes(n, p.head_dim()));
    void* dev = nullptr;
    EXPECT_EQ(cudaMalloc(&dev, image.size()), cudaSuccess);
    owned_.push_back(dev);
    const kc::TransformHeadCodec* views =
        kc::BuildTransformCodecImage(src.data(), n, dev, image.data());
    EXPECT_EQ(cudaMemcpy(dev, image.data(), image.size(), cudaMemcpyHostToDevice), cudaSuccess);
    return views;
  }
};

struct StoreCase {
  int d, layers, heads, ps, tokens;
  bool bf16, check;
};

// Rows [layers][tokens][heads][d] (K, V) to scattered slots: the device pages equal the
// CPU codecs' bytes everywhere (slots not written keep their poison on both sides).
void RunStoreCase(CudaTransformTest* t, const StoreCase& c, uint32_t seed) {
  SCOPED_TRACE("d " + std::to_string(c.d) + " heads " + std::to_string(c.heads) + " tokens " +
               std::to_string(c.tokens) + (c.bf16 ? " bf16" : " f32") +
               (c.check ? " checked" : ""));
  std::mt19937 rng(seed);
  const KeyTransformProfile p = Profile(c.layers, c.heads, c.d, seed, /*hadamard=*/true);
  const TransformPageLayout layout{c.heads, c.ps, c.d, p.key_code_bits() / 8};
  const kc::TransformPageOffsets off(layout);
  const int64_t pages = (c.tokens + c.ps - 1) / c.ps + 2;
  const int64_t page_bytes = layout.Bytes();
  std::vector<uint8_t> pool(static_cast<size_t>(c.layers * pages * page_bytes));
  for (auto& b : pool) b = static_cast<uint8_t>(rng());
  std::vector<int64_t> slots(static_cast<size_t>(pages * c.ps));
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int64_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(static_cast<size_t>(c.tokens));
  // Rows: keys from the code's distribution (some spread out to saturate), values normal.
  const size_t elems = static_cast<size_t>(c.layers) * c.tokens * c.heads * c.d;
  std::vector<float> k(elems), v(elems);
  std::normal_distribution<float> g;
  std::uniform_real_distribution<float> spread(0.2f, 3.0f);
  for (int l = 0; l < c.layers; ++l)
    for (int tk = 0; tk < c.tokens; ++tk)
      for (int h = 0; h < c.heads; ++h) {
        const size_t at = ((static_cast<size_t>(l) * c.tokens + tk) * c.heads + h) * c.d;
        SampleKey(p.head(l, h), c.d, spread(rng), rng, k.data() + at);
        for (int e = 0; e < c.d; ++e) v[at + e] = g(rng) * spread(rng);
      }
  if (c.bf16) {  // the rows the device reads, widened back exactly
    for (auto* x : {&k, &v})
      for (auto& e : *x) e = Bf16ToFloat(FloatToBf16(e));
  }
  // The checked case: a NaN in one K row, an Inf in one V row; both are stored as zero rows.
  int64_t bad_k = -1, bad_v = -1;
  if (c.check) {
    bad_k = static_cast<int64_t>(rng() % (elems / c.d));
    bad_v = static_cast<int64_t>(rng() % (elems / c.d));
  }
  std::vector<float> k_dev = k, v_dev = v;
  if (c.check) {
    k_dev[static_cast<size_t>(bad_k) * c.d + rng() % c.d] = NAN;
    v_dev[static_cast<size_t>(bad_v) * c.d + rng() % c.d] = INFINITY;
    std::fill(k.begin() + bad_k * c.d, k.begin() + (bad_k + 1) * c.d, 0.0f);
    std::fill(v.begin() + bad_v * c.d, v.begin() + (bad_v + 1) * c.d, 0.0f);
  }
  // The CPU's pages.
  std::vector<uint8_t> want = pool;
  for (int l = 0; l < c.layers; ++l)
    for (int tk = 0; tk < c.tokens; ++tk) {
      const int64_t at = slots[static_cast<size_t>(tk)];
      uint8_t* page = want.data() + (l * pages + at / c.ps) * page_bytes;
      const int slot = static_cast<int>(at % c.ps);
      for (int h = 0; h < c.heads; ++h) {
        const size_t r = ((static_cast<size_t>(l) * c.tokens + tk) * c.heads + h) * c.d;
        EncodeTransformKeys(p.KeyCode(l, h), k.data() + r, 1,
                            page + layout.KCodes(h) + int64_t{slot} * layout.code_bytes, 0,
                            reinterpret_cast<uint16_t*>(page + layout.KGains(h)) + slot);
        DemoteRowsToInt2(v.data() + r, 1, c.d, p.head(l, h).r_v.data(), p.head(l, h).rho_v,
                         layout.V(page, h), slot);
      }
    }
  // The device's.
  const void* k_src;
  const void* v_src;
  if (c.bf16) {
    std::vector<uint16_t> kb(elems), vb(elems);
    for (size_t i = 0; i < elems; ++i) kb[i] = FloatToBf16(k_dev[i]), vb[i] = FloatToBf16(v_dev[i]);
    k_src = t->Up(kb);
    v_src = t->Up(vb);
  } else {
    k_src = t->Up(k_dev);
    v_src = t->Up(v_dev);
  }
  kc::RowBlock kr, vr;
  kr.data = k_src;
  vr.data = v_src;
  kr.bf16 = vr.bf16 = c.bf16;
  kr.layer_stride = vr.layer_stride = int64_t{c.tokens} * c.heads * c.d;
  kr.token_stride = vr.token_stride = int64_t{c.heads} * c.d;
  kr.head_stride = vr.head_stride = c.d;
  kc::PagedRows dst;
  dst.num_layers = c.layers;
  dst.num_tokens = c.tokens;
  dst.num_kv_heads = c.heads;
  dst.head_dim = c.d;
  dst.page_size = c.ps;
  uint8_t* d_pool = t->Up(pool);
  dst.base = d_pool;
  dst.layer_stride = pages * page_bytes;
  dst.page_bytes = page_bytes;
  if (c.tokens <= kc::PagedRows::kInlineSlots) {
    std::copy(slots.begin(), slots.end(), dst.inline_slots);
  } else {
    dst.slots = t->Up(slots);
  }
  kc::StoreCheck check;
  unsigned long long* words = nullptr;
  if (c.check) {
    words = t->Up(std::vector<unsigned long long>{0, ~0ull});
    check.count = words;
    check.first_row = words + 1;
  }
  const kc::TransformHeadCodec* heads = t->UpCodec(p);
  ASSERT_EQ(
      kc::LaunchStoreTransformRows(kr, vr, dst, off, heads, nullptr, c.check ? &check : nullptr)
          .device_code(),
      cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> got = t->Down(d_pool, pool.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    const int64_t lp = static_cast<int64_t>(i) / page_bytes,
                  in = static_cast<int64_t>(i) % page_bytes;
    const char* region = in < off.k_gains    ? "key codes"
                         : in < off.v_codes  ? "key gains"
                         : in < off.v_params ? "value codes"
                                             : "value parameters";
    FAIL() << "byte " << in << " (" << region << ") of layer page " << lp << ": got " << int{got[i]}
           << ", the CPU codec's " << int{want[i]};
  }
  if (c.check) {
    const auto w = t->Down(words, 2);
    EXPECT_EQ(w[0], 2u);
    // Launch rows ((layer * tokens + token) * 2 + which) * heads + head; the bad rows'
    // indices in [layers][tokens][heads] order are (layer * tokens + token) * heads + head.
    auto launch_row = [&](int64_t r, int which) {
      const int64_t h = r % c.heads, lt = r / c.heads;
      return static_cast<unsigned long long>((lt * 2 + which) * c.heads + h);
    };
    EXPECT_EQ(w[1], std::min(launch_row(bad_k, 0), launch_row(bad_v, 1)));
  }
}

// KVCD_TRANSFORM_TEST_SMALL=1: a few small cases (compute-sanitizer runs).
bool Small() { return std::getenv("KVCD_TRANSFORM_TEST_SMALL") != nullptr; }

TEST_F(CudaTransformTest, StoreIsTheCpuCodecBitForBit) {
  uint32_t seed = rng_();
  if (Small()) {
    RunStoreCase(this, {64, 2, 3, 32, 21, true, false}, seed++);
    RunStoreCase(this, {128, 1, 2, 64, 45, false, true}, seed++);
    return;
  }
  for (int d : {64, 128, 256}) {
    for (int tokens : {1, 21, 77}) {
      for (bool bf16 : {false, true}) {
        RunStoreCase(this, {d, 2, 3, 32, tokens, bf16, false}, seed++);
        if (HasFatalFailure()) return;
      }
    }
    RunStoreCase(this, {d, 2, 3, 64, 45, true, true}, seed++);
    RunStoreCase(this, {d, 1, 2, 32, 9, false, true}, seed++);
  }
}

struct DecodeCase {
  int d, hq, hkv, ps;
  std::vector<int> lengths;
  int splits;  // 0: the variant's split count (TransformDecodeSplits / TransformTcDecodeSplits)
};

// The case through `kernel`, merged (LaunchMergeParts), against the float64 oracle
// AttendTransformPagesReference; the tensor-core variant also against the CPU kernel
// AttendTransformPages on the same pages (same bounds).
void RunDecodeCase(CudaTransformTest* t, const DecodeCase& c, uint32_t seed,
                   kc::TransformKernel kernel = kc::TransformKernel::kFp32) {
  const bool tc = kernel == kc::TransformKernel::kTensorCore;
  const int batch = static_cast<int>(c.lengths.size());
  const int group = c.hq / c.hkv;
  std::string what = "d " + std::to_string(c.d) + " hq " + std::to_string(c.hq) + " hkv " +
                     std::to_string(c.hkv) + " ps " + std::to_string(c.ps) + " lengths";
  for (int n : c.lengths) what += " " + std::to_string(n);
  SCOPED_TRACE(what + (tc ? " (tensor cores)" : " (fp32)"));
  std::mt19937 rng(seed);
  const KeyTransformProfile p = Profile(1, c.hkv, c.d, seed, /*hadamard=*/true);
  const TransformPageLayout layout{c.hkv, c.ps, c.d, p.key_code_bits() / 8};
  const int max_len = *std::max_element(c.lengths.begin(), c.lengths.end());
  const int max_pages = std::max(1, (max_len + c.ps - 1) / c.ps);
  const int pool_pages = batch * max_pages + 2;
  std::vector<uint8_t> pool(static_cast<size_t>(pool_pages * layout.Bytes()));
  for (auto& b : pool) b = static_cast<uint8_t>(rng());  // slots past a length stay poison
  std::vector<int32_t> ids(static_cast<size_t>(pool_pages));
  for (int i = 0; i < pool_pages; ++i) ids[static_cast<size_t>(i)] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> table(ids.begin(), ids.begin() + batch * max_pages);
  std::normal_distribution<float> g;
  std::uniform_real_distribution<float> spread(0.5f, 2.0f);
  std::vector<float> row(static_cast<size_t>(c.d));
  for (int b = 0; b < batch; ++b) {
    for (int tk = 0; tk < c.lengths[static_cast<size_t>(b)]; ++tk) {
      uint8_t* page = pool.data() + table[b * max_pages + tk / c.ps] * layout.Bytes();
      const int slot = tk % c.ps;
      for (int h = 0; h < c.hkv; ++h) {
        SampleKey(p.head(0, h), c.d, spread(rng), rng, row.data());
        EncodeTransformKeys(p.KeyCode(0, h), row.data(), 1,
                            page + layout.KCodes(h) + int64_t{slot} * layout.code_bytes, 0,
                            reinterpret_cast<uint16_t*>(page + layout.KGains(h)) + slot);
        for (auto& x : row) x = g(rng);
        DemoteRowsToInt2(row.data(), 1, c.d, p.head(0, h).r_v.data(), p.head(0, h).rho_v,
                         layout.V(page, h), slot);
      }
    }
  }
  std::vector<float> q(static_cast<size_t>(batch) * c.hq * c.d);
  for (auto& x : q) x = g(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  const int splits = c.splits > 0 ? c.splits
                     : tc         ? kc::TransformTcDecodeSplits(batch, c.hq, c.hkv, max_len, 132)
                                  : kc::TransformDecodeSplits(batch, c.hkv, max_len, 132);
  const int rows = batch * c.hq;
  const kc::PagedList list{t->Up(pool), layout.Bytes(), t->Up(table), max_pages, t->Up(c.lengths)};
  float* part_o = t->Up(std::vector<float>(static_cast<size_t>(splits) * rows * c.d, NAN));
  float* part_lse = t->Up(std::vector<float>(static_cast<size_t>(splits) * rows, NAN));
  float* o = t->Up(std::vector<float>(static_cast<size_t>(rows) * c.d, NAN));
  float* lse = t->Up(std::vector<float>(static_cast<size_t>(rows), NAN));
  const kc::DecodeGeometry geo{batch, c.hq, c.hkv, c.d, c.ps};
  const kc::TransformPageOffsets offsets(layout);
  if (tc) {
    ASSERT_TRUE(kc::TransformTensorCoreServes(geo, offsets));
    // Scratch poisoned: the launch writes every word it reads.
    auto* state = t->Up(std::vector<uint8_t>(kc::TransformTcStateBytes(batch, c.hkv), 0xff));
    ASSERT_EQ(kc::LaunchTransformDecodePartsTc(list, geo, offsets, t->UpCodec(p), t->Up(q), scale,
                                               splits, max_len, part_o, part_lse, 0, state, nullptr)
                  .device_code(),
              cudaSuccess);
  } else {
    ASSERT_EQ(kc::LaunchTransformDecodeParts(list, geo, offsets, t->UpCodec(p), t->Up(q), scale,
                                             splits, max_len, part_o, part_lse, 0, nullptr)
                  .device_code(),
              cudaSuccess);
  }
  ASSERT_EQ(kc::LaunchMergeParts(part_o, part_lse, splits, rows, c.d, nullptr, o, lse, nullptr)
                .device_code(),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto go = t->Down(o, static_cast<size_t>(rows) * c.d);
  const auto gl = t->Down(lse, static_cast<size_t>(rows));
  if (tc) {
    // The merge folded into the decode launch (MergeTarget::fold_counters): the merge
    // kernel's results to float rounding, and the counters left at zero.
    float* fo = t->Up(std::vector<float>(static_cast<size_t>(rows) * c.d, NAN));
    float* fl = t->Up(std::vector<float>(static_cast<size_t>(rows), NAN));
    unsigned int* counters = t->Up(std::vector<unsigned int>(static_cast<size_t>(batch) * c.hkv));
    const kc::MergeTarget fold{splits, nullptr, fo, fl, nullptr, 1, counters};
    const size_t n = static_cast<size_t>(splits) * rows;  // parts poisoned again
    ASSERT_EQ(cudaMemcpy(part_o, std::vector<float>(n * c.d, NAN).data(), sizeof(float) * n * c.d,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(part_lse, std::vector<float>(n, NAN).data(), sizeof(float) * n,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    auto* state = t->Up(std::vector<uint8_t>(kc::TransformTcStateBytes(batch, c.hkv), 0xff));
    ASSERT_EQ(
        kc::LaunchTransformDecodePartsTc(list, geo, offsets, t->UpCodec(p), t->Up(q), scale, splits,
                                         max_len, part_o, part_lse, 0, state, nullptr, &fold)
            .device_code(),
        cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto fgo = t->Down(fo, static_cast<size_t>(rows) * c.d);
    const auto fgl = t->Down(fl, static_cast<size_t>(rows));
    EXPECT_EQ(t->Down(counters, static_cast<size_t>(batch) * c.hkv),
              std::vector<unsigned int>(static_cast<size_t>(batch) * c.hkv, 0));
    for (size_t i = 0; i < fgo.size(); ++i) {
      ASSERT_NEAR(fgo[i], go[i], 1e-5 * (1 + std::fabs(go[i]))) << "folded merge, element " << i;
    }
    for (size_t i = 0; i < fgl.size(); ++i) {
      if (std::isinf(gl[i])) {
        EXPECT_EQ(fgl[i], gl[i]) << "folded merge, row " << i;
      } else {
        EXPECT_NEAR(fgl[i], gl[i], 1e-5 * (1 + std::fabs(gl[i]))) << "folded merge, row " << i;
      }
    }
  }
  for (int b = 0; b < batch; ++b) {
    TransformPageTable kv;
    kv.base = pool.data();
    kv.page_stride = layout.Bytes();
    kv.page_ids = table.data() + b * max_pages;
    kv.num_pages = max_pages;
    kv.layout = layout;
    const int n = c.lengths[static_cast<size_t>(b)];
    for (int h = 0; h < c.hkv; ++h) {
      std::vector<float> ro(static_cast<size_t>(group) * c.d), rl(static_cast<size_t>(group));
      const size_t q0 = (static_cast<size_t>(b) * c.hq + h * group) * c.d;
      AttendTransformPagesReference(kv, h, p.KeyCode(0, h), p.head(0, h).r_v.data(), q.data() + q0,
                                    group, scale, 0, n, ro.data(), rl.data());
      if (tc && n > 0) {  // the CPU kernel: the same bounds against the device
        std::vector<float> co(ro.size()), cl(rl.size());
        AttendTransformPages(kv, h, p.KeyCode(0, h), p.head(0, h).r_v.data(), q.data() + q0, group,
                             scale, 0, n, co.data(), cl.data());
        for (int i = 0; i < group; ++i) {
          const size_t r = static_cast<size_t>(b) * c.hq + h * group + i;
          double err = 0, norm = 0;
          for (int e = 0; e < c.d; ++e) {
            const double x = go[r * c.d + e], y = co[static_cast<size_t>(i) * c.d + e];
            err += (x - y) * (x - y);
            norm += y * y;
          }
          EXPECT_LT(std::sqrt(err / std::max(norm, 1e-30)), 5e-4)
              << "against the CPU kernel: seq " << b << " kv head " << h << " query " << i;
          EXPECT_NEAR(gl[r], cl[static_cast<size_t>(i)], 5e-4 * std::max(1.0f, std::fabs(cl[i])))
              << "against the CPU kernel: seq " << b << " kv head " << h << " query " << i;
        }
      }
      for (int i = 0; i < group; ++i) {
        const size_t r = static_cast<size_t>(b) * c.hq + h * group + i;
        if (n == 0) {
          EXPECT_EQ(gl[r], -std::numeric_limits<float>::infinity()) << "seq " << b;
          for (int e = 0; e < c.d; ++e) EXPECT_EQ(go[r * c.d + e], 0.0f);
          continue;
        }
        // FP32 sums on the codes (__expf, the codes' products uncentred) against the float64
        // oracle on decoded rows.
        double err = 0, norm = 0;
        for (int e = 0; e < c.d; ++e) {
          const double x = go[r * c.d + e], y = ro[static_cast<size_t>(i) * c.d + e];
          ASSERT_TRUE(std::isfinite(x)) << "seq " << b << " head " << h << " e " << e;
          err += (x - y) * (x - y);
          norm += y * y;
        }
        EXPECT_LT(std::sqrt(err / std::max(norm, 1e-30)), 5e-4)
            << "seq " << b << " kv head " << h << " query " << i;
        EXPECT_NEAR(gl[r], rl[static_cast<size_t>(i)], 5e-4 * std::max(1.0f, std::fabs(rl[i])))
            << "seq " << b << " kv head " << h << " query " << i;
      }
    }
  }
}

TEST_F(CudaTransformTest, DecodeMatchesTheOracle) {
  uint32_t seed = rng_();
  const std::vector<DecodeCase> cases = {
      {64, 9, 3, 32, {1, 77, 300}, 0},   // SmolLM2-135M: group 3
      {64, 9, 3, 64, {613, 0, 33}, 7},   // an empty sequence, several splits
      {128, 8, 2, 32, {95, 1000}, 0},    // group 4
      {128, 32, 8, 64, {129}, 1},        // one split
      {256, 4, 2, 32, {67, 250}, 3},     // group 2
      {64, 8, 1, 32, {511, 2}, 0},       // group 8
      {128, 5, 5, 32, {31, 32, 33}, 0},  // group 1
      {256, 16, 2, 32, {160}, 2},        // group 8 at head_dim 256
      {128, 12, 2, 32, {200, 45}, 0},    // group 6 (in arrays of 8)
  };
  for (const DecodeCase& c : cases) {
    if (Small() && (c.d == 256 || c.hkv > 3)) continue;
    RunDecodeCase(this, c, seed++);
    if (HasFatalFailure()) return;
  }
}

// The tensor-core variant on the FP32 variant's cases it serves (head_dim 64/128) and on
// random geometries: GQA groups 1..8 (odd ones in n-tiles of 4 or 8), odd lengths, empty
// sequences, page sizes 32..128, one or many splits; same bounds against the oracle.
TEST_F(CudaTransformTest, TensorCoreDecodeMatchesTheOracle) {
  uint32_t seed = rng_();
  std::vector<DecodeCase> cases = {
      {64, 9, 3, 32, {1, 77, 300}, 0},   // SmolLM2-135M: group 3
      {64, 9, 3, 64, {613, 0, 33}, 7},   // an empty sequence, several splits
      {128, 8, 2, 32, {95, 1000}, 0},    // group 4
      {128, 32, 8, 64, {129}, 1},        // one split, Qwen3-8B's heads
      {64, 8, 1, 32, {511, 2}, 0},       // group 8
      {128, 5, 5, 32, {31, 32, 33}, 0},  // group 1
      {128, 12, 2, 32, {200, 45}, 0},    // group 6 (in two n-tiles)
      {128, 7, 1, 96, {1001}, 0},        // group 7, pages of 96
      {64, 10, 2, 128, {333, 129}, 2},   // group 5, pages of 128
  };
  if (Small()) cases = {{64, 9, 3, 32, {1, 77}, 0}, {128, 8, 2, 64, {95, 0, 130}, 3}};
  for (const DecodeCase& c : cases) {
    RunDecodeCase(this, c, seed++, kc::TransformKernel::kTensorCore);
    if (HasFatalFailure()) return;
  }
  if (Small()) return;
  std::mt19937 rng(seed);
  for (int i = 0; i < 12; ++i) {
    DecodeCase c;
    c.d = rng() % 2 ? 128 : 64;
    const int group = 1 + static_cast<int>(rng() % 8);
    c.hkv = 1 + static_cast<int>(rng() % 3);
    c.hq = group * c.hkv;
    c.ps = 32 * (1 + static_cast<int>(rng() % 4));
    const int batch = 1 + static_cast<int>(rng() % 3);
    for (int b = 0; b < batch; ++b) c.lengths.push_back(static_cast<int>(rng() % 1500));
    c.splits = rng() % 2 ? 0 : 1 + static_cast<int>(rng() % 9);
    RunDecodeCase(this, c, seed++, kc::TransformKernel::kTensorCore);
    if (HasFatalFailure()) return;
  }
}

TEST(CudaTransformHostTest, TensorCoreVariantServesWhatItSays) {
  const int ps = 64;
  auto serves = [](kc::DecodeGeometry g, int cb) {
    return kc::TransformTensorCoreServes(
        g, kc::TransformPageOffsets({g.num_kv_heads, g.page_size, g.head_dim, cb}));
  };
  EXPECT_TRUE(serves({1, 32, 8, 128, ps}, 34));   // Qwen3-8B, 2d + 16 code bits
  EXPECT_TRUE(serves({8, 9, 3, 64, ps}, 18));     // SmolLM2-135M
  EXPECT_TRUE(serves({1, 8, 1, 64, 96}, 24));     // 3 bits per direction: the most
  EXPECT_FALSE(serves({1, 8, 1, 64, ps}, 25));    // more
  EXPECT_FALSE(serves({1, 8, 2, 256, ps}, 66));   // head_dim 256: the FP32 variant
  EXPECT_FALSE(serves({1, 18, 2, 128, ps}, 34));  // group 9
  EXPECT_FALSE(serves({1, 8, 2, 128, 48}, 34));   // pages of 48
  // The launcher refuses what it does not serve, and a missing scratch, before any device
  // work.
  std::vector<uint8_t> fake(64);
  const auto* heads = reinterpret_cast<const kc::TransformHeadCodec*>(fake.data());
  float f = 0;
  int32_t i32 = 0;
  const TransformPageLayout l{2, ps, 128, 34};
  const kc::PagedList list{fake.data(), l.Bytes(), &i32, 1, &i32};
  auto launch = [&](kc::DecodeGeometry g, int cb, void* state) {
    return kc::LaunchTransformDecodePartsTc(
               list, g, kc::TransformPageOffsets({g.num_kv_heads, g.page_size, g.head_dim, cb}),
               heads, &f, 1.0f, 1, 32, &f, &f, 0, state, nullptr)
        .device_code();
  };
  EXPECT_EQ(launch({1, 8, 2, 128, ps}, 34, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(launch({1, 8, 2, 256, ps}, 66, fake.data()), cudaErrorInvalidValue);
  EXPECT_EQ(launch({1, 8, 2, 128, ps}, 49, fake.data()), cudaErrorInvalidValue);
  EXPECT_GE(kc::TransformTcStateBytes(8, 8), size_t{64} * 4 * (12 * 128 + 24));
  EXPECT_EQ(kc::TransformTcDecodeSplits(1, 32, 8, 32768, 132), 66);
  EXPECT_EQ(kc::TransformTcDecodeSplits(1, 64, 8, 32768, 132), 49);  // 3 CTAs per SM
  EXPECT_EQ(kc::TransformTcDecodeSplits(1, 32, 8, 100, 132), 1);
}

}  // namespace cuda_transform_test
}  // namespace kvcd::kernels
