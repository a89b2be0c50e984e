// Helpers of the CUDA formats: the device arguments of a paged row store (cuda_store_rows.h)
// or FSQ code store (cuda_fsq.h) built from a RowSource — device rows are used where they are, host
// rows go up once — and the device check of pages about to be stored. CUDA builds only.
#pragma once

#include <mutex>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcd/kernels/cuda_page_copy.h"
#include "kvcd/kernels/cuda_store_rows.h"
#include "server/formats/cuda_codec.h"
#include "server/formats/page_format.h"

namespace kvcd {

// Device scratch of one format's row stores and checks (guarded by mu).
struct RowStoreScratch {
  std::mutex mu;
  DeviceScratch k, v, slots, spans, faults, check;
  PinnedUploader uploads;  // slot lists go up without blocking the host
};

// What every paged store launch gets besides its rows: the destination slots and the fused
// non-finite check (RowSource::check_finite on device rows): check() is what the launch
// gets (null: the kernel without the check), `sync` whether the Finish call waits for the
// store and reads its count.
struct PagedStoreArgs {
  kernels::cuda::PagedRows dst;
  kernels::cuda::StoreCheck check_args;
  bool checked = false;
  bool sync = false;
  const kernels::cuda::StoreCheck* check() const { return checked ? &check_args : nullptr; }
  int32_t first_layer = 0;
  int64_t first_token = 0;
};

struct RowStoreArgs : PagedStoreArgs {
  kernels::cuda::RowBlock k, v;
  kernels::cuda::RowCodec codec;
};

// Arguments storing `rows` (consecutive source tokens) of k and v into `pool` at every layer
// (layer < 0) or one layer, with the device codec's rotations when `rotate` and its clip
// ratios. REQUIRES: scratch->mu held until the launch is queued.
absl::Status PrepareRowStore(const RowSource& k, const RowSource& v, absl::Span<const RowSlot> rows,
                             int32_t layer, const PagePool& pool, const PageGeometry& g,
                             const CudaCodec* codec, bool rotate, RowStoreScratch* scratch,
                             RowStoreArgs* out);

// Arguments re-storing window page `src_page` of `window_pool` (BF16 rows as the window
// holds them, [K|V][head][slot][head_dim] per layer page) into page `dst_page` of `pool` at
// every layer (a demotion): no rotation, the codec's clip ratios (codec may be null).
// REQUIRES: scratch->mu held until the launch is queued.
absl::Status PrepareWindowPageStore(const PagePool& window_pool, int32_t src_page, int32_t dst_page,
                                    const PagePool& pool, const PageGeometry& g,
                                    const CudaCodec* codec, RowStoreScratch* scratch,
                                    RowStoreArgs* out);

// After the launch of a store prepared by PrepareRowStore: with a synchronous check, waits
// for the store and answers INVALID_ARGUMENT naming the first bad row (k.name / v.name,
// layer, token, head in the source tensor) if the store met a NaN or ±Inf; else OK at once.
// REQUIRES: scratch->mu held since PrepareRowStore.
absl::Status FinishRowStore(const RowSource& k, const RowSource& v, const RowStoreArgs& a,
                            RowStoreScratch* scratch);

// The device arguments of an FSQ code store (cuda_fsq.h LaunchFsqEncodeRows) from residual
// rows x (RowSource rows of residual_width values, head 0).
struct ResidualStoreArgs : PagedStoreArgs {  // dst.num_kv_heads, dst.head_dim unused
  kernels::cuda::RowBlock x;
};

// As PrepareRowStore, for the residuals of `rows` (device x checked by the encode as it
// reads it: synchronously, or marking x.device_faults). REQUIRES: scratch->mu held until the
// launch is queued.
absl::Status PrepareResidualStore(const RowSource& x, absl::Span<const RowSlot> rows, int32_t layer,
                                  const PagePool& pool, const PageGeometry& g,
                                  int32_t residual_width, RowStoreScratch* scratch,
                                  ResidualStoreArgs* out);

// As FinishRowStore: INVALID_ARGUMENT naming x.name[layer, token] when a synchronously
// checked encode met a NaN or +-Inf. REQUIRES: scratch->mu held since PrepareResidualStore.
absl::Status FinishResidualStore(const RowSource& x, const ResidualStoreArgs& a,
                                 RowStoreScratch* scratch);

// Checks num_pages pages of page_bytes bytes (layer_bytes per layer) at device `src`: in each
// layer page, `check_bytes` bytes from `check_offset` must pass `check`
// (kernels::cuda::CopyCheck). INVALID_ARGUMENT naming the first failing page's index
// otherwise. REQUIRES: scratch->mu held.
absl::Status CheckDevicePageRegions(const uint8_t* src, int64_t num_pages, int32_t num_layers,
                                    int64_t layer_bytes, int64_t check_offset, int64_t check_bytes,
                                    uint32_t check, uint32_t check_block, int64_t first_index,
                                    const char* what, RowStoreScratch* scratch);

}  // namespace kvcd
