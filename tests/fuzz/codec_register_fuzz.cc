// Fuzzes RegisterModel with a codec file a client uploads (codec_blob): the whole path from
// the bytes to a served model (safetensors, the format registry, CodecProfile,
// KeyTransformProfile, FsqCodec), on an in-process CacheEngine with the CPU backend.
//
// Input: [format u8][codec file bytes, at most 1 MiB]. Bit 0 of the first byte picks the
// history format of a small model (layers 2, KV heads 1, head_dim 8): int2-oscar (a
// version-1 file, or a version-3 transform file by its kvcd.codec_version) or fsq
// (residual width 16, latent width 8; bit 1: key_norm rms).
//
// Checked beyond what ASan/UBSan catch:
//   - RegisterModel answers OK or INVALID_ARGUMENT, in at most 600 bytes (strings from the
//     file are quoted bounded), and a refused file leaves no model behind;
//   - a model that registered serves a Put and a Fetch with a documented code; with a
//     version-1 INT2 file (orthogonal, finite rotations), K/V of N(0,1) and of N(0,1)·1e6
//     come back finite (issue #35.1 and #35.2: no NaN rotation, no overflowing FP16 scale).
//     Version-3 and FSQ files carry free matrices whose products may overflow by design;
//     only their codes are checked.
//
// KVCD_FUZZ_VERBOSE=1 prints each registration's and fetch's status (to read a reproducer).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "kvcd/kernels/bf16.h"
#include "server/backends/backend.h"
#include "server/engine/cache_engine.h"
#include "server/engine/model_profile.h"
#include "server/formats/model_spec.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace {

constexpr size_t kMaxCodecBytes = 1 << 20;

std::unique_ptr<CacheEngine> NewEngine() {
  ServerConfig config;
  config.memory_budget_bytes = 256 << 20;  // 16 models of two 2 MiB pools, and room
  config.compute_threads = 1;
  config.max_sequences = 16;
  return std::make_unique<CacheEngine>(config, MakeCpuBackend(1));
}

v1::ModelProfile Profile(const std::string& name, uint8_t selector) {
  ModelSpec s;
  s.name = name;
  s.num_layers = 2;
  s.num_q_heads = 2;
  s.num_kv_heads = 1;
  s.head_dim = 8;
  s.page_size = 4;
  s.sink_tokens = 4;
  s.recent_tokens = 4;
  s.memory_bytes = 64 << 10;
  if ((selector & 1) == 0) {
    s.history_format = FormatId::kInt2Oscar;
  } else {
    s.history_format = FormatId::kFsq;
    s.fsq_residual_width = 16;
    s.fsq_latent_width = 8;
    s.key_norm = (selector & 2) != 0;
  }
  v1::ModelProfile p;
  ProfileFromSpec(s, &p);
  return p;
}

bool IsVersion1Int2(const std::string& codec, uint8_t selector) {
  return (selector & 1) == 0 && codec.find("\"kvcd.codec_version\"") == std::string::npos;
}

// Every value of a fetched BF16 tensor is finite.
bool AllFinite(const v1::TensorRef& t) {
  const std::string& b = t.inline_data();
  for (size_t i = 0; i + 1 < b.size(); i += 2) {
    uint16_t v;
    std::memcpy(&v, b.data() + i, 2);
    if (!std::isfinite(kernels::Bf16ToFloat(v))) return false;
  }
  return true;
}

void Trap(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "codec_register_fuzz: %s: %s\n", what, s.ToString().c_str());
  __builtin_trap();
}

}  // namespace
}  // namespace kvcd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcd;
  if (size < 1 || size - 1 > kMaxCodecBytes) return 0;
  const uint8_t selector = data[0];
  // One engine registers many models, each under its own name (a fresh engine per input
  // is slow); replaced after 16 registrations, long before its budget runs out.
  static std::unique_ptr<CacheEngine> engine;
  static int64_t registered = 0, inputs = 0;
  if (engine == nullptr || registered >= 16) {
    engine.reset();
    engine = NewEngine();
    registered = 0;
  }
  const std::string name = "m" + std::to_string(inputs++);
  v1::RegisterModelRequest reg;
  *reg.mutable_profile() = Profile(name, selector);
  reg.set_codec_blob(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  v1::RegisterModelResponse reg_resp;
  const absl::Status s = engine->RegisterModel(reg, &reg_resp);
  static const bool verbose = std::getenv("KVCD_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "register %s: %s\n", name.c_str(), s.ToString().c_str());
  if (s.message().size() > 600) Trap("unbounded message", s);
  if (!s.ok()) {
    if (s.code() != absl::StatusCode::kInvalidArgument) Trap("register", s);
    v1::ListModelsResponse models;
    if (!engine->ListModels(v1::ListModelsRequest(), &models).ok()) __builtin_trap();
    for (const auto& m : models.models()) {
      if (m.profile().name() == name) Trap("a refused model stayed", s);
    }
    return 0;
  }
  ++registered;
  const bool finite = IsVersion1Int2(reg.codec_blob(), selector);
  for (const float scale : {1.0f, 1e6f}) {
    v1::PutRequest put = synthetic::Put(static_cast<uint64_t>(inputs), reg.profile(), 12,
                                        scale == 1.0f ? "" : "big");
    if (scale != 1.0f) {  // the same rows times 1e6 (BF16 keeps the range)
      for (v1::TensorRef* t : {put.mutable_k(), put.mutable_v()}) {
        std::string& b = *t->mutable_inline_data();
        for (size_t i = 0; i + 1 < b.size(); i += 2) {
          uint16_t v;
          std::memcpy(&v, b.data() + i, 2);
          v = kernels::FloatToBf16(kernels::Bf16ToFloat(v) * scale);
          std::memcpy(b.data() + i, &v, 2);
        }
      }
    }
    v1::PutResponse put_resp;
    const absl::Status p = engine->Put(put, &put_resp);
    if (!p.ok()) {
      if (p.code() == absl::StatusCode::kInvalidArgument ||
          p.code() == absl::StatusCode::kResourceExhausted) {
        continue;
      }
      Trap("put", p);
    }
    v1::OpenSequenceRequest open;
    open.set_model(name);
    open.set_cache_salt(put.cache_salt());
    *open.mutable_tokens() = put.tokens();
    v1::OpenSequenceResponse opened;
    const absl::Status o = engine->OpenSequence(open, &opened);
    if (!o.ok()) {
      if (o.code() == absl::StatusCode::kResourceExhausted) continue;
      Trap("open", o);
    }
    v1::FetchPagesRequest fetch;
    fetch.set_sequence_id(opened.sequence_id());
    fetch.set_expand_to_bf16(true);
    v1::FetchPagesResponse fetched;
    const absl::Status f = engine->FetchPages(fetch, &fetched, FoundSequences());
    if (verbose) {
      std::fprintf(stderr, "  scale %g: put %s, fetch %s (%lld tokens)\n", scale,
                   p.ToString().c_str(), f.ToString().c_str(),
                   static_cast<long long>(fetched.num_tokens()));
    }
    if (!f.ok() && f.code() != absl::StatusCode::kInvalidArgument) Trap("fetch", f);
    if (f.ok() && finite && (!AllFinite(fetched.k()) || !AllFinite(fetched.v()))) {
      Trap("finite K/V fetched back non-finite", f);
    }
    v1::CloseSequenceRequest close;
    close.set_sequence_id(opened.sequence_id());
    v1::CloseSequenceResponse closed;
    if (!engine->CloseSequence(close, &closed).ok()) __builtin_trap();
  }
  return 0;
}
