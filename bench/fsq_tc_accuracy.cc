// The tensor-core FSQ encoder's accuracy, measured on the CPU through its scalar reference
// (fsq_tc.h FsqEncodeRowsTcReference): for each operand kind, the fraction of codes that
// differ from the float64 encoder's (FsqEncodeRows), how many differ by more than one
// step, the rounding error of the latents (sum of (u~ - z)^2 against the float64 encoder's
// codes), and the effect on attention. Attention is the float64 oracle over the same tokens
// with either encoder's codes, one Qwen3-8B layer: 32 q / 8 KV heads, d 128, key norm,
// half RoPE over 128 dims, positions from 100000. The codec and residuals use the
// synthetic scales: E ~ N(0, 4/C), e ~ N(0, 0.01), x ~ N(0, 1) with every 61st channel at
// 8x, BF16 as a worker sends it (or F32).
//
//   fsq_tc_accuracy [--tokens 512] [--latents 256,84] [--attention-tokens 512] [--f32]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/fsq.h"
#include "kvcd/kernels/fsq_tc.h"

ABSL_FLAG(int, tokens, 512, "tokens encoded per latent width");
ABSL_FLAG(std::string, latents, "256,84", "latent widths G, comma-separated");
ABSL_FLAG(int, attention_tokens, 512, "tokens attended over (at most --tokens)");
ABSL_FLAG(bool, f32, false, "F32 residuals instead of BF16");

namespace kk = kvcd::kernels;

namespace {

constexpr int kC = 4096, kHq = 32, kHkv = 8, kD = 128, kPs = 64;

// The float64 oracle's attention over n tokens of `codes` (pages of kPs tokens, in order):
// o [kHq][kD], lse [kHq].
void Attend(const kk::FsqLayerCodec& c, const std::vector<uint8_t>& codes, int n,
            const std::vector<float>& q, std::vector<float>* o, std::vector<float>* lse) {
  const int pages = (n + kPs - 1) / kPs, group = kHq / kHkv;
  std::vector<int32_t> ids(pages);
  for (int i = 0; i < pages; ++i) ids[i] = i;
  kk::RopeSpec rope;
  rope.theta = 1000000.0;
  rope.rotary_dims = kD;
  kk::FsqPageTable t;
  t.base = codes.data();
  t.page_stride = kPs * kk::FsqCodeBytes(c.latent_width);
  t.page_ids = ids.data();
  t.num_pages = pages;
  t.page_size = kPs;
  t.first_position = 100000;
  o->assign(kHq * kD, 0.0f);
  lse->assign(kHq, 0.0f);
  for (int h = 0; h < kHkv; ++h) {
    kk::AttendFsqPagesReference(t, c, rope, h, q.data() + h * group * kD, group,
                                1.0f / std::sqrt(static_cast<float>(kD)), 0, n,
                                o->data() + h * group * kD, lse->data() + h * group);
  }
}

// The same attention over the unrounded latents u~ [n][G] (keys W_k u~ + b_k, key norm,
// RoPE; values W_v u~ + b_v), in float64: what the codes' own rounding changes.
void AttendUnrounded(const kk::FsqLayerCodec& c, const std::vector<double>& ut, int n,
                     const std::vector<float>& q, std::vector<float>* o, std::vector<float>* lse) {
  const int G = c.latent_width, group = kHq / kHkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  o->assign(kHq * kD, 0.0f);
  lse->assign(kHq, 0.0f);
  std::vector<double> k(static_cast<size_t>(n) * kD), v(static_cast<size_t>(n) * kD);
  for (int h = 0; h < kHkv; ++h) {
    for (int t = 0; t < n; ++t) {
      const double* z = ut.data() + static_cast<size_t>(t) * G;
      double* kt = k.data() + static_cast<size_t>(t) * kD;
      double* vt = v.data() + static_cast<size_t>(t) * kD;
      double ss = 0;
      for (int i = 0; i < kD; ++i) {
        const int64_t row = int64_t{h} * kD + i;
        double a = c.bias_k[row], b = c.bias_v[row];
        for (int g = 0; g < G; ++g) {
          a += static_cast<double>(c.decoder_k[row * G + g]) * z[g];
          b += static_cast<double>(c.decoder_v[row * G + g]) * z[g];
        }
        kt[i] = a;
        vt[i] = b;
        ss += a * a;
      }
      const double inv = 1.0 / std::sqrt(ss / kD + static_cast<double>(c.key_norm_eps));
      for (int i = 0; i < kD; ++i) kt[i] *= inv * c.key_norm[i];
      const double p = 100000.0 + t;  // half pairing over all kD dims, theta 1e6
      for (int i = 0; i < kD / 2; ++i) {
        const double ang = p * std::pow(1000000.0, -2.0 * i / kD);
        const double x0 = kt[i], x1 = kt[i + kD / 2];
        kt[i] = x0 * std::cos(ang) - x1 * std::sin(ang);
        kt[i + kD / 2] = x0 * std::sin(ang) + x1 * std::cos(ang);
      }
    }
    for (int j = 0; j < group; ++j) {
      const float* qr = q.data() + (h * group + j) * kD;
      std::vector<double> s(static_cast<size_t>(n));
      double m = -1e300;
      for (int t = 0; t < n; ++t) {
        double d = 0;
        for (int i = 0; i < kD; ++i)
          d += static_cast<double>(qr[i]) * k[static_cast<size_t>(t) * kD + i];
        s[static_cast<size_t>(t)] = d * scale;
        m = std::max(m, d * scale);
      }
      double sum = 0;
      std::vector<double> acc(kD, 0.0);
      for (int t = 0; t < n; ++t) {
        const double w = std::exp(s[static_cast<size_t>(t)] - m);
        sum += w;
        for (int i = 0; i < kD; ++i) acc[i] += w * v[static_cast<size_t>(t) * kD + i];
      }
      for (int i = 0; i < kD; ++i)
        (*o)[(h * group + j) * kD + i] = static_cast<float>(acc[i] / sum);
      (*lse)[h * group + j] = static_cast<float>(m + std::log(sum));
    }
  }
}

// Relative L2 of a against b, and max |a_lse - b_lse|.
void Compare(const std::vector<float>& a, const std::vector<float>& al, const std::vector<float>& b,
             const std::vector<float>& bl, double* rel, double* dl) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err += std::pow(double{a[i]} - b[i], 2);
    norm += std::pow(double{b[i]}, 2);
  }
  *rel = std::sqrt(err / norm);
  *dl = 0;
  for (size_t i = 0; i < al.size(); ++i) *dl = std::max(*dl, std::fabs(double{al[i]} - bl[i]));
}

}  // namespace

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {
      .name = "fsq_tc_accuracy",
      .summary = "the tensor-core FSQ encoder's code differences and their effect on attention",
      .files = {__FILE__},
      .synopsis = "[--tokens N] [--latents 256,84] [--attention-tokens N] [--f32]"};
  kvcd::cli::Parse(program, argc, argv);
  const int tokens = absl::GetFlag(FLAGS_tokens);
  const int attn = std::min(absl::GetFlag(FLAGS_attention_tokens), tokens);
  const bool f32 = absl::GetFlag(FLAGS_f32);
  std::vector<int> latents;
  for (const absl::string_view s :
       absl::StrSplit(absl::GetFlag(FLAGS_latents), ',', absl::SkipEmpty())) {
    latents.push_back(std::atoi(std::string(s).c_str()));
  }
  std::printf("C %d, %d tokens, %s residuals; attention over %d tokens (float64 oracle)\n", kC,
              tokens, f32 ? "F32" : "BF16", attn);
  std::printf(
      "| G | operands | codes differing | by > 1 step | latent rounding error vs exact codes | "
      "o vs exact codes: rel. L2, max abs dlse | o vs unrounded latents: rel. L2 |\n"
      "|---|---|---|---|---|---|---|\n");
  for (const int G : latents) {
    std::mt19937 rng(1000u + G);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> e(static_cast<size_t>(G) * kC), eb(G), x(static_cast<size_t>(tokens) * kC);
    for (auto& v : e) v = normal(rng) * 2.0f / std::sqrt(static_cast<float>(kC));
    for (auto& v : eb) v = 0.1f * normal(rng);
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = normal(rng) * ((i % kC) % 61 == 3 ? 8.0f : 1.0f);
      if (!f32) x[i] = kk::Bf16ToFloat(kk::FloatToBf16(x[i]));
    }
    std::vector<float> wk(kHkv * kD * G), wv(kHkv * kD * G), bk(kHkv * kD), bv(kHkv * kD), kn(kD);
    for (auto& v : wk) v = normal(rng) / std::sqrt(static_cast<float>(G));
    for (auto& v : wv) v = normal(rng) / std::sqrt(static_cast<float>(G));
    for (auto& v : bk) v = 0.1f * normal(rng);
    for (auto& v : bv) v = 0.1f * normal(rng);
    for (auto& v : kn) v = 1.0f + 0.1f * normal(rng);
    std::vector<float> q(kHq * kD);
    for (auto& v : q) v = 2.0f * normal(rng);
    kk::FsqLayerCodec c{};
    c.residual_width = kC;
    c.latent_width = G;
    c.num_kv_heads = kHkv;
    c.head_dim = kD;
    c.encoder = e.data();
    c.encoder_bias = eb.data();
    c.decoder_k = wk.data();
    c.decoder_v = wv.data();
    c.bias_k = bk.data();
    c.bias_v = bv.data();
    c.key_norm = kn.data();
    const int64_t cb = kk::FsqCodeBytes(G);
    // Whole pages for the attention's page table (tokens past `tokens` stay zero codes).
    const int64_t padded = (int64_t{tokens} + kPs - 1) / kPs * kPs;
    std::vector<uint8_t> exact(padded * cb, 0x88), tc(padded * cb, 0x88);
    kk::FsqEncodeRows(c, x.data(), tokens, exact.data());
    // u~ = h tanh(u + atanh(delta / h)) - delta of every latent, from the float64 sum.
    std::vector<double> ut(static_cast<size_t>(tokens) * G);
    const double shift = std::atanh(kk::kFsqDelta / kk::kFsqH);
    for (int t = 0; t < tokens; ++t) {
      for (int g = 0; g < G; ++g) {
        double u = eb[g];
        for (int i = 0; i < kC; ++i)
          u += static_cast<double>(e[int64_t{g} * kC + i]) * x[int64_t{t} * kC + i];
        ut[static_cast<size_t>(t) * G + g] = kk::kFsqH * std::tanh(u + shift) - kk::kFsqDelta;
      }
    }
    std::vector<float> o_exact, l_exact, o, l, o_un, l_un;
    Attend(c, exact, attn, q, &o_exact, &l_exact);
    AttendUnrounded(c, ut, attn, q, &o_un, &l_un);
    double rel_fsq = 0, dl_fsq = 0;
    Compare(o_exact, l_exact, o_un, l_un, &rel_fsq, &dl_fsq);
    std::printf("| %d | float64 (exact) | 0 | 0 | 0 | 0 | %.2e (max abs dlse %.1e) |\n", G, rel_fsq,
                dl_fsq);
    for (const kk::FsqTcOperands ops :
         {kk::FsqTcOperands::kBf16, kk::FsqTcOperands::kFp16, kk::FsqTcOperands::kBf16Split}) {
      kk::FsqEncodeRowsTcReference(c, x.data(), tokens, ops, tc.data());
      int64_t differ = 0, far = 0;
      double sq_exact = 0, sq_tc = 0;  // sum (u~ - z)^2
      std::vector<int8_t> za(G), zb(G);
      for (int t = 0; t < tokens; ++t) {
        kk::FsqUnpackCode(exact.data() + t * cb, G, za.data());
        kk::FsqUnpackCode(tc.data() + t * cb, G, zb.data());
        for (int g = 0; g < G; ++g) {
          differ += za[g] != zb[g];
          far += std::abs(za[g] - zb[g]) > 1;
          const double v = ut[static_cast<size_t>(t) * G + g];
          sq_exact += (v - za[g]) * (v - za[g]);
          sq_tc += (v - zb[g]) * (v - zb[g]);
        }
      }
      Attend(c, tc, attn, q, &o, &l);
      double rel = 0, dl = 0, rel_un = 0, dl_un = 0;
      Compare(o, l, o_exact, l_exact, &rel, &dl);
      Compare(o, l, o_un, l_un, &rel_un, &dl_un);
      const char* name = ops == kk::FsqTcOperands::kBf16   ? "BF16"
                         : ops == kk::FsqTcOperands::kFp16 ? "FP16"
                                                           : "split BF16";
      std::printf(
          "| %d | %s | %lld of %lld (%.4f%%) | %lld | %+.2e relative | %.2e, %.1e | %.2e |\n", G,
          name, static_cast<long long>(differ), static_cast<long long>(int64_t{tokens} * G),
          100.0 * differ / (int64_t{tokens} * G), static_cast<long long>(far),
          sq_tc / sq_exact - 1.0, rel, dl, rel_un);
    }
  }
  return 0;
}
