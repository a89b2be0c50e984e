// Helpers for server tests: a tiny model and request builders with synthetic K/V.
#pragma once

#include <vector>

#include "kvcd/v1/kvcache.pb.h"
#include "proto/tensor_ref.h"
#include "server/engine/cache_engine.h"
#include "server/engine/model_profile.h"
#include "server/formats/model_spec.h"
#include "testing/synthetic.h"

namespace kvcd::testing_util {

// 2 layers, 4 q / 2 kv heads, head_dim 16, page 4, sink 4, recent 8.
inline ModelSpec TinySpec(uint64_t memory_bytes = 1 << 20) {
  ModelSpec s = *BuiltinModelSpec("tiny");
  s.memory_bytes = memory_bytes;
  return s;
}

// The tiny geometry with OSCAR INT2 history and the Hadamard rotation.
inline ModelSpec TinyInt2Spec() {
  ModelSpec s = TinySpec();
  s.name = "tiny-int2";
  s.history_format = FormatId::kInt2Oscar;
  s.codec = "hadamard";
  return s;
}

inline v1::ModelProfile Profile(const ModelSpec& s) {
  v1::ModelProfile p;
  ProfileFromSpec(s, &p);
  return p;
}

inline v1::PutRequest MakePut(const ModelSpec& s, uint64_t seed, int64_t n,
                              const std::string& salt = "") {
  return synthetic::Put(seed, Profile(s), n, salt);
}

inline v1::AppendRequest MakeAppend(const ModelSpec& s, uint64_t seq, uint64_t seed, int64_t begin,
                                    int64_t n) {
  v1::AppendRequest req;
  req.set_sequence_id(seq);
  const auto tokens = synthetic::Tokens(seed, begin, n);
  req.mutable_tokens()->Add(tokens.begin(), tokens.end());
  const auto p = Profile(s);
  const std::vector<int64_t> shape = {s.num_layers, n, s.num_kv_heads, s.head_dim};
  SetBf16FromFloat(req.mutable_k(), shape, synthetic::Kv(seed, p, begin, n, 0).data());
  SetBf16FromFloat(req.mutable_v(), shape, synthetic::Kv(seed, p, begin, n, 1).data());
  return req;
}

inline ServerConfig TestConfig(uint64_t budget = 64 << 20) {
  ServerConfig c;
  c.memory_budget_bytes = budget;
  c.compute_threads = 2;
  return c;
}

}  // namespace kvcd::testing_util
