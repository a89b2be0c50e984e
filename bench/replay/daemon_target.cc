#include "bench/replay/daemon_target.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "bench/replay/reference_attention.h"
#include "proto/tensor_ref.h"

namespace kvcd::replay {

namespace {

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Runs `call`, recording its wall time under `c`.
template <typename F>
auto Timed(LatencyLog* log, Call c, F&& call) {
  const auto t0 = std::chrono::steady_clock::now();
  auto result = call();
  log->Add(c, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return result;
}

absl::Status Context(const absl::Status& s, const ReplayRequest& r, absl::string_view call) {
  return absl::Status(s.code(), absl::StrCat("request ", r.index, " (", call, "): ", s.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonTarget>> DaemonTarget::Connect(const ClientOptions& options) {
  auto c = Client::Connect(options);
  if (!c.ok()) return c.status();
  return std::unique_ptr<DaemonTarget>(new DaemonTarget(*std::move(c)));
}

std::string DaemonTarget::Describe() const {
  return absl::StrCat("daemon ", client_->options().target);
}

absl::StatusOr<int64_t> DaemonTarget::Prepare(const v1::ModelProfile& profile) {
  if (profile.history_format() != v1::HISTORY_FORMAT_BF16) {
    return absl::FailedPreconditionError(
        "the replay model must keep its history in BF16 (one page pool, so that the daemon's "
        "eviction is one LRU the simulation can follow)");
  }
  auto info = client_->RegisterModel(profile);
  if (absl::IsAlreadyExists(info.status())) info = client_->GetModel(profile.name());
  if (!info.ok()) return info.status();
  const v1::ModelProfile& p = info->profile();
  if (p.page_size() != profile.page_size() || p.num_layers() != profile.num_layers() ||
      p.num_kv_heads() != profile.num_kv_heads() || p.head_dim() != profile.head_dim() ||
      p.history_format() != v1::HISTORY_FORMAT_BF16) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", profile.name(), " is registered with another geometry (",
                     p.ShortDebugString(), "); use another --model name or a fresh daemon"));
  }
  if (info->cached_tokens() != 0 || info->active_sequences() != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model ", profile.name(), " already holds ", info->cached_tokens(), " cached tokens and ",
        info->active_sequences(),
        " open sequences; the replay compares against a simulation that starts cold: use "
        "another --model name or a fresh daemon"));
  }
  if (info->pools_size() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model ", profile.name(), " has ", info->pools_size(), " page pools, expected one"));
  }
  profile_ = p;
  return static_cast<int64_t>(info->pools(0).pages_total());
}

std::vector<uint16_t> DaemonTarget::Rows(const ReplayRequest& r, int64_t first, int64_t tokens,
                                         int kind) const {
  const int64_t ps = profile_.page_size(), layers = profile_.num_layers();
  const int64_t row = int64_t{profile_.num_kv_heads()} * profile_.head_dim();
  const int64_t full = static_cast<int64_t>(r.prompt_pages.size());
  const int64_t committed = static_cast<int64_t>(r.commit_pages.size());
  std::vector<uint16_t> bf16(static_cast<size_t>(layers * tokens * row));
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t pos = first + t;
      const int64_t page = pos / ps;
      // A full page is keyed as its tokens are (the prompt's blocks, then the commit's pages):
      // whichever request stores it, its rows are the same.
      const uint64_t seed =
          page < full ? Mix(static_cast<uint64_t>(r.prompt_pages[static_cast<size_t>(page)]))
          : page - full < committed
              ? Mix(static_cast<uint64_t>(r.commit_pages[static_cast<size_t>(page - full)]))
              : Mix(~static_cast<uint64_t>(r.index));
      uint64_t s = Mix(seed ^ Mix((static_cast<uint64_t>(pos) << 16) ^
                                  (static_cast<uint64_t>(l) << 2) ^ static_cast<uint64_t>(kind)));
      uint16_t* dst = bf16.data() + (l * tokens + t) * row;
      for (int64_t e = 0; e < row; ++e) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        // A float in [-1, 1) with 7 mantissa bits: exactly representable in BF16.
        const float f = static_cast<float>(static_cast<int64_t>(s >> 56) - 128) / 128.0f;
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        dst[e] = static_cast<uint16_t>(bits >> 16);
      }
    }
  }
  return bf16;
}

void DaemonTarget::FillKv(const ReplayRequest& r, int64_t first, int64_t tokens, int kind,
                          v1::TensorRef* out) const {
  const std::vector<uint16_t> bf16 = Rows(r, first, tokens, kind);
  SetBf16Tensor(out, {profile_.num_layers(), tokens, profile_.num_kv_heads(), profile_.head_dim()},
                bf16.data());
}

absl::Status DaemonTarget::Verify(const ReplayRequest& r, uint64_t sequence_id, int64_t seq_len,
                                  bool* wrong, std::string* detail) {
  const int hq = profile_.num_q_heads(), hkv = profile_.num_kv_heads(), d = profile_.head_dim();
  const int64_t row = int64_t{hkv} * d;
  auto as_float = [](const std::vector<uint16_t>& b, size_t begin, size_t n) {
    std::vector<float> f(n);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(b[begin + i]) << 16;
      std::memcpy(&f[i], &bits, 4);
    }
    return f;
  };
  const std::vector<uint16_t> k = Rows(r, 0, seq_len, 0), v = Rows(r, 0, seq_len, 1);
  const size_t per_layer = static_cast<size_t>(seq_len * row);
  for (int l = 0; l < profile_.num_layers(); ++l) {
    std::vector<float> q(static_cast<size_t>(hq) * d);
    uint64_t s = Mix(static_cast<uint64_t>(r.index) * 131 + static_cast<uint64_t>(l));
    for (float& x : q) {
      s = Mix(s);
      x = static_cast<float>(static_cast<int64_t>(s >> 40) - (int64_t{1} << 23)) /
          static_cast<float>(int64_t{1} << 23);
    }
    v1::AttentionDecodeRequest req;
    req.set_layer(l);
    req.add_sequence_ids(sequence_id);
    SetF32Tensor(req.mutable_q(), {1, hq, d}, q.data());
    auto got = client_->AttentionDecode(req);
    if (!got.ok()) return Context(got.status(), r, "AttentionDecode");
    const ReferenceAttention want = AttendReference(
        q, as_float(k, l * per_layer, per_layer), as_float(v, l * per_layer, per_layer), seq_len,
        hq, hkv, d, 1.0 / std::sqrt(static_cast<double>(d)));
    double worst = 0;
    for (size_t i = 0; i < want.o.size(); ++i) {
      worst =
          std::max(worst, std::abs(ElementAsFloat(got->o(), static_cast<int64_t>(i)) - want.o[i]));
    }
    for (size_t i = 0; i < want.lse.size(); ++i) {
      worst = std::max(worst,
                       std::abs(ElementAsFloat(got->lse(), static_cast<int64_t>(i)) - want.lse[i]));
    }
    const int64_t attended = got->lengths_size() == 1 ? got->lengths(0) : -1;
    // The daemon attends in float32 over BF16 rows that are exact: rounding stays far below
    // 1e-3, while one page of other rows moves the answer by about 1e-2.
    if (attended != seq_len || !(worst <= 1e-3)) {
      *wrong = true;
      *detail = absl::StrCat("request ", r.index, " layer ", l, ": attended ", attended,
                             " tokens (expected ", seq_len, "), max |diff| ", worst);
      return absl::OkStatus();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RequestOutcome> DaemonTarget::Serve(const ReplayRequest& r, bool commit,
                                                   LatencyLog* log) {
  RequestOutcome o;
  const std::string& model = profile_.name();
  const int64_t ps = profile_.page_size();
  auto match = Timed(log, Call::kMatch, [&] { return client_->Match(model, "", r.prompt); });
  if (!match.ok()) return Context(match.status(), r, "Match");
  o.matched_tokens = match->matched_tokens();
  o.committed_tokens = match->committed_tokens();
  const int64_t full = static_cast<int64_t>(r.prompt_pages.size()) * ps;
  if (o.matched_tokens < full) {
    v1::PutRequest put;
    put.set_model(model);
    put.mutable_tokens()->Add(r.prompt.begin(), r.prompt.begin() + full);
    put.set_kv_first_token(o.matched_tokens);
    FillKv(r, o.matched_tokens, full - o.matched_tokens, 0, put.mutable_k());
    FillKv(r, o.matched_tokens, full - o.matched_tokens, 1, put.mutable_v());
    auto put_r = Timed(log, Call::kPut, [&] { return client_->Put(put); });
    if (!put_r.ok()) return Context(put_r.status(), r, "Put");
    o.inserted_tokens = put_r->inserted_tokens();
  }
  auto open = Timed(log, Call::kOpen, [&] { return client_->OpenSequence(model, "", r.prompt); });
  if (!open.ok()) return Context(open.status(), r, "OpenSequence");
  o.opened_tokens = open->matched_tokens();
  // The prompt's tail past the opened prefix, then the output: one Append.
  const int64_t seq_len = static_cast<int64_t>(r.prompt.size()) + r.output_tokens;
  std::vector<int32_t> rest(r.prompt.begin() + o.opened_tokens, r.prompt.end());
  rest.insert(rest.end(), r.append.end() - r.output_tokens, r.append.end());
  absl::Status failed;
  if (!rest.empty()) {
    v1::AppendRequest app;
    app.set_sequence_id(open->sequence_id());
    app.mutable_tokens()->Add(rest.begin(), rest.end());
    const int64_t first = seq_len - static_cast<int64_t>(rest.size());
    FillKv(r, first, static_cast<int64_t>(rest.size()), 0, app.mutable_k());
    FillKv(r, first, static_cast<int64_t>(rest.size()), 1, app.mutable_v());
    auto len = Timed(log, Call::kAppend, [&] { return client_->Append(app); });
    if (!len.ok()) {
      failed = Context(len.status(), r, "Append");
    } else if (*len != seq_len) {
      failed = absl::InternalError(absl::StrCat("request ", r.index, ": the sequence holds ", *len,
                                                " tokens after Append, expected ", seq_len));
    }
  }
  if (failed.ok() && verify_every_ > 0 && r.index % verify_every_ == 0) {
    o.checked = true;
    failed = Verify(r, open->sequence_id(), seq_len, &o.wrong, &o.wrong_detail);
  }
  auto closed =
      Timed(log, Call::kClose, [&] { return client_->CloseSequence(open->sequence_id(), commit); });
  if (!failed.ok()) return failed;
  if (!closed.ok()) return Context(closed.status(), r, "CloseSequence");
  // A daemon that does not serve commits answers without `commit`.
  o.commit_served = commit && closed->has_commit();
  o.commit_inserted_pages = closed->commit().inserted_pages();
  o.commit_deduplicated_pages = closed->commit().deduplicated_pages();
  return o;
}

absl::StatusOr<TargetStats> DaemonTarget::Stats() {
  auto s = client_->Stats();
  if (!s.ok()) return s.status();
  TargetStats t;
  t.evicted_pages = static_cast<int64_t>(s->evicted_pages());
  t.evicted_pages_committed = static_cast<int64_t>(s->evicted_pages_committed());
  t.committed_pages = static_cast<int64_t>(s->committed_pages());
  t.hit_tokens_committed = static_cast<int64_t>(s->hit_tokens_committed());
  for (const auto& m : s->models()) {
    if (m.profile().name() == profile_.name())
      t.cached_tokens = static_cast<int64_t>(m.cached_tokens());
  }
  return t;
}

}  // namespace kvcd::replay
