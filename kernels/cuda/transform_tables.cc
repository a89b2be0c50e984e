// Host side of the CUDA int2-transform kernels (cuda_transform.h): the device image of the
// head codecs (with the tables derived from the CPU definitions themselves) and the page
// layout's offsets.
#include <cstddef>
#include <cstring>

#include "kvcd/kernels/cuda_transform.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd::kernels::cuda {
namespace {

constexpr size_t kAlign = 256;
size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Per head: four [d][d] matrices (k_encode_t, k_decode, r_v, r_v_t) and five [d] vectors
// (mean, sigma, bits, unit, dirs), each 256-byte aligned.
size_t HeadBytes(int d) {
  const size_t dd = static_cast<size_t>(d) * static_cast<size_t>(d) * 4;
  const size_t row = static_cast<size_t>(d) * 4;
  return 4 * Aligned(dd) + 5 * Aligned(row);
}

}  // namespace

size_t TransformCodecBytes(int num_heads, int head_dim) {
  return static_cast<size_t>(num_heads) * HeadBytes(head_dim) +
         Aligned(sizeof(TransformHeadCodec) * static_cast<size_t>(num_heads));
}

const TransformHeadCodec* BuildTransformCodecImage(const TransformHeadSource* heads, int num_heads,
                                                   void* device_base, uint8_t* image) {
  auto* base = static_cast<uint8_t*>(device_base);
  size_t at = 0;
  // Space for n values of 4 bytes; returns its offset in the image.
  auto place = [&](size_t n) {
    const size_t off = at;
    at += Aligned(n * 4);
    return off;
  };
  auto* views = reinterpret_cast<TransformHeadCodec*>(image + static_cast<size_t>(num_heads) *
                                                                  HeadBytes(heads[0].key.d));
  for (int n = 0; n < num_heads; ++n) {
    const TransformKeyCode& key = heads[n].key;
    const float* r_v = heads[n].r_v;
    const int d = key.d;
    const size_t dd = static_cast<size_t>(d) * static_cast<size_t>(d);
    const size_t o_enc = place(dd), o_dec = place(dd), o_rv = place(dd), o_rvt = place(dd);
    const size_t o_mean = place(d), o_sigma = place(d), o_bits = place(d), o_unit = place(d),
                 o_dirs = place(d);
    auto* enc_t = reinterpret_cast<float*>(image + o_enc);
    auto* rv_t = reinterpret_cast<float*>(image + o_rvt);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j) {
        enc_t[static_cast<size_t>(j) * d + i] = key.encode[static_cast<size_t>(i) * d + j];
        rv_t[static_cast<size_t>(j) * d + i] = r_v[static_cast<size_t>(i) * d + j];
      }
    }
    std::memcpy(image + o_dec, key.decode, dd * 4);
    std::memcpy(image + o_rv, r_v, dd * 4);
    std::memcpy(image + o_mean, key.mean, static_cast<size_t>(d) * 4);
    std::memcpy(image + o_sigma, key.sigma, static_cast<size_t>(d) * 4);
    auto* bits = reinterpret_cast<int32_t*>(image + o_bits);
    auto* unit = reinterpret_cast<float*>(image + o_unit);
    auto* dirs = reinterpret_cast<uint32_t*>(image + o_dirs);
    TransformHeadCodec& v = views[n];
    v = TransformHeadCodec{};
    int pos = 0;
    for (int i = 0; i < d; ++i) {
      const int b = key.bits[i];
      bits[i] = b;
      // The CPU kernel's product (ProjectTransformQuery): FP32 sigma times FP32 step.
      unit[i] = b > 0 ? key.sigma[i] * static_cast<float>(TransformStep(b)) : 0.0f;
      dirs[i] = TransformDirWord(pos, b);
      pos += b;
      if (b > 0) v.coded = i + 1;
    }
    v.k_encode_t = reinterpret_cast<const float*>(base + o_enc);
    v.k_decode = reinterpret_cast<const float*>(base + o_dec);
    v.k_mean = reinterpret_cast<const float*>(base + o_mean);
    v.k_sigma = reinterpret_cast<const float*>(base + o_sigma);
    v.k_bits = reinterpret_cast<const int32_t*>(base + o_bits);
    v.k_unit = reinterpret_cast<const float*>(base + o_unit);
    v.k_dirs = reinterpret_cast<const uint32_t*>(base + o_dirs);
    v.r_v = reinterpret_cast<const float*>(base + o_rv);
    v.r_v_t = reinterpret_cast<const float*>(base + o_rvt);
    v.rho_v = heads[n].rho_v;
    v.hadamard_v = ClassifyRotation(r_v, d) == Rotation::kHadamard ? r_v[0] : 0.0f;
    v.code_bytes = key.code_bytes;
  }
  return reinterpret_cast<const TransformHeadCodec*>(base +
                                                     (reinterpret_cast<uint8_t*>(views) - image));
}

TransformPageOffsets::TransformPageOffsets(const TransformPageLayout& l)
    : num_kv_heads(l.num_kv_heads),
      page_size(l.page_size),
      head_dim(l.head_dim),
      code_bytes(l.code_bytes),
      k_codes(l.KCodes(0)),
      k_codes_head(l.KCodes(1) - l.KCodes(0)),
      k_gains(l.KGains(0)),
      k_gains_head(l.KGains(1) - l.KGains(0)),
      v_codes(l.VCodes(0)),
      v_codes_head(l.VCodes(1) - l.VCodes(0)),
      v_params(l.VParams(0)),
      v_params_head(l.VParams(1) - l.VParams(0)) {}

}  // namespace kvcd::kernels::cuda
