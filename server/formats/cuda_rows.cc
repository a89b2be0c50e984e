#include "server/formats/cuda_rows.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kvcd/kernels/cuda_page_copy.h"
#include "kvcd/kernels/cuda_runtime_api.h"

namespace kvcd {

namespace kc = kernels::cuda;

namespace {

// The rows of tokens [first, first + n) of every source layer, on the device.
absl::StatusOr<kc::RowBlock> DeviceRows(const RowSource& src, int64_t first, int64_t n,
                                        int32_t layers, int32_t kv_heads, int32_t head_dim,
                                        DeviceScratch* staging) {
  kc::RowBlock b;
  b.bf16 = src.is_bf16;
  b.layer_stride = layers > 1 ? src.layer_stride : 0;
  b.token_stride = src.token_stride;
  b.head_stride = head_dim;
  const int64_t elem = src.is_bf16 ? 2 : 4;
  const auto* base = static_cast<const uint8_t*>(src.data) + first * src.token_stride * elem;
  if (src.on_device) {
    b.data = base;
    return b;
  }
  // Host rows: the bytes from the first row to the end of the last one go up at once.
  const int64_t span =
      ((layers - 1) * b.layer_stride + (n - 1) * src.token_stride + int64_t{kv_heads} * head_dim) *
      elem;
  KVCD_ASSIGN_OR_RETURN(uint8_t * dev, staging->Reserve(static_cast<size_t>(span)));
  KVCD_RETURN_IF_ERROR(
      CudaStatus(kc::CopyToDevice(dev, base, static_cast<size_t>(span)), "staging rows"));
  b.data = dev;
  return b;
}

// The destination slots of `rows` (consecutive source tokens) in dst, inline in the launch
// or uploaded.
absl::Status SetSlots(absl::Span<const RowSlot> rows, int32_t page_size, RowStoreScratch* scratch,
                      kc::PagedRows* dst) {
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t first = rows[0].src_token;
  std::vector<int64_t> slots(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const RowSlot& r = rows[static_cast<size_t>(i)];
    if (r.src_token != first + i) {
      return absl::InternalError("device row stores take consecutive source tokens");
    }
    slots[static_cast<size_t>(i)] = int64_t{r.page} * page_size + r.slot;
  }
  if (n <= kc::PagedRows::kInlineSlots) {  // in the launch's parameters
    std::copy(slots.begin(), slots.end(), dst->inline_slots);
    dst->slots = nullptr;
  } else {
    KVCD_ASSIGN_OR_RETURN(uint8_t * d_slots,
                          scratch->slots.Reserve(slots.size() * sizeof(int64_t)));
    KVCD_RETURN_IF_ERROR(
        scratch->uploads.Upload(d_slots, slots.data(), slots.size() * sizeof(int64_t)));
    dst->slots = reinterpret_cast<const int64_t*>(d_slots);
  }
  dst->num_tokens = n;
  return absl::OkStatus();
}

// The fused non-finite check of a store of n tokens from `first`: pipelined (faults, one per
// source token) or synchronous (count and first bad row, *sync = true).
absl::Status SetCheck(const kernels::DeviceFault* faults, int64_t first, int64_t n,
                      RowStoreScratch* scratch, kc::StoreCheck* c, bool* sync) {
  *c = kc::StoreCheck{};
  *sync = false;
  if (faults != nullptr) {  // pipelined: a bad row marks its sequence, nobody waits
    if (n <= kc::PagedRows::kInlineSlots) {
      std::copy(faults + first, faults + first + n, c->inline_faults);
      c->use_inline_faults = true;
    } else {
      const size_t bytes = static_cast<size_t>(n) * sizeof(kernels::DeviceFault);
      KVCD_ASSIGN_OR_RETURN(uint8_t * d, scratch->faults.Reserve(bytes));
      KVCD_RETURN_IF_ERROR(scratch->uploads.Upload(d, faults + first, bytes));
      c->faults = reinterpret_cast<const kernels::DeviceFault*>(d);
    }
    return absl::OkStatus();
  }
  // Synchronous: count and first bad row, read back after the store.
  KVCD_ASSIGN_OR_RETURN(uint8_t * d, scratch->check.Reserve(2 * sizeof(unsigned long long)));
  const unsigned long long init[2] = {0, ~0ull};
  KVCD_RETURN_IF_ERROR(scratch->uploads.Upload(d, init, sizeof(init)));
  c->count = reinterpret_cast<unsigned long long*>(d);
  c->first_row = c->count + 1;
  *sync = true;
  return absl::OkStatus();
}

// The paged destination of layer l0 on (layers of the store) of `pool`.
void SetPool(const PagePool& pool, int32_t l0, int32_t layers, int32_t page_size,
             kc::PagedRows* dst) {
  dst->num_layers = layers;
  dst->page_size = page_size;
  dst->base = pool.LayerBase(l0);
  dst->layer_stride = int64_t{pool.num_pages()} * pool.layer_page_bytes();
  dst->page_bytes = pool.layer_page_bytes();
}

// The (count, first bad row) a synchronous check left on the device; count 0 = clean.
absl::Status ReadCheck(const kc::StoreCheck& c, unsigned long long got[2]) {
  // The copy waits for the store.
  return CudaStatus(kc::CopyToHost(got, c.count, 2 * sizeof(unsigned long long)),
                    "reading the non-finite count of a row store");
}

}  // namespace

absl::Status PrepareRowStore(const RowSource& k, const RowSource& v, absl::Span<const RowSlot> rows,
                             int32_t layer, const PagePool& pool, const PageGeometry& g,
                             const CudaCodec* codec, bool rotate, RowStoreScratch* scratch,
                             RowStoreArgs* out) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if (n == 0) return absl::OkStatus();
  const int64_t first = rows[0].src_token;
  KVCD_RETURN_IF_ERROR(SetSlots(rows, g.page_size, scratch, &out->dst));
  const int32_t layers = layer < 0 ? g.num_layers : 1;
  KVCD_ASSIGN_OR_RETURN(out->k,
                        DeviceRows(k, first, n, layers, g.num_kv_heads, g.head_dim, &scratch->k));
  KVCD_ASSIGN_OR_RETURN(out->v,
                        DeviceRows(v, first, n, layers, g.num_kv_heads, g.head_dim, &scratch->v));
  const int32_t l0 = layer < 0 ? 0 : layer;
  SetPool(pool, l0, layers, g.page_size, &out->dst);
  out->dst.num_kv_heads = g.num_kv_heads;
  out->dst.head_dim = g.head_dim;
  out->codec = kc::RowCodec{};
  if (codec != nullptr) {
    const int64_t m = codec->matrix_elems();
    if (rotate) {
      out->codec.r_k = codec->r_k() + l0 * m;
      out->codec.r_v = codec->r_v() + l0 * m;
      out->codec.r_layer_stride = m;
      out->codec.hadamard_k = codec->hadamard_k() + l0;
      out->codec.hadamard_v = codec->hadamard_v() + l0;
    }
    out->codec.rho_k = codec->rho_k() + l0;
    out->codec.rho_v = codec->rho_v() + l0;
  }
  out->first_layer = l0;
  out->first_token = first;
  out->checked = false;
  out->sync = false;
  // Device rows have not been checked: the store checks them as it reads them. Host rows
  // were scanned before they went up.
  const bool device_rows = (k.on_device && k.check_finite) || (v.on_device && v.check_finite);
  if (!device_rows) return absl::OkStatus();
  KVCD_RETURN_IF_ERROR(SetCheck(k.device_faults != nullptr ? k.device_faults : v.device_faults,
                                first, n, scratch, &out->check_args, &out->sync));
  out->checked = true;
  return absl::OkStatus();
}

absl::Status PrepareWindowPageStore(const PagePool& window_pool, int32_t src_page, int32_t dst_page,
                                    const PagePool& pool, const PageGeometry& g,
                                    const CudaCodec* codec, RowStoreScratch* scratch,
                                    RowStoreArgs* out) {
  const int32_t ps = g.page_size, d = g.head_dim;
  std::vector<RowSlot> rows;
  for (int32_t t = 0; t < ps; ++t) rows.push_back({t, dst_page, t});
  RowSource k;
  k.on_device = true;
  k.is_bf16 = true;
  k.data = window_pool.PagePtr(0, src_page);
  k.token_stride = d;
  k.layer_stride = int64_t{window_pool.num_pages()} * window_pool.layer_page_bytes() / 2;
  RowSource v = k;
  v.data = window_pool.PagePtr(0, src_page) + int64_t{g.num_kv_heads} * ps * d * 2;
  KVCD_RETURN_IF_ERROR(
      PrepareRowStore(k, v, rows, -1, pool, g, codec, /*rotate=*/false, scratch, out));
  out->k.head_stride = out->v.head_stride = int64_t{ps} * d;
  return absl::OkStatus();
}

absl::Status PrepareResidualStore(const RowSource& x, absl::Span<const RowSlot> rows, int32_t layer,
                                  const PagePool& pool, const PageGeometry& g,
                                  int32_t residual_width, RowStoreScratch* scratch,
                                  ResidualStoreArgs* out) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if (n == 0) return absl::OkStatus();
  const int64_t first = rows[0].src_token;
  KVCD_RETURN_IF_ERROR(SetSlots(rows, g.page_size, scratch, &out->dst));
  const int32_t layers = layer < 0 ? g.num_layers : 1;
  KVCD_ASSIGN_OR_RETURN(out->x, DeviceRows(x, first, n, layers, 1, residual_width, &scratch->k));
  const int32_t l0 = layer < 0 ? 0 : layer;
  SetPool(pool, l0, layers, g.page_size, &out->dst);
  out->first_layer = l0;
  out->first_token = first;
  out->checked = false;
  out->sync = false;
  if (!(x.on_device && x.check_finite)) return absl::OkStatus();
  KVCD_RETURN_IF_ERROR(SetCheck(x.device_faults, first, n, scratch, &out->check_args, &out->sync));
  out->checked = true;
  return absl::OkStatus();
}

absl::Status FinishResidualStore(const RowSource& x, const ResidualStoreArgs& a,
                                 RowStoreScratch* /*scratch*/) {
  if (!a.sync) return absl::OkStatus();
  unsigned long long got[2] = {0, 0};
  KVCD_RETURN_IF_ERROR(ReadCheck(a.check_args, got));
  if (got[0] == 0) return absl::OkStatus();
  // Row index layer * tokens + token of the launch (cuda_fsq.h LaunchFsqEncodeRows).
  const uint64_t tokens = static_cast<uint64_t>(std::max<int64_t>(1, a.dst.num_tokens));
  const int64_t token = a.first_token + static_cast<int64_t>(got[1] % tokens);
  const int64_t layer = a.first_layer + static_cast<int64_t>(got[1] / tokens);
  return absl::InvalidArgumentError(absl::StrCat(
      x.name, "[", layer, ", ", token, ", :] (layer, token) holds NaN or +-Inf (", got[0],
      " non-finite value(s) in ", x.name, "); expected finite residuals; nothing was stored"));
}

absl::Status FinishRowStore(const RowSource& k, const RowSource& v, const RowStoreArgs& a,
                            RowStoreScratch* /*scratch*/) {
  if (!a.sync) return absl::OkStatus();
  unsigned long long got[2] = {0, 0};
  KVCD_RETURN_IF_ERROR(ReadCheck(a.check_args, got));
  if (got[0] == 0) return absl::OkStatus();
  // Row index ((layer * tokens + token) * 2 + which) * heads + head of the launch.
  uint64_t r = got[1];
  const uint64_t heads = static_cast<uint64_t>(a.dst.num_kv_heads);
  const uint64_t head = r % heads;
  r /= heads;
  const uint64_t which = r & 1;
  r >>= 1;
  const uint64_t tokens = static_cast<uint64_t>(std::max<int64_t>(1, a.dst.num_tokens));
  const int64_t token = a.first_token + static_cast<int64_t>(r % tokens);
  const int64_t layer = a.first_layer + static_cast<int64_t>(r / tokens);
  const RowSource& src = which == 0 ? k : v;
  return absl::InvalidArgumentError(absl::StrCat(
      src.name, "[", layer, ", ", token, ", ", head, ", :] (layer, token, KV head) holds NaN or ",
      "+-Inf (", got[0], " non-finite value(s) in ", k.name, " and ", v.name,
      " in all); expected finite values; nothing was stored"));
}

absl::Status CheckDevicePageRegions(const uint8_t* src, int64_t num_pages, int32_t num_layers,
                                    int64_t layer_bytes, int64_t check_offset, int64_t check_bytes,
                                    uint32_t check, uint32_t check_block, int64_t first_index,
                                    const char* what, RowStoreScratch* scratch) {
  if (num_pages <= 0) return absl::OkStatus();
  KVCD_ASSIGN_OR_RETURN(uint8_t * d, scratch->spans.Reserve(sizeof(unsigned long long)));
  auto* d_bad = reinterpret_cast<unsigned long long*>(d);
  // One check launch over all pages; only a failing call walks its pages to name the first
  // bad one.
  auto count = [&](int64_t first, int64_t n) -> absl::StatusOr<unsigned long long> {
    kc::PagedCopyArgs a;
    a.layer_bytes = layer_bytes;
    a.num_layers = num_layers;
    a.num_pages = n;
    a.run = const_cast<uint8_t*>(src) + first * num_layers * layer_bytes;
    a.check = check;
    a.check_block = check_block;
    a.check_offset = check_offset;
    a.check_bytes = check_bytes;
    const unsigned long long zero = 0;
    KVCD_RETURN_IF_ERROR(CudaStatus(kc::CopyToDevice(d_bad, &zero, sizeof(zero)), "page check"));
    KVCD_RETURN_IF_ERROR(
        CudaStatus(kc::LaunchPagedCopy(kc::PageCopy::kCheck, a, d_bad, nullptr), "page check"));
    unsigned long long bad = 0;
    KVCD_RETURN_IF_ERROR(CudaStatus(kc::CopyToHost(&bad, d_bad, sizeof(bad)), "page check"));
    return bad;
  };
  KVCD_ASSIGN_OR_RETURN(unsigned long long bad, count(0, num_pages));
  if (bad == 0) return absl::OkStatus();
  for (int64_t p = 0; p < num_pages; ++p) {
    KVCD_ASSIGN_OR_RETURN(unsigned long long page_bad, count(p, 1));
    if (page_bad != 0) {
      return absl::InvalidArgumentError(absl::StrCat("page ", first_index + p, " holds ", page_bad,
                                                     " ", what, "; nothing was stored"));
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("pages hold ", bad, " ", what, "; nothing was stored"));
}

}  // namespace kvcd
