// Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/): real, valid
// inputs built with the same writers and request builders the daemon and clients use.
//   build-fuzz/tests/fuzz/make_seeds tests/fuzz/corpus
// The configuration seeds are hand-written files in corpus/config_fuzz/.
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/activation_dump.h"
#include "common/cli.h"
#include "common/codec_profile.h"
#include "common/decode_channel_layout.h"
#include "common/fsq_codec.h"
#include "common/key_transform_profile.h"
#include "common/safetensors.h"
#include "proto/tensor_ref.h"
#include "server/backends/backend.h"
#include "server/engine/cache_engine.h"
#include "server/engine/model_profile.h"
#include "server/formats/model_spec.h"
#include "testing/synthetic.h"

namespace kvcd {
namespace {

std::string root;

void Write(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::string dir = root + "/" + target;
  mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

// --- file readers ------------------------------------------------------------------------

void FileSeeds() {
  SafetensorsWriter w;
  w.AddF32("a", {2, 3}, {1, 2, 3, 4, 5, 6});
  const uint16_t bf16[4] = {0x3f80, 0x4000, 0xbf80, 0x0000};
  w.Add("b", "BF16", {4}, bf16, sizeof(bf16));
  const uint8_t u8[3] = {1, 2, 3};
  w.Add("c", "U8", {3}, u8, sizeof(u8));
  w.SetMetadata("k", "v");
  Write("safetensors_fuzz", "mixed", w.Serialize());
  SafetensorsWriter empty;
  Write("safetensors_fuzz", "empty", empty.Serialize());
  SafetensorsWriter scalar;
  scalar.AddF32("s", {}, {0.5f});
  Write("safetensors_fuzz", "scalar", scalar.Serialize());

  // Codec files: the first byte picks (layers, head_dim): byte % 4 -> {4, 8, 16, 64},
  // byte / 4 % 4 + 1 -> layers.
  auto codec = [](const CodecProfile& p, uint8_t geometry) {
    return std::string(1, static_cast<char>(geometry)) + p.ToSafetensors().Serialize();
  };
  Write("codec_profile_fuzz", "hadamard-2x8", codec(CodecProfile::Hadamard(2, 8), 1 + 4));
  Write("codec_profile_fuzz", "identity-1x4", codec(CodecProfile::Identity(1, 4), 0));
  Write("codec_profile_fuzz", "hadamard-1x16", codec(CodecProfile::Hadamard(1, 16), 2));
  SafetensorsWriter rho = CodecProfile::Identity(1, 4).ToSafetensors();
  rho.AddF32("layers.0.rho_k", {1}, {0.9f});
  rho.AddF32("layers.0.rho_v", {}, {0.8f});
  Write("codec_profile_fuzz", "identity-rho", std::string(1, '\0') + rho.Serialize());

  ActivationDump d;
  d.num_layers = 1;
  d.num_q_heads = 2;
  d.num_kv_heads = 1;
  d.head_dim = 4;
  d.tokens = 2;
  d.source = "seed";
  LayerActivations a;
  for (int i = 0; i < 16; ++i) a.q.push_back(0.1f * i);
  for (int i = 0; i < 8; ++i) a.k.push_back(-0.1f * i);
  a.v = a.k;
  d.layers.push_back(a);
  const std::string tmp = root + "/.dump.tmp";
  if (!WriteActivationDump(d, tmp).ok()) std::abort();
  std::ifstream in(tmp, std::ios::binary);
  Write("activation_dump_fuzz", "one-layer",
        std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
  std::remove(tmp.c_str());
}

// --- codec files through RegisterModel ---------------------------------------------------

// codec_register_fuzz: [selector][codec file]; selector bit 0: int2-oscar (0) or fsq (1),
// bit 1: the FSQ model's key_norm rms. The model: 2 layers, 1 KV head, head_dim 8.
void CodecRegisterSeeds() {
  auto seed = [](uint8_t selector, const SafetensorsWriter& w) {
    return std::string(1, static_cast<char>(selector)) + w.Serialize();
  };
  Write("codec_register_fuzz", "v1-hadamard",
        seed(0, CodecProfile::Hadamard(2, 8).ToSafetensors()));
  Write("codec_register_fuzz", "v1-identity",
        seed(0, CodecProfile::Identity(2, 8).ToSafetensors()));
  // The files of issue #35.1 and #35.5: NaN rotations, a 10 KB version string.
  SafetensorsWriter nan;
  for (int l = 0; l < 2; ++l) {
    for (const char* which : {"r_k", "r_v"}) {
      nan.AddF32(std::string("layers.") + std::to_string(l) + "." + which, {8, 8},
                 std::vector<float>(64, std::nanf("")));
    }
  }
  Write("codec_register_fuzz", "v1-nan-rotations", seed(0, nan));
  SafetensorsWriter long_version = CodecProfile::Hadamard(2, 8).ToSafetensors();
  long_version.SetMetadata("kvcd.codec_version", std::string(10240, '9'));
  Write("codec_register_fuzz", "long-version", seed(0, long_version));
  Write("codec_register_fuzz", "v3-transform",
        seed(0, KeyTransformProfile::ToSafetensors(KeyTransformProfile::SyntheticHeads(2, 1, 8, 1),
                                                   2, 1, 8, "seed")));
  FsqCodecShape shape;
  shape.num_layers = 2;
  shape.residual_width = 16;
  shape.latent_width = 8;
  shape.num_kv_heads = 1;
  shape.head_dim = 8;
  Write("codec_register_fuzz", "fsq", seed(1, FsqCodec::Synthetic(shape, 1).ToSafetensors()));
  shape.key_norm = true;
  Write("codec_register_fuzz", "fsq-key-norm",
        seed(3, FsqCodec::Synthetic(shape, 2).ToSafetensors()));
}

// --- RPC sessions ------------------------------------------------------------------------

// The method numbers of rpc_fuzz.cc.
enum Rpc : uint8_t {
  kRegisterModel,
  kListModels,
  kPut,
  kMatch,
  kOpenSequence,
  kCloseSequence,
  kRenewLease,
  kAppend,
  kAttentionDecode,
  kFetchPages,
  kPushPages,
  kStats,
  kRegisterBuffer,
  kUnregisterBuffer,
  kRenewBuffer,
  kNcclConnect,
  kNcclDisconnect,
  kPinPrefix,
  kUnpinPrefix,
  kCommitSequence,
  kForkSequence
};

struct Session {
  std::string bytes;
  Session& Add(Rpc m, const google::protobuf::Message& req) {
    const std::string b = req.SerializeAsString();
    bytes.push_back(static_cast<char>(m));
    bytes.push_back(static_cast<char>(b.size() & 0xff));
    bytes.push_back(static_cast<char>(b.size() >> 8));
    bytes += b;
    return *this;
  }
};

v1::ModelProfile Tiny(const std::string& name = "tiny") {
  ModelSpec s = *BuiltinModelSpec("tiny");
  s.name = name;
  v1::ModelProfile p;
  ProfileFromSpec(s, &p);
  return p;
}

v1::PutRequest Put(const std::string& model, uint64_t seed, int64_t n) {
  return synthetic::Put(seed, Tiny(model), n);
}

v1::AppendRequest Append(const std::string& model, uint64_t seed, int64_t begin, int64_t n) {
  const v1::ModelProfile p = Tiny(model);
  v1::AppendRequest req;
  req.set_sequence_id(0);  // rpc_fuzz: the first sequence this session opened
  const auto t = synthetic::Tokens(seed, begin, n);
  req.mutable_tokens()->Add(t.begin(), t.end());
  const std::vector<int64_t> shape = {p.num_layers(), n, p.num_kv_heads(), p.head_dim()};
  SetBf16FromFloat(req.mutable_k(), shape, synthetic::Kv(seed, p, begin, n, 0).data());
  SetBf16FromFloat(req.mutable_v(), shape, synthetic::Kv(seed, p, begin, n, 1).data());
  return req;
}

v1::AttentionDecodeRequest Decode(const std::string& model, int layer, bool fused) {
  const v1::ModelProfile p = Tiny(model);
  v1::AttentionDecodeRequest req;
  req.set_layer(layer);
  req.add_sequence_ids(0);
  SetF32Tensor(req.mutable_q(), {1, p.num_q_heads(), p.head_dim()},
               synthetic::Row(9, p, layer, 0, 2).data());
  if (fused) {
    SetBf16FromFloat(req.mutable_k_new(), {1, p.num_kv_heads(), p.head_dim()},
                     synthetic::Row(9, p, layer, 1, 0).data());
    SetBf16FromFloat(req.mutable_v_new(), {1, p.num_kv_heads(), p.head_dim()},
                     synthetic::Row(9, p, layer, 1, 1).data());
    req.add_new_tokens(11);
  }
  req.set_request_id(5);
  return req;
}

void RpcSeeds() {
  for (const std::string model : {"tiny", "tiny-int2"}) {
    v1::MatchRequest match;
    match.set_model(model);
    const auto t = synthetic::Tokens(1, 0, 32);
    match.mutable_tokens()->Add(t.begin(), t.end());
    v1::OpenSequenceRequest open;
    open.set_model(model);
    open.mutable_tokens()->Add(t.begin(), t.end());
    v1::FetchPagesRequest fetch;
    fetch.set_sequence_id(0);
    v1::FetchPagesRequest fetch_bf16 = fetch;
    fetch_bf16.set_expand_to_bf16(true);
    v1::CloseSequenceRequest close;
    close.set_sequence_id(0);
    v1::RenewLeaseRequest renew;
    renew.set_sequence_id(0);
    renew.set_lease_ms(1000);
    v1::CommitSequenceRequest commit;
    commit.set_sequence_id(0);
    v1::ForkSequenceRequest fork;
    fork.set_sequence_id(0);
    fork.set_lease_ms(1000);
    v1::CloseSequenceRequest close_commit = close;
    close_commit.set_commit(true);
    Session s;
    s.Add(kPut, Put(model, 1, 32))
        .Add(kMatch, match)
        .Add(kOpenSequence, open)
        .Add(kAppend, Append(model, 1, 32, 6))
        .Add(kAttentionDecode, Decode(model, 0, false))
        .Add(kAttentionDecode, Decode(model, 0, true))
        .Add(kAttentionDecode, Decode(model, 1, true))
        .Add(kRenewLease, renew)
        .Add(kFetchPages, fetch)
        .Add(kFetchPages, fetch_bf16)
        .Add(kCloseSequence, close)
        .Add(kStats, v1::StatsRequest());
    Write("rpc_fuzz", "session-" + model, s.bytes);
    // A turn committed and closed, the next one opened on it, forked and committed again.
    Session turns;
    turns.Add(kPut, Put(model, 1, 32))
        .Add(kOpenSequence, open)
        .Add(kAppend, Append(model, 1, 32, 6))
        .Add(kCommitSequence, commit)
        .Add(kForkSequence, fork)
        .Add(kAttentionDecode, Decode(model, 0, true))
        .Add(kCloseSequence, close_commit)
        .Add(kOpenSequence, open)
        .Add(kCommitSequence, commit)
        .Add(kStats, v1::StatsRequest());
    Write("rpc_fuzz", "sessions-" + model, turns.bytes);
  }
  {
    // A prefix pin of a cached prompt, Stats listing it, and its removal.
    v1::PinPrefixRequest pin;
    pin.set_model("tiny");
    const auto t = synthetic::Tokens(1, 0, 32);
    pin.mutable_tokens()->Add(t.begin(), t.end());
    pin.set_ttl_ms(60000);
    v1::UnpinPrefixRequest unpin;
    unpin.set_pin_id(0);  // rpc_fuzz: the first pin this session made
    Write("rpc_fuzz", "pin",
          Session()
              .Add(kPut, Put("tiny", 1, 32))
              .Add(kPinPrefix, pin)
              .Add(kStats, v1::StatsRequest())
              .Add(kUnpinPrefix, unpin)
              .bytes);
  }
  Write("rpc_fuzz", "stats", Session().Add(kStats, v1::StatsRequest()).bytes);
  Write("rpc_fuzz", "list", Session().Add(kListModels, v1::ListModelsRequest()).bytes);
  {
    v1::RegisterModelRequest reg;
    *reg.mutable_profile() = Tiny("fresh");
    reg.mutable_profile()->set_memory_bytes(16 << 10);
    v1::RegisterModelRequest int2 = reg;
    int2.mutable_profile()->set_name("fresh-int2");
    int2.mutable_profile()->set_history_format(v1::HISTORY_FORMAT_INT2_OSCAR);
    int2.mutable_profile()->set_codec("");
    int2.set_codec_blob(CodecProfile::Hadamard(2, 16).ToSafetensors().Serialize());
    Write("rpc_fuzz", "register",
          Session()
              .Add(kRegisterModel, reg)
              .Add(kRegisterModel, int2)
              .Add(kPut, Put("fresh", 2, 8))
              .bytes);
  }
  {
    // PushPages of pages fetched from a real engine (bf16 and int2-oscar pages).
    ServerConfig config;
    config.memory_budget_bytes = 16 << 20;
    CacheEngine engine(config, MakeCpuBackend(1));
    ModelSpec tiny = *BuiltinModelSpec("tiny");
    ModelSpec int2 = tiny;
    int2.name = "tiny-int2";
    int2.history_format = FormatId::kInt2Oscar;
    int2.codec = "hadamard";
    if (!engine.RegisterModelSpec(tiny).ok() || !engine.RegisterModelSpec(int2).ok()) std::abort();
    for (const std::string model : {"tiny", "tiny-int2"}) {
      v1::PutResponse pr;
      if (!engine.Put(Put(model, 3, 32), &pr).ok()) std::abort();
      v1::OpenSequenceRequest open;
      open.set_model(model);
      const auto t = synthetic::Tokens(3, 0, 32);
      open.mutable_tokens()->Add(t.begin(), t.end());
      v1::OpenSequenceResponse or_;
      if (!engine.OpenSequence(open, &or_).ok()) std::abort();
      v1::FetchPagesRequest f;
      f.set_sequence_id(or_.sequence_id());
      v1::FetchPagesResponse fr;
      if (!engine.FetchPages(f, &fr).ok()) std::abort();
      v1::PushPagesRequest push;
      push.set_model(model);
      const auto t2 = synthetic::Tokens(4, 0, 32);
      push.mutable_tokens()->Add(t2.begin(), t2.end());
      for (const auto& page : fr.pages()) {
        auto* in = push.add_inline_pages();
        in->set_format(page.format());
        in->set_first_token(page.first_token());
        in->set_num_tokens(page.num_tokens());
        in->set_data(page.data());
      }
      v1::MatchRequest match;
      match.set_model(model);
      match.mutable_tokens()->Add(t2.begin(), t2.end());
      Write("rpc_fuzz", "push-" + model, Session().Add(kPushPages, push).Add(kMatch, match).bytes);
    }
  }
}

// --- decode channel ----------------------------------------------------------------------

void ChannelSeeds() {
  auto seed = [](uint8_t flags, const std::string& payload) {
    std::string s(9, '\0');
    s[0] = static_cast<char>(flags);
    return s + payload;
  };
  Write("decode_channel_fuzz", "decode", seed(0, Decode("tiny", 1, false).SerializeAsString()));
  Write("decode_channel_fuzz", "fused", seed(0, Decode("tiny", 0, true).SerializeAsString()));
  Write("decode_channel_fuzz", "garbage", seed(16, "\x08\x01\x12\xff\xff\xff\xff\x0f"));
  std::string sized = seed(8, Decode("tiny", 0, false).SerializeAsString());
  sized[5] = '\x10';  // request_bytes = 16: a cut request
  Write("decode_channel_fuzz", "cut", sized);
  // Flag 32: a value for every other header field (the block after byte 8): a valid header
  // for the second object, a jump of request_seq, and the daemon's fields and the doorbell's
  // words scribbled on.
  auto le = [](std::string* s, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  std::string block;
  le(&block, DecodeChannelHeader::kMagic, 8);
  le(&block, DecodeChannelHeader::kVersion, 4);
  le(&block, DecodeChannelHeader::kMinCapacity, 4);
  le(&block, 1000, 8);         // request_seq
  le(&block, 1000, 8);         // response_seq: as if already answered
  le(&block, 0xffffffffu, 4);  // response_bytes
  le(&block, 7, 4);            // doorbell
  le(&block, 0, 4);            // daemon_waiting: the wake-up is skipped
  Write("decode_channel_fuzz", "header",
        seed(32, block + Decode("tiny", 1, false).SerializeAsString()));
  block[0] ^= 1;  // a bad magic: the second object is refused
  Write("decode_channel_fuzz", "header-bad-magic",
        seed(32, block + Decode("tiny", 1, false).SerializeAsString()));
}

}  // namespace
}  // namespace kvcd

int main(int argc, char** argv) {
  const kvcd::cli::Program program = {.name = "make_seeds",
                                      .summary = "writes the seed corpus of the fuzz targets",
                                      .files = {__FILE__},
                                      .synopsis = "CORPUS_DIR",
                                      .takes_args = true};
  const kvcd::cli::Parsed cli = kvcd::cli::Parse(program, argc, argv);
  if (cli.args.size() != 1) return kvcd::cli::UsageError(program, nullptr, "give one CORPUS_DIR");
  kvcd::root = cli.args[0];
  mkdir(kvcd::root.c_str(), 0755);
  kvcd::FileSeeds();
  kvcd::RpcSeeds();
  kvcd::CodecRegisterSeeds();
  kvcd::ChannelSeeds();
  return 0;
}
