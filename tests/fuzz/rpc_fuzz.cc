// Fuzzes every RPC's request handling on an in-process CacheEngine (the code the gRPC
// service routes each call to after authorization) on the CPU backend with two small
// registered models ("tiny", BF16 history; "tiny-int2", OSCAR INT2 history).
//
// KVCD_FUZZ_VERBOSE=1 prints each call's method and status (to read a reproducer).
//
// Input: a session of calls, each [method u8][length u16 little-endian][serialized request],
// run in order on the engine. A
// sequence_id (or sequence_ids element) below 8 names the k-th sequence this session
// opened, and a pin_id below 8 the k-th prefix pin it made, so that the fuzzer reaches the
// calls on open sequences and live pins without guessing their random ids; other values are
// passed as they are.
//
// Checked after every call, beyond what ASan/UBSan catch:
//   - the code is one docs/api.md "Errors" allows for client input (never UNKNOWN, INTERNAL or
//     DATA_LOSS on the CPU backend);
//   - a failed call stores nothing: cached tokens, pages in use and open sequences are
//     as before;
// and at the end of the session, after closing every sequence it opened and removing every
// pin it made: no sequence is left open and no prefix pin is left live.
//
// The custom mutator is structure-aware: it parses the session, then changes one field of
// one request through protobuf reflection (interesting integers, NaN/Inf floats, model
// names, undefined enum values, inline_data resized to match or miss its shape), or
// duplicates, drops or re-targets a call; a share of mutations stay byte-level.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"
#include "server/backends/backend.h"
#include "server/engine/cache_engine.h"
#include "server/formats/model_spec.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace kvcd {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

struct Method {
  const char* name;
  std::unique_ptr<Message> request;   // prototype
  std::unique_ptr<Message> response;  // prototype
  std::function<absl::Status(CacheEngine&, const Message&, Message*)> call;
};

template <class Req, class Resp>
Method Make(const char* name, absl::Status (CacheEngine::*fn)(const Req&, Resp*)) {
  return Method{name, std::make_unique<Req>(), std::make_unique<Resp>(),
                [fn](CacheEngine& e, const Message& req, Message* resp) {
                  return (e.*fn)(static_cast<const Req&>(req), static_cast<Resp*>(resp));
                }};
}

// The calls that may take the sequences the authorizer found (none here: the engine looks
// them up itself, as without auth).
template <class Req, class Resp>
Method Make(const char* name,
            absl::Status (CacheEngine::*fn)(const Req&, Resp*, const FoundSequences&)) {
  return Method{name, std::make_unique<Req>(), std::make_unique<Resp>(),
                [fn](CacheEngine& e, const Message& req, Message* resp) {
                  return (e.*fn)(static_cast<const Req&>(req), static_cast<Resp*>(resp), {});
                }};
}

const std::vector<Method>& Methods() {
  static const auto* methods = new std::vector<Method>([] {
    std::vector<Method> m;
    m.push_back(Make("RegisterModel", &CacheEngine::RegisterModel));
    m.push_back(Make("ListModels", &CacheEngine::ListModels));
    m.push_back(Make("Put", &CacheEngine::Put));
    m.push_back(Make("Match", &CacheEngine::Match));
    m.push_back(Make("OpenSequence", &CacheEngine::OpenSequence));
    m.push_back(Make("CloseSequence", &CacheEngine::CloseSequence));
    m.push_back(Make("RenewLease", &CacheEngine::RenewLease));
    m.push_back(Make("Append", &CacheEngine::Append));
    m.push_back(Make("AttentionDecode", &CacheEngine::AttentionDecode));
    m.push_back(Make("FetchPages", &CacheEngine::FetchPages));
    m.push_back(Make("PushPages", &CacheEngine::PushPages));
    m.push_back(Make("Stats", &CacheEngine::Stats));
    m.push_back(Make("RegisterBuffer", &CacheEngine::RegisterBuffer));
    m.push_back(Make("UnregisterBuffer", &CacheEngine::UnregisterBuffer));
    m.push_back(Make("RenewBuffer", &CacheEngine::RenewBuffer));
    m.push_back(Make("NcclConnect", &CacheEngine::NcclConnect));
    m.push_back(Make("NcclDisconnect", &CacheEngine::NcclDisconnect));
    m.push_back(Make("PinPrefix", &CacheEngine::PinPrefix));
    m.push_back(Make("UnpinPrefix", &CacheEngine::UnpinPrefix));
    // Sessions (issue #31), after the others so that the seeds' method numbers stay.
    m.push_back(Make("CommitSequence", &CacheEngine::CommitSequence));
    m.push_back(Make("ForkSequence", &CacheEngine::ForkSequence));
    return m;
  }());
  return *methods;
}

struct Call {
  uint8_t method = 0;
  std::string bytes;
};

std::vector<Call> ParseSession(const uint8_t* data, size_t size) {
  std::vector<Call> calls;
  size_t i = 0;
  while (i + 3 <= size) {
    Call c;
    c.method = data[i];
    const size_t n = data[i + 1] | (size_t{data[i + 2]} << 8);
    i += 3;
    const size_t take = std::min(n, size - i);
    c.bytes.assign(reinterpret_cast<const char*>(data + i), take);
    i += take;
    calls.push_back(std::move(c));
  }
  return calls;
}

std::string SerializeSession(const std::vector<Call>& calls) {
  std::string out;
  for (const Call& c : calls) {
    const size_t n = std::min<size_t>(c.bytes.size(), 0xffff);
    out.push_back(static_cast<char>(c.method));
    out.push_back(static_cast<char>(n & 0xff));
    out.push_back(static_cast<char>(n >> 8));
    out.append(c.bytes, 0, n);
  }
  return out;
}

// Rewrites small sequence ids to the ids this session opened, small pin ids to its pins'.
void MapSequenceIds(Message* msg, const std::vector<uint64_t>& opened,
                    const std::vector<uint64_t>& pinned) {
  const Reflection* r = msg->GetReflection();
  const auto* d = msg->GetDescriptor();
  auto map = [&](uint64_t v) { return v < 8 && v < opened.size() ? opened[v] : v; };
  if (const FieldDescriptor* f = d->FindFieldByName("pin_id");
      f != nullptr && f->cpp_type() == FieldDescriptor::CPPTYPE_UINT64 && !f->is_repeated()) {
    const uint64_t v = r->GetUInt64(*msg, f);
    if (v < 8 && v < pinned.size()) r->SetUInt64(msg, f, pinned[v]);
  }
  if (const FieldDescriptor* f = d->FindFieldByName("sequence_id");
      f != nullptr && f->cpp_type() == FieldDescriptor::CPPTYPE_UINT64 && !f->is_repeated()) {
    r->SetUInt64(msg, f, map(r->GetUInt64(*msg, f)));
  }
  if (const FieldDescriptor* f = d->FindFieldByName("sequence_ids");
      f != nullptr && f->cpp_type() == FieldDescriptor::CPPTYPE_UINT64 && f->is_repeated()) {
    for (int i = 0; i < r->FieldSize(*msg, f); ++i) {
      r->SetRepeatedUInt64(msg, f, i, map(r->GetRepeatedUInt64(*msg, f, i)));
    }
  }
}

// What a failed call must leave as it was.
std::string StoredState(CacheEngine& engine) {
  v1::StatsResponse s;
  if (!engine.Stats(v1::StatsRequest(), &s).ok()) __builtin_trap();
  std::string fp = std::to_string(s.active_sequences());
  for (const auto& m : s.models()) {
    fp += "|" + m.profile().name() + ":" + std::to_string(m.cached_tokens()) + ":" +
          std::to_string(m.active_sequences());
    for (const auto& p : m.pools()) fp += "/" + std::to_string(p.pages_used());
  }
  return fp;
}

bool AllowedCode(absl::StatusCode c) {
  switch (c) {
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDataLoss:
      return false;
    default:
      return true;
  }
}

std::unique_ptr<CacheEngine> NewEngine() {
  ServerConfig config;
  config.memory_budget_bytes = 16 << 20;
  config.compute_threads = 1;
  config.max_sequences = 16;
  auto engine = std::make_unique<CacheEngine>(config, MakeCpuBackend(1));
  ModelSpec tiny = *BuiltinModelSpec("tiny");
  tiny.memory_bytes = 64 << 10;  // 64 pages: eviction is reachable in a few calls
  ModelSpec int2 = tiny;
  int2.name = "tiny-int2";
  int2.history_format = FormatId::kInt2Oscar;
  int2.codec = "hadamard";
  if (!engine->RegisterModelSpec(tiny).ok() || !engine->RegisterModelSpec(int2).ok()) {
    __builtin_trap();
  }
  return engine;
}

// --- Structure-aware mutation -------------------------------------------------------------

template <class T>
T Pick(std::mt19937& rng, std::initializer_list<T> values) {
  return *(values.begin() + rng() % values.size());
}

int64_t InterestingInt(std::mt19937& rng, int64_t old) {
  switch (rng() % 4) {
    case 0:
      // old - 4 .. old + 4, wrapping (two's complement) instead of overflowing.
      return static_cast<int64_t>(static_cast<uint64_t>(old) + rng() % 9 - 4);
    case 1:
      return static_cast<int64_t>(rng() % 70);
    default:
      return Pick<int64_t>(
          rng, {0, 1, -1, 2, 4, 8, 15, 16, 17, 64, 65, 522, 1 << 20,
                std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min(),
                std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()});
  }
}

double InterestingFloat(std::mt19937& rng) {
  return Pick<double>(
      rng,
      {0.0, -0.0, 1.0, -1.0, 0.125, 1e30, -1e30, 1e-40, std::numeric_limits<double>::quiet_NaN(),
       std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()});
}

std::string InterestingString(std::mt19937& rng, const std::string& old) {
  switch (rng() % 8) {
    case 0:
      return "";
    case 1:
      return "tiny";
    case 2:
      return "tiny-int2";
    case 3:
      return std::string(1 + rng() % 300, 'a');
    case 4:
      return "\xff\xfe bad utf8";
    case 5:
      return "/kvcd-fuzz";
    case 6:
      return old.empty() ? old : old.substr(0, rng() % old.size());
    default:
      return old + static_cast<char>(rng());
  }
}

// Bytes: resized to match the shape of the enclosing TensorRef (often), or cut, grown,
// flipped, or filled with non-finite BF16/F32 values.
std::string MutateBytes(std::mt19937& rng, const std::string& old, int64_t want) {
  std::string b = old;
  switch (rng() % 6) {
    case 0:
    case 1:
      if (want >= 0 && want <= (1 << 20)) b.resize(static_cast<size_t>(want), '\x3f');
      break;
    case 2:
      b.resize(rng() % (b.size() + 9));
      break;
    case 3:
      if (!b.empty()) b[rng() % b.size()] ^= static_cast<char>(1u << (rng() % 8));
      break;
    case 4: {  // a non-finite value at an even offset: BF16 +Inf / NaN, or F32 NaN bytes
      if (b.size() >= 4) {
        const size_t at = (rng() % (b.size() / 4)) * 4;
        const uint32_t v = Pick<uint32_t>(rng, {0x7f807f80u, 0x7fc07fc0u, 0xff80ff80u});
        std::memcpy(&b[at], &v, 4);
      }
      break;
    }
    default:
      b.append(rng() % 64, static_cast<char>(rng()));
  }
  return b;
}

int64_t ShapeBytes(const Message& tensor_ref) {
  const auto* d = tensor_ref.GetDescriptor();
  const Reflection* r = tensor_ref.GetReflection();
  const FieldDescriptor* shape = d->FindFieldByName("shape");
  const FieldDescriptor* dtype = d->FindFieldByName("dtype");
  if (shape == nullptr || dtype == nullptr) return -1;
  int64_t n = 1;
  for (int i = 0; i < r->FieldSize(tensor_ref, shape); ++i) {
    const int64_t e = r->GetRepeatedInt64(tensor_ref, shape, i);
    if (e < 0 || e > (1 << 20) || n > (1 << 20)) return -1;
    n *= e;
  }
  const int bytes = r->GetEnumValue(tensor_ref, dtype) == v1::DTYPE_F32  ? 4
                    : r->GetEnumValue(tensor_ref, dtype) == v1::DTYPE_U8 ? 1
                                                                         : 2;
  return n * bytes;
}

void MutateMessage(Message* msg, std::mt19937& rng, int depth) {
  const auto* d = msg->GetDescriptor();
  const Reflection* r = msg->GetReflection();
  if (d->field_count() == 0) return;
  const FieldDescriptor* f = d->field(static_cast<int>(rng() % d->field_count()));
  if (f->is_repeated()) {
    const int n = r->FieldSize(*msg, f);
    const int op = static_cast<int>(rng() % 4);
    if (op == 0 && n > 0) {  // drop the last element(s)
      const int drop = 1 + static_cast<int>(rng() % n);
      for (int i = 0; i < drop; ++i) r->RemoveLast(msg, f);
      return;
    }
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (n > 0 && depth < 4)
        MutateMessage(r->MutableRepeatedMessage(msg, f, rng() % n), rng, depth + 1);
      else
        r->AddMessage(msg, f);
      return;
    }
    const int count = op == 1 ? 1 + static_cast<int>(rng() % 16) : 1;
    for (int i = 0; i < count; ++i) {
      const int64_t v = InterestingInt(rng, 0);
      switch (f->cpp_type()) {
        case FieldDescriptor::CPPTYPE_INT32:
          if (op == 2 && n > 0)
            r->SetRepeatedInt32(msg, f, rng() % n, static_cast<int32_t>(v));
          else
            r->AddInt32(msg, f, static_cast<int32_t>(v));
          break;
        case FieldDescriptor::CPPTYPE_INT64:
          if (op == 2 && n > 0)
            r->SetRepeatedInt64(msg, f, rng() % n, v);
          else
            r->AddInt64(msg, f, v);
          break;
        case FieldDescriptor::CPPTYPE_UINT64:
          if (op == 2 && n > 0)
            r->SetRepeatedUInt64(msg, f, rng() % n, static_cast<uint64_t>(v));
          else
            r->AddUInt64(msg, f, static_cast<uint64_t>(v));
          break;
        default:
          break;
      }
    }
    return;
  }
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      r->SetInt32(msg, f, static_cast<int32_t>(InterestingInt(rng, r->GetInt32(*msg, f))));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      r->SetInt64(msg, f, InterestingInt(rng, r->GetInt64(*msg, f)));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      r->SetUInt32(msg, f, static_cast<uint32_t>(InterestingInt(rng, r->GetUInt32(*msg, f))));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      r->SetUInt64(msg, f, static_cast<uint64_t>(InterestingInt(rng, 0)));
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      r->SetFloat(msg, f, static_cast<float>(InterestingFloat(rng)));
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      r->SetDouble(msg, f, InterestingFloat(rng));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      r->SetBool(msg, f, !r->GetBool(*msg, f));
      break;
    case FieldDescriptor::CPPTYPE_ENUM:
      r->SetEnumValue(msg, f, static_cast<int>(rng() % 6) - 1);  // includes undefined values
      break;
    case FieldDescriptor::CPPTYPE_STRING:
      if (f->type() == FieldDescriptor::TYPE_BYTES) {
        r->SetString(msg, f, MutateBytes(rng, r->GetString(*msg, f), ShapeBytes(*msg)));
      } else {
        r->SetString(msg, f, InterestingString(rng, r->GetString(*msg, f)));
      }
      break;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      if (rng() % 8 == 0) {
        r->ClearField(msg, f);
      } else if (depth < 4) {
        MutateMessage(r->MutableMessage(msg, f), rng, depth + 1);
      }
      break;
  }
}

}  // namespace
}  // namespace kvcd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcd;
  const auto& methods = Methods();
  const std::vector<Call> calls = ParseSession(data, size);
  if (calls.empty() || calls.size() > 32) return 0;
  // One engine serves many sessions, as a daemon does (a fresh engine per input runs at a
  // few executions per second); it is replaced every 256 inputs, or before every input with
  // KVCD_FUZZ_FRESH_ENGINE set (to reproduce a crash from its input alone).
  static const bool fresh = std::getenv("KVCD_FUZZ_FRESH_ENGINE") != nullptr;
  static std::unique_ptr<CacheEngine> shared;
  static int64_t served = 0;
  if (shared == nullptr || fresh || ++served % 256 == 0) {
    shared.reset();
    shared = NewEngine();
  }
  CacheEngine* engine = shared.get();
  std::vector<uint64_t> opened, pinned;
  for (const Call& c : calls) {
    const Method& m = methods[c.method % methods.size()];
    std::unique_ptr<Message> req(m.request->New());
    // gRPC answers a request that does not parse before any handler runs.
    if (!req->ParseFromString(c.bytes)) continue;
    MapSequenceIds(req.get(), opened, pinned);
    std::unique_ptr<Message> resp(m.response->New());
    const std::string before = StoredState(*engine);
    const absl::Status s = m.call(*engine, *req, resp.get());
    static const bool verbose = std::getenv("KVCD_FUZZ_VERBOSE") != nullptr;
    if (verbose) fprintf(stderr, "%s: %s\n", m.name, s.ToString().c_str());
    if (!AllowedCode(s.code())) {
      fprintf(stderr, "%s answered %s\n", m.name, s.ToString().c_str());
      __builtin_trap();
    }
    if (!s.ok() && StoredState(*engine) != before) {
      fprintf(stderr, "%s failed (%s) but changed the stored state: %s -> %s\n", m.name,
              s.ToString().c_str(), before.c_str(), StoredState(*engine).c_str());
      __builtin_trap();
    }
    if (s.ok() && std::strcmp(m.name, "OpenSequence") == 0) {
      opened.push_back(static_cast<const v1::OpenSequenceResponse&>(*resp).sequence_id());
    }
    if (s.ok() && std::strcmp(m.name, "ForkSequence") == 0) {
      opened.push_back(static_cast<const v1::ForkSequenceResponse&>(*resp).sequence_id());
    }
    if (s.ok() && std::strcmp(m.name, "PinPrefix") == 0) {
      pinned.push_back(static_cast<const v1::PinPrefixResponse&>(*resp).pin_id());
    }
  }
  for (uint64_t id : pinned) {
    v1::UnpinPrefixRequest unpin;
    unpin.set_pin_id(id);
    v1::UnpinPrefixResponse out;
    (void)engine->UnpinPrefix(unpin, &out);
  }
  if (!engine->Pins().empty()) {
    fprintf(stderr, "%zu prefix pins left live after removing every one made\n",
            engine->Pins().size());
    __builtin_trap();
  }
  for (uint64_t id : opened) {
    v1::CloseSequenceRequest close;
    close.set_sequence_id(id);
    v1::CloseSequenceResponse out;
    (void)engine->CloseSequence(close, &out);
  }
  if (engine->ActiveSequences() != 0) {
    fprintf(stderr, "%lld sequences left open after closing every one opened\n",
            static_cast<long long>(engine->ActiveSequences()));
    __builtin_trap();
  }
  return 0;
}

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  using namespace kvcd;
  std::mt19937 rng(seed);
  std::vector<Call> calls = ParseSession(data, size);
  if (calls.empty() || rng() % 8 == 0) return LLVMFuzzerMutate(data, size, max_size);
  const auto& methods = Methods();
  Call& c = calls[rng() % calls.size()];
  switch (rng() % 10) {
    case 0:
      if (calls.size() < 32) calls.insert(calls.begin() + rng() % calls.size(), c);
      break;
    case 1:
      if (calls.size() > 1) calls.erase(calls.begin() + rng() % calls.size());
      break;
    case 2:
      c.method = static_cast<uint8_t>(rng() % methods.size());
      break;
    case 3: {
      std::string b = c.bytes;
      b.resize(b.size() * 2 + 16);
      b.resize(LLVMFuzzerMutate(reinterpret_cast<uint8_t*>(b.data()), c.bytes.size(), b.size()));
      c.bytes = std::move(b);
      break;
    }
    default: {
      std::unique_ptr<Message> req(methods[c.method % methods.size()].request->New());
      if (!req->ParseFromString(c.bytes)) return LLVMFuzzerMutate(data, size, max_size);
      MutateMessage(req.get(), rng, 0);
      c.bytes = req->SerializeAsString();
    }
  }
  const std::string out = SerializeSession(calls);
  if (out.size() > max_size) return LLVMFuzzerMutate(data, size, max_size);
  std::memcpy(data, out.data(), out.size());
  return out.size();
}
