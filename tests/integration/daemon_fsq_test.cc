// Integration: an FSQ model in the real kvcd binary on a loopback port, driven by the real
// client: registered with a codec blob, Put and Append with residuals, the per-layer decode
// loop with x_new, FetchPages, and a prompt put in chunks.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/decode_channel.h"
#include "common/fsq_codec.h"
#include "daemon_process.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/fsq.h"
#include "kvcd/kernels/reference_attention.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"
#include "tiny_daemon_fixture.h"

namespace kvcd {
namespace daemon_fsq_test {

using testing_util::DaemonProcess;

using kernels::RoundBf16;

class DaemonFsqTest : public testing_util::TinyDaemonTest {
 protected:
  void SetUp() override { StartDaemon(testing_util::kTinyDaemonConfig); }

  // "tiny-fsq": the tiny model's shape (2 layers, 4 q / 2 kv heads, d 16, page 4) with FSQ
  // history (C 24, G 9), key norm and interleaved RoPE on 12 dims.
  v1::ModelProfile FsqProfile() const {
    v1::ModelProfile p = profile_;
    p.set_name("tiny-fsq");
    p.set_history_format(v1::HISTORY_FORMAT_FSQ);
    p.set_memory_bytes(1 << 20);
    p.set_bf16_fraction(0.5);
    p.set_fsq_residual_width(24);
    p.set_fsq_latent_width(9);
    p.set_key_norm(v1::KEY_NORM_RMS);
    p.set_key_norm_eps(1e-5f);
    p.mutable_rope()->set_theta(10000.0);
    p.mutable_rope()->set_rotary_dims(12);
    p.mutable_rope()->set_pairing(v1::ROPE_PAIRING_INTERLEAVED);
    return p;
  }
};

// An FSQ model served end to end by the real daemon: registered with a codec blob, Put
// and Append with residuals, the per-layer decode loop with x_new (demoting a window page
// on the way), FetchPages as stored and expanded, all against a reference the test
// computes from the same codec with the kernels' encoder and oracle; and the bad inputs
// (each INVALID_ARGUMENT naming the field, nothing stored changes).
TEST_F(DaemonFsqTest, ServesCodesEndToEnd) {
  const v1::ModelProfile p = FsqProfile();
  const int L = p.num_layers(), hq = p.num_q_heads(), hkv = p.num_kv_heads(), d = p.head_dim();
  const int C = p.fsq_residual_width(), ps = p.page_size();
  const FsqCodec codec = synthetic::FsqCodecFor(p, 5);
  kernels::RopeSpec rope;
  rope.theta = 10000.0;
  rope.rotary_dims = 12;
  rope.pairing = kernels::RopePairing::kInterleaved;

  // Registration: no codec, and a codec whose G is not the profile's.
  auto bad = client_->RegisterModel(p);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("needs its codec"), std::string::npos) << bad.status();
  FsqCodecShape g8 = codec.shape();
  g8.latent_width = 8;
  bad = client_->RegisterModel(p, FsqCodec::Synthetic(g8, 5).ToSafetensors().Serialize());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("metadata 'latent_width' is '8', expected 9"),
            std::string::npos)
      << bad.status();
  auto info = client_->RegisterModel(p, codec.ToSafetensors().Serialize());
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->pools_size(), 2);
  EXPECT_EQ(info->pools(0).format(), "bf16+fsq");
  EXPECT_EQ(info->pools(1).format(), "fsq");
  EXPECT_EQ(info->profile().fsq_latent_width(), 9);
  EXPECT_EQ(info->profile().rope().pairing(), v1::ROPE_PAIRING_INTERLEAVED);
  EXPECT_DOUBLE_EQ(info->bytes_per_token_history(), 2.0 * 5);  // 2 layers x ceil(9/2) bytes

  // The reference: what every token of the test is (K/V as sent, BF16; residuals as sent,
  // BF16, and their codes).
  const uint64_t seed = 41;
  const int64_t total = 45;
  std::vector<std::vector<float>> kw(L), vw(L), xs(L);  // [l][t][...]
  for (int l = 0; l < L; ++l) {
    for (int64_t t = 0; t < total; ++t) {
      for (float e : synthetic::Row(seed, p, l, t, 0)) kw[l].push_back(RoundBf16(e));
      for (float e : synthetic::Row(seed, p, l, t, 1)) vw[l].push_back(RoundBf16(e));
      for (float e : synthetic::ResidualRow(seed, p, l, t)) xs[l].push_back(RoundBf16(e));
    }
  }
  const int64_t cb = kernels::FsqCodeBytes(9);
  auto code_of = [&](int l, int64_t t) {
    std::vector<uint8_t> c(static_cast<size_t>(cb));
    kernels::FsqEncodeRows(codec.Layer(l), xs[l].data() + t * C, 1, c.data());
    return c;
  };
  // K/V of token t at layer l as the daemon holds it (history: rebuilt from the code).
  auto kv_of = [&](int l, int64_t t, bool history, float* k, float* v) {
    if (!history) {
      std::copy_n(kw[l].begin() + t * hkv * d, hkv * d, k);
      std::copy_n(vw[l].begin() + t * hkv * d, hkv * d, v);
      return;
    }
    const auto c = code_of(l, t);
    kernels::FsqExpandToken(codec.Layer(l), rope, c.data(), t, k, v);
  };
  // Pages past the sink are history when put (pages 1..7) or once they left the window.
  const int64_t put_tokens = 32, recent = p.recent_tokens();
  auto is_history = [&](int64_t t, int64_t len) {
    const int64_t page = t / ps;
    return page >= 1 && (page * ps < put_tokens || (page + 1) * ps <= len - recent);
  };

  // Bad Puts: each refused with the field and the expected value named; nothing stored.
  struct BadPut {
    const char* name;
    std::function<void(v1::PutRequest*)> mutate;
    const char* needle;
  };
  const std::vector<BadPut> bad_puts = {
      {"no residuals", [](v1::PutRequest* r) { r->clear_x(); }, "x is missing"},
      {"wrong width",
       [&](v1::PutRequest* r) {
         std::vector<float> x(static_cast<size_t>(L * put_tokens * (C + 1)), 0.5f);
         SetF32Tensor(r->mutable_x(), {L, put_tokens, C + 1}, x.data());
       },
       "expected [2, 32, 24]"},
      {"wrong tokens",
       [&](v1::PutRequest* r) {
         std::vector<float> x(static_cast<size_t>(L * 8 * C), 0.5f);
         SetF32Tensor(r->mutable_x(), {L, 8, C}, x.data());
       },
       "expected [2, 32, 24]"},
      {"nan",
       [&](v1::PutRequest* r) {
         std::vector<float> x = synthetic::Residuals(seed, p, 0, put_tokens);
         x[static_cast<size_t>((1 * put_tokens + 30) * C + 7)] = std::nanf("");
         SetF32Tensor(r->mutable_x(), {L, put_tokens, C}, x.data());
       },
       "x[1, 30, 7] is nan, expected finite"},
      {"inf",
       [&](v1::PutRequest* r) {
         std::vector<float> x = synthetic::Residuals(seed, p, 0, put_tokens);
         x[3] = INFINITY;
         SetBf16FromFloat(r->mutable_x(), {L, put_tokens, C}, x.data());
       },
       "x[0, 0, 3] is inf"},
      {"dtype", [&](v1::PutRequest* r) { r->mutable_x()->set_dtype(v1::DTYPE_U8); },
       "x.dtype is U8, expected one of BF16, F32"},
  };
  const auto put_tk = synthetic::Tokens(seed, 0, put_tokens);
  for (const BadPut& b : bad_puts) {
    auto r = synthetic::Put(seed, p, put_tokens);
    b.mutate(&r);
    auto s = client_->Put(r);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << b.name;
    EXPECT_NE(s.status().message().find(b.needle), std::string::npos)
        << b.name << ": " << s.status();
    EXPECT_EQ(client_->Match("tiny-fsq", "", put_tk)->matched_tokens(), 0) << b.name;
  }
  // Residuals for a model that is not FSQ.
  auto plain = synthetic::Put(seed, profile_, 8);
  std::vector<float> x8(static_cast<size_t>(L * 8 * C), 0.5f);
  SetF32Tensor(plain.mutable_x(), {L, 8, C}, x8.data());
  auto refused = client_->Put(plain);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("x is set, expected it absent"), std::string::npos)
      << refused.status();
  EXPECT_EQ(client_->Match("tiny", "", synthetic::Tokens(seed, 0, 8))->matched_tokens(), 0);

  auto put = client_->Put(synthetic::Put(seed, p, put_tokens));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->inserted_tokens(), put_tokens);
  const auto tokens = synthetic::Tokens(seed, 0, 38);
  auto open = client_->OpenSequence("tiny-fsq", "", tokens, 60000);
  ASSERT_TRUE(open.ok()) << open.status();
  ASSERT_EQ(open->matched_tokens(), put_tokens);
  const uint64_t id = open->sequence_id();

  // Append 6 tokens: refused without residuals (length unchanged), then with them.
  v1::AppendRequest app;
  app.set_sequence_id(id);
  app.mutable_tokens()->Add(tokens.begin() + put_tokens, tokens.end());
  SetBf16FromFloat(app.mutable_k(), {L, 6, hkv, d},
                   synthetic::Kv(seed, p, put_tokens, 6, 0).data());
  SetBf16FromFloat(app.mutable_v(), {L, 6, hkv, d},
                   synthetic::Kv(seed, p, put_tokens, 6, 1).data());
  auto len = client_->Append(app);
  EXPECT_EQ(len.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(len.status().message().find("x is missing"), std::string::npos) << len.status();
  SetBf16FromFloat(app.mutable_x(), {L, 6, C}, synthetic::Residuals(seed, p, put_tokens, 6).data());
  len = client_->Append(app);
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, 38);

  // The per-layer decode loop, 7 tokens, so page 8 leaves the recent window and is demoted
  // (its codes were computed at Append): even positions over a stream, odd ones over the
  // shared-memory decode channel (x_new travels both ways). Every call against the reference.
  auto stream = client_->OpenDecodeStream();
  ASSERT_TRUE(stream.ok());
  auto channel = DecodeChannel::Open(client_.get(), 1 << 16, 60000);
  ASSERT_TRUE(channel.ok()) << channel.status();
  std::vector<float> kr(static_cast<size_t>(total * hkv * d)), vr(kr.size());
  for (int64_t pos = 38; pos < total; ++pos) {
    for (int l = 0; l < L; ++l) {
      v1::AttentionDecodeRequest r;
      r.set_layer(l);
      r.add_sequence_ids(id);
      const auto q = synthetic::Row(seed, p, l, pos, 2);
      SetF32Tensor(r.mutable_q(), {1, hq, d}, q.data());
      SetBf16FromFloat(r.mutable_k_new(), {1, hkv, d}, synthetic::Row(seed, p, l, pos, 0).data());
      SetBf16FromFloat(r.mutable_v_new(), {1, hkv, d}, synthetic::Row(seed, p, l, pos, 1).data());
      r.add_new_tokens(synthetic::Token(seed, pos));
      if (pos == 38 && l == 0) {  // without x_new: refused, nothing appended
        auto e = (*stream)->Call(r);
        EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_NE(e.status().message().find("x_new is missing"), std::string::npos) << e.status();
        auto wrong = r;
        std::vector<float> xw(static_cast<size_t>(C - 1), 0.1f);
        SetF32Tensor(wrong.mutable_x_new(), {1, C - 1}, xw.data());
        e = (*stream)->Call(wrong);
        EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_NE(e.status().message().find("expected [1, 24]"), std::string::npos) << e.status();
      }
      if (pos == 39 && l == 0) {  // the same refusal over the channel
        auto e = (*channel)->Call(r);
        EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_NE(e.status().message().find("x_new is missing"), std::string::npos) << e.status();
      }
      SetBf16FromFloat(r.mutable_x_new(), {1, C}, synthetic::ResidualRow(seed, p, l, pos).data());
      auto a = pos % 2 == 0 ? (*stream)->Call(r) : (*channel)->Call(r);
      ASSERT_TRUE(a.ok()) << "pos " << pos << " layer " << l << ": " << a.status();
      ASSERT_EQ(a->lengths(0), pos + 1);
      // Demotion happens when the token is committed, i.e. in the last layer's call.
      const int64_t committed = l + 1 == L ? pos + 1 : pos;
      for (int64_t t = 0; t <= pos; ++t) {
        kv_of(l, t, is_history(t, committed), kr.data() + t * hkv * d, vr.data() + t * hkv * d);
      }
      std::vector<double> ro(static_cast<size_t>(hq * d)), rl(static_cast<size_t>(hq));
      kernels::ReferenceAttention(q.data(), kr.data(), vr.data(), pos + 1, hq, hkv, d,
                                  1.0 / std::sqrt(16.0), ro.data(), rl.data());
      for (int i = 0; i < hq * d; ++i) {
        ASSERT_NEAR(ElementAsFloat(a->o(), i), ro[static_cast<size_t>(i)], 1e-3)
            << "pos " << pos << " layer " << l << " i " << i;
      }
      for (int h = 0; h < hq; ++h) {
        ASSERT_NEAR(ElementAsFloat(a->lse(), h), rl[static_cast<size_t>(h)], 1e-3);
      }
    }
  }
  EXPECT_TRUE((*stream)->Close().ok());
  EXPECT_TRUE((*channel)->Close().ok());
  auto after = client_->GetModel("tiny-fsq");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->demoted_pages(), 1u);

  // FetchPages as stored: page 0 and the window keep BF16 K/V with codes beside them, the
  // history only codes, all equal to the reference encoder's.
  v1::FetchPagesRequest f;
  f.set_sequence_id(id);
  auto stored = client_->FetchPages(f);
  ASSERT_TRUE(stored.ok()) << stored.status();
  ASSERT_EQ(stored->pages_size(), 12);  // 45 tokens
  const int64_t kv_bytes = 2 * 2 * hkv * ps * d;
  for (int pg = 0; pg < 12; ++pg) {
    const auto& page = stored->pages(pg);
    const bool history = is_history(pg * ps, total);
    EXPECT_EQ(page.format(), history ? "fsq" : "bf16+fsq") << "page " << pg;
    const int64_t layer_bytes = static_cast<int64_t>(page.data().size()) / L;
    EXPECT_EQ(layer_bytes, (history ? 0 : kv_bytes) + ps * cb);
    for (int l = 0; l < L; ++l) {
      for (int s = 0; s < page.num_tokens(); ++s) {
        const auto want = code_of(l, pg * ps + s);
        const std::string got = page.data().substr(
            static_cast<size_t>(l * layer_bytes + (history ? 0 : kv_bytes) + s * cb),
            static_cast<size_t>(cb));
        EXPECT_EQ(got, std::string(want.begin(), want.end())) << "page " << pg << " l " << l;
      }
    }
  }
  // Expanded: BF16 of the reference K/V.
  f.set_expand_to_bf16(true);
  auto expanded = client_->FetchPages(f);
  ASSERT_TRUE(expanded.ok()) << expanded.status();
  std::vector<float> k1(static_cast<size_t>(hkv * d)), v1(k1.size());
  for (int l = 0; l < L; ++l) {
    for (int64_t t = 0; t < total; ++t) {
      kv_of(l, t, is_history(t, total), k1.data(), v1.data());
      for (int i = 0; i < hkv * d; ++i) {
        const int64_t at = (l * total + t) * hkv * d + i;
        ASSERT_EQ(ElementAsFloat(expanded->k(), at), RoundBf16(k1[static_cast<size_t>(i)]))
            << "l " << l << " t " << t;
        ASSERT_EQ(ElementAsFloat(expanded->v(), at), RoundBf16(v1[static_cast<size_t>(i)]));
      }
    }
  }
  ASSERT_TRUE(client_->CloseSequence(id).ok());
}

// A prompt put in two chunks through kv_first_token (kvcd_prefill_worker --mode put's path
// for FSQ models: at scale their x does not fit one message) stores what one Put stores:
// [0, 16), then [16, 32) carrying only that chunk's K, V and x.
TEST_F(DaemonFsqTest, ChunkedPutStoresWhatOnePutStores) {
  const v1::ModelProfile p = FsqProfile();
  const int L = p.num_layers(), hkv = p.num_kv_heads(), d = p.head_dim();
  const int C = p.fsq_residual_width(), ps = p.page_size();
  auto info = client_->RegisterModel(p, synthetic::FsqCodecFor(p, 5).ToSafetensors().Serialize());
  ASSERT_TRUE(info.ok()) << info.status();
  const int64_t put_tokens = 32;
  const uint64_t seed2 = 43;
  const int64_t half = put_tokens / 2;
  ASSERT_TRUE(client_->Put(synthetic::Put(seed2, p, half, "chunked")).ok());
  auto second = synthetic::Put(seed2, p, put_tokens, "chunked");
  second.set_kv_first_token(half);
  SetBf16FromFloat(second.mutable_k(), {L, half, hkv, d},
                   synthetic::Kv(seed2, p, half, half, 0).data());
  SetBf16FromFloat(second.mutable_v(), {L, half, hkv, d},
                   synthetic::Kv(seed2, p, half, half, 1).data());
  SetBf16FromFloat(second.mutable_x(), {L, half, C},
                   synthetic::Residuals(seed2, p, half, half).data());
  auto put2 = client_->Put(second);
  ASSERT_TRUE(put2.ok()) << put2.status();
  EXPECT_EQ(put2->cached_tokens(), half);
  EXPECT_EQ(put2->inserted_tokens(), half);
  ASSERT_TRUE(client_->Put(synthetic::Put(seed2, p, put_tokens, "whole")).ok());
  std::string stored_pages[2];
  for (int w = 0; w < 2; ++w) {
    auto o = client_->OpenSequence("tiny-fsq", w == 0 ? "chunked" : "whole",
                                   synthetic::Tokens(seed2, 0, put_tokens), 60000);
    ASSERT_TRUE(o.ok()) << o.status();
    ASSERT_EQ(o->matched_tokens(), put_tokens) << w;
    v1::FetchPagesRequest fetch;
    fetch.set_sequence_id(o->sequence_id());
    auto got = client_->FetchPages(fetch);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->pages_size(), put_tokens / ps) << w;
    for (const auto& pg : got->pages()) stored_pages[w] += pg.format() + pg.data();
    ASSERT_TRUE(client_->CloseSequence(o->sequence_id()).ok());
  }
  EXPECT_TRUE(stored_pages[0] == stored_pages[1])  // bytes: compared whole, not printed
      << stored_pages[0].size() << " bytes chunked, " << stored_pages[1].size() << " in one Put";
}

}  // namespace daemon_fsq_test
}  // namespace kvcd
