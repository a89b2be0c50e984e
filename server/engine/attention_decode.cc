// CacheEngine::AttentionDecode, step by step: the batch of sequences, the queries, the
// result tensors, the fused new tokens, binding queries and results to host or device
// memory, the tenants' page reservations, and the attention itself.
#include <chrono>
#include <cmath>
#include <cstring>
#include <unordered_set>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/phase_times.h"
#include "common/status_macros.h"
#include "kvcd/kernels/bf16.h"
#include "server/backends/device_runtime.h"
#include "server/engine/cache_engine.h"
#include "server/engine/request_checks.h"
#include "server/engine/tensor_checks.h"

namespace kvcd {

absl::StatusOr<FoundSequences> CacheEngine::DecodeBatch(const v1::AttentionDecodeRequest& req,
                                                        const FoundSequences& found) {
  const int64_t batch = req.sequence_ids_size();
  if (batch < 1 || batch > kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence_ids has ", batch, " entries, expected 1..", kMaxBatch));
  }
  FoundSequences seqs;
  std::unordered_set<uint64_t> seen;
  for (int64_t b = 0; b < batch; ++b) {
    const uint64_t id = req.sequence_ids(static_cast<int>(b));
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("sequence_ids[", b, "] = ", id,
                                                     " appears twice; a batch needs distinct ids"));
    }
    KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Use(id, found, static_cast<size_t>(b)));
    if (absl::Status f = DeviceFaultStatus(*seq); !f.ok()) {
      return absl::Status(f.code(), absl::StrCat("sequence_ids[", b, "]: ", f.message()));
    }
    if (!seqs.empty() && seq->model != seqs.front()->model) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence_ids[", b, "] belongs to model '", seq->model->spec().name,
                       "', expected every sequence of the batch on model '",
                       seqs.front()->model->spec().name, "'"));
    }
    seqs.push_back(std::move(seq));
  }
  return seqs;
}

absl::StatusOr<CacheEngine::DecodeQueries> CacheEngine::ResolveQueries(
    const v1::AttentionDecodeRequest& req, const FoundSequences& seqs, const ModelSpec& s) {
  const int64_t batch = static_cast<int64_t>(seqs.size());
  const bool device_out = req.has_o_out() || req.has_lse_out();
  DecodeQueries q;
  // Device queries with device outputs stay on the device: the query conversion checks them
  // and marks a sequence with a NaN/±Inf (its outputs are NaN, its next call fails), so the
  // call does not wait. That needs every sequence's fault words; else they come to the host
  // and are scanned.
  q.on_device = req.q().payload_case() == v1::TensorRef::kCudaIpc && device_out;
  for (const auto& sq : seqs) q.on_device = q.on_device && sq->device_fault.held();
  TensorSpec spec = InputSpec("q", {batch, s.num_q_heads, s.head_dim});
  spec.scan_host = true;
  std::string staging;
  if (!q.on_device) spec.host_staging = &staging;
  KVCD_ASSIGN_OR_RETURN(TensorResolver::Bytes b, tensors_.Resolve(req.q(), spec));
  q.bf16 = req.q().dtype() == v1::DTYPE_BF16;
  if (q.on_device) {
    q.region = b.region;
    return q;
  }
  const int64_t elems = batch * s.num_q_heads * s.head_dim;
  q.host.resize(static_cast<size_t>(elems));
  if (!q.bf16) {
    std::memcpy(q.host.data(), b.data, q.host.size() * sizeof(float));
  } else {
    for (int64_t i = 0; i < elems; ++i) {
      uint16_t h;
      std::memcpy(&h, b.data + 2 * i, 2);
      q.host[static_cast<size_t>(i)] = kernels::Bf16ToFloat(h);
    }
  }
  return q;
}

absl::StatusOr<CacheEngine::DecodeOutputs> CacheEngine::ResolveOutputs(
    const v1::AttentionDecodeRequest& req, int64_t batch, const ModelSpec& s) {
  DecodeOutputs out;
  out.on_device = req.has_o_out() || req.has_lse_out();
  if (!out.on_device) return out;
  TensorSpec o, lse;
  o.field = "o_out";
  o.shape = {batch, s.num_q_heads, s.head_dim};
  lse.field = "lse_out";
  lse.shape = {batch, s.num_q_heads};
  for (TensorSpec* spec : {&o, &lse}) {
    spec->dtypes = TensorSpec::DTypes::kF32;
    spec->kinds = TensorResolver::kIpc;
    spec->access = TensorSpec::Access::kWrite;
  }
  TensorResolver::Bytes ob, lb;
  KVCD_RETURN_IF_ERROR(tensors_.ResolveAll({{&req.o_out(), &o, &ob}, {&req.lse_out(), &lse, &lb}}));
  out.o = ob.region;
  out.lse = lb.region;
  return out;
}

absl::Status CacheEngine::ResolveNewTokens(const v1::AttentionDecodeRequest& req, int64_t batch,
                                           const ModelSpec& s, ModelCache::NewTokens* out,
                                           RowSource* x_new) {
  if (!req.has_k_new() && !req.has_v_new()) {
    if (req.new_tokens_size() != 0) {
      return absl::InvalidArgumentError("new_tokens is set without k_new/v_new");
    }
    if (req.has_x_new()) return absl::InvalidArgumentError("x_new is set without k_new/v_new");
    return absl::OkStatus();
  }
  if (req.new_tokens_size() != batch) {
    return absl::InvalidArgumentError(absl::StrCat("new_tokens has ", req.new_tokens_size(),
                                                   " entries, expected one per sequence (", batch,
                                                   ")"));
  }
  KVCD_RETURN_IF_ERROR(CheckTokens(req.new_tokens(), "new_tokens", false));
  // Device rows (CUDA IPC) are stored on the device straight from the worker's buffer.
  KVCD_ASSIGN_OR_RETURN(KvRows kv, Rows(req.k_new(), req.v_new(), {"k_new", "v_new", false},
                                        {batch, s.num_kv_heads, s.head_dim}, batch, s));
  out->k = kv.k;
  out->v = kv.v;
  KVCD_ASSIGN_OR_RETURN(*x_new, Residuals(req.x_new(), req.has_x_new(), "x_new", 0, batch, s));
  if (x_new->data != nullptr) out->x = x_new;
  out->tokens = req.new_tokens();
  return absl::OkStatus();
}

absl::Status CacheEngine::BindDecodeIo(const v1::AttentionDecodeRequest& req, const ModelSpec& s,
                                       int64_t batch, const DecodeQueries& q,
                                       const DecodeOutputs& out, ModelCache::DeviceIo* device,
                                       v1::AttentionDecodeResponse* resp) {
  if (!out.on_device) {  // host results, inline in the response
    v1::TensorRef* o = resp->mutable_o();
    o->set_dtype(v1::DTYPE_F32);
    o->add_shape(batch);
    o->add_shape(s.num_q_heads);
    o->add_shape(s.head_dim);
    o->mutable_inline_data()->resize(q.host.size() * sizeof(float));
    v1::TensorRef* lse = resp->mutable_lse();
    lse->set_dtype(v1::DTYPE_F32);
    lse->add_shape(batch);
    lse->add_shape(s.num_q_heads);
    lse->mutable_inline_data()->resize(static_cast<size_t>(batch * s.num_q_heads) * sizeof(float));
    return absl::OkStatus();
  }
  if (q.on_device) {
    device->q = q.region.ptr;
    device->q_bf16 = q.bf16;
  } else {  // host queries, device results: the queries go up first
    auto* staged = reinterpret_cast<float*>(out.o.ptr);
    KVCD_ASSIGN_OR_RETURN(DeviceRuntime * dev, RequireDevice(*backend_));
    KVCD_RETURN_IF_ERROR(
        dev->CopyHostToDevice(staged, q.host.data(), q.host.size() * sizeof(float)));
    device->q = staged;  // o_out has the queries' shape; the merge overwrites it last
    device->q_bf16 = false;
  }
  device->o = reinterpret_cast<float*>(out.o.ptr);
  device->lse = reinterpret_cast<float*>(out.lse.ptr);
  *resp->mutable_o() = req.o_out();
  *resp->mutable_lse() = req.lse_out();
  return absl::OkStatus();
}

absl::Status CacheEngine::AttentionDecodeSignaled(const v1::AttentionDecodeRequest& req,
                                                  v1::AttentionDecodeResponse* resp,
                                                  const FoundSequences& found,
                                                  const DeviceSignal& signal) {
  TensorResolver::SignalScope scope(&buffers_, signal.buffer_id, signal.offset, signal.value);
  return AttentionDecode(req, resp, found);
}

absl::Status CacheEngine::AttentionDecode(const v1::AttentionDecodeRequest& req,
                                          v1::AttentionDecodeResponse* resp,
                                          const FoundSequences& found) {
  // queued_decode of Stats and the index's load: this call until it answers.
  decode_in_flight_.fetch_add(1);
  struct Done {
    std::atomic<uint64_t>* n;
    ~Done() { n->fetch_sub(1); }
  } done{&decode_in_flight_};
  // Host time of each step (PhaseTimes, off unless KVCD_PHASE_TIMES=1).
  static const int kValidate = PhaseTimes::Phase("daemon.engine.validate (+q/k/v resolve)");
  static const int kIo = PhaseTimes::Phase("daemon.engine.bind q/o/lse");
  static const int kReserve = PhaseTimes::Phase("daemon.engine.quota reserve");
  static const int kAttend = PhaseTimes::Phase("daemon.engine.attend (cache+backend)");
  static const int kWritten = PhaseTimes::Phase("daemon.engine.mark written");
  PhaseLap lap;
  TensorResolver::CallScope one_wait_per_buffer;  // q, k_new, v_new: one ready event
  resp->Clear();
  resp->set_request_id(req.request_id());
  KVCD_ASSIGN_OR_RETURN(const FoundSequences seqs, DecodeBatch(req, found));
  const int64_t batch = static_cast<int64_t>(seqs.size());
  ModelCache* m = seqs.front()->model;
  const ModelSpec& s = m->spec();
  if (req.layer() < 0 || req.layer() >= s.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer is ", req.layer(), ", expected 0..", s.num_layers - 1));
  }
  KVCD_ASSIGN_OR_RETURN(const DecodeQueries q, ResolveQueries(req, seqs, s));
  KVCD_ASSIGN_OR_RETURN(const DecodeOutputs out, ResolveOutputs(req, batch, s));
  // Bounded so that the FP32 scores scale·q·k of real queries and keys stay finite (a scale of
  // 3e38 answered lse = +Inf); no model's scale comes near it (docs/api.md).
  if (!(req.softmax_scale() >= 0 && req.softmax_scale() <= kMaxSoftmaxScale)) {
    return absl::InvalidArgumentError(absl::StrCat("softmax_scale is ", req.softmax_scale(),
                                                   ", expected 0 (= 1/sqrt(head_dim)) "
                                                   "or a value in (0, ",
                                                   kMaxSoftmaxScale, "]"));
  }
  const float scale = req.softmax_scale() == 0 ? 1.0f / std::sqrt(static_cast<float>(s.head_dim))
                                               : req.softmax_scale();
  ModelCache::NewTokens new_tokens;
  RowSource x_new;
  KVCD_RETURN_IF_ERROR(ResolveNewTokens(req, batch, s, &new_tokens, &x_new));
  const bool fused = req.has_k_new() || req.has_v_new();
  lap.Mark(kValidate);
  ModelCache::DeviceIo device;
  KVCD_RETURN_IF_ERROR(BindDecodeIo(req, s, batch, q, out, &device, resp));
  lap.Mark(kIo);
  // Whatever happens below, each sequence's pages are recorded as they end up (this also
  // undoes the reservations of a batch refused half-way).
  absl::Cleanup settle = [&] {
    if (!fused) return;
    for (const auto& sq : seqs) sequences_.Settle(*sq);
  };
  if (fused) {  // one token more per sequence: at most one page more, under the tenant's quota
    for (const auto& sq : seqs) KVCD_RETURN_IF_ERROR(sequences_.ReserveTokens(*sq, 1));
  }
  lap.Mark(kReserve);
  std::vector<Sequence*> raw;
  for (auto& sq : seqs) raw.push_back(sq.get());
  std::vector<int64_t> lengths;
  const auto t0 = std::chrono::steady_clock::now();
  if (out.on_device) {
    KVCD_RETURN_IF_ERROR(m->Attend(req.layer(), raw, nullptr, scale, new_tokens, nullptr, nullptr,
                                   &lengths, &device));
    lap.Mark(kAttend);
    KVCD_RETURN_IF_ERROR(tensors_.MarkWritten(out.o));
    if (out.lse.buffer != out.o.buffer) KVCD_RETURN_IF_ERROR(tensors_.MarkWritten(out.lse));
    lap.Mark(kWritten);
  } else {
    KVCD_RETURN_IF_ERROR(m->Attend(
        req.layer(), raw, q.host.data(), scale, new_tokens,
        reinterpret_cast<float*>(resp->mutable_o()->mutable_inline_data()->data()),
        reinterpret_cast<float*>(resp->mutable_lse()->mutable_inline_data()->data()), &lengths));
    lap.Mark(kAttend);
    // Host results: the call waited for its kernels, so a NaN/±Inf they met is known now.
    for (size_t b = 0; b < seqs.size(); ++b) {
      if (absl::Status f = DeviceFaultStatus(*seqs[b], /*this_call=*/true); !f.ok()) {
        return absl::Status(f.code(), absl::StrCat("sequence_ids[", b, "]: ", f.message()));
      }
    }
  }
  resp->set_kernel_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  for (int64_t l : lengths) resp->add_lengths(l);
  return absl::OkStatus();
}

}  // namespace kvcd
