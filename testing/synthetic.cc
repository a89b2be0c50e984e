#include "testing/synthetic.h"

#include "proto/tensor_ref.h"

namespace kvcd::synthetic {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

int32_t Token(uint64_t seed, int64_t pos, int32_t vocab) {
  return static_cast<int32_t>(Mix(seed * 0x100000001b3ull ^ static_cast<uint64_t>(pos)) %
                              static_cast<uint64_t>(vocab));
}

std::vector<int32_t> Tokens(uint64_t seed, int64_t begin, int64_t n, int32_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = Token(seed, begin + i, vocab);
  return t;
}

float Value(uint64_t seed, int32_t layer, int64_t pos, int32_t head, int32_t dim, int kind) {
  uint64_t h =
      Mix(seed ^ (static_cast<uint64_t>(Token(seed, pos)) << 20) ^ static_cast<uint64_t>(pos));
  h = Mix(h ^ (static_cast<uint64_t>(layer) << 40) ^ (static_cast<uint64_t>(head) << 24) ^
          (static_cast<uint64_t>(dim) << 4) ^ static_cast<uint64_t>(kind));
  return static_cast<float>(static_cast<double>(h >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

std::vector<float> Kv(uint64_t seed, const v1::ModelProfile& p, int64_t begin, int64_t n,
                      int kind) {
  const int32_t hkv = p.num_kv_heads(), d = p.head_dim();
  std::vector<float> out(static_cast<size_t>(p.num_layers() * n * hkv * d));
  size_t i = 0;
  for (int32_t l = 0; l < p.num_layers(); ++l)
    for (int64_t t = 0; t < n; ++t)
      for (int32_t h = 0; h < hkv; ++h)
        for (int32_t c = 0; c < d; ++c) out[i++] = Value(seed, l, begin + t, h, c, kind);
  return out;
}

std::vector<float> Row(uint64_t seed, const v1::ModelProfile& p, int32_t layer, int64_t pos,
                       int kind) {
  const int32_t heads = kind == 2 ? p.num_q_heads() : p.num_kv_heads();
  const int32_t d = p.head_dim();
  std::vector<float> out(static_cast<size_t>(heads * d));
  for (int32_t h = 0; h < heads; ++h)
    for (int32_t c = 0; c < d; ++c) out[h * d + c] = Value(seed, layer, pos, h, c, kind);
  return out;
}

std::vector<float> Residuals(uint64_t seed, const v1::ModelProfile& p, int64_t begin, int64_t n) {
  const int32_t c = p.fsq_residual_width();
  std::vector<float> out(static_cast<size_t>(p.num_layers() * n * c));
  size_t i = 0;
  for (int32_t l = 0; l < p.num_layers(); ++l)
    for (int64_t t = 0; t < n; ++t)
      for (int32_t j = 0; j < c; ++j) out[i++] = Value(seed, l, begin + t, 0, j, 3);
  return out;
}

std::vector<float> ResidualRow(uint64_t seed, const v1::ModelProfile& p, int32_t layer,
                               int64_t pos) {
  std::vector<float> out(static_cast<size_t>(p.fsq_residual_width()));
  for (int32_t j = 0; j < p.fsq_residual_width(); ++j) out[j] = Value(seed, layer, pos, 0, j, 3);
  return out;
}

FsqCodec FsqCodecFor(const v1::ModelProfile& p, uint64_t seed) {
  FsqCodecShape s;
  s.num_layers = p.num_layers();
  s.residual_width = p.fsq_residual_width();
  s.latent_width = p.fsq_latent_width();
  s.num_kv_heads = p.num_kv_heads();
  s.head_dim = p.head_dim();
  s.key_norm = p.key_norm() == v1::KEY_NORM_RMS;
  s.key_norm_eps = p.key_norm_eps();
  return FsqCodec::Synthetic(s, seed);
}

v1::PutRequest Put(uint64_t seed, const v1::ModelProfile& p, int64_t n, const std::string& salt) {
  v1::PutRequest r;
  r.set_model(p.name());
  r.set_cache_salt(salt);
  const std::vector<int32_t> t = Tokens(seed, 0, n);
  r.mutable_tokens()->Add(t.begin(), t.end());
  const std::vector<int64_t> kv = {p.num_layers(), n, p.num_kv_heads(), p.head_dim()};
  SetBf16FromFloat(r.mutable_k(), kv, Kv(seed, p, 0, n, 0).data());
  SetBf16FromFloat(r.mutable_v(), kv, Kv(seed, p, 0, n, 1).data());
  if (p.fsq_residual_width() > 0) {
    SetBf16FromFloat(r.mutable_x(), {p.num_layers(), n, p.fsq_residual_width()},
                     Residuals(seed, p, 0, n).data());
  }
  return r;
}

}  // namespace kvcd::synthetic
