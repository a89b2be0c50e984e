// Synthetic KV for the example workers, produced on the worker's GPU: BF16 pages, INT2
// pages as stored (random codes with valid FP16 scales and minimums), per-step K/V rows
// and the next layer's queries computed from the previous layer's output (so every
// decode call depends on the one before it, as in a real model).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvcd::workers {

// n BF16 values in [-1, 1) from (seed, index).
cudaError_t FillBf16(uint16_t* p, int64_t n, uint64_t seed, cudaStream_t stream);
// `chunks` INT2 page-layers of `bytes` each, back to back: random code bytes, then
// `params` FP16 values at byte `params_offset` of each chunk in blocks of `block`
// alternating scale (0.01..0.05) and minimum (-0.1..0), zero padding after.
cudaError_t FillInt2PageLayers(uint8_t* p, int64_t chunks, int64_t bytes, int64_t params_offset,
                               int64_t params, int block, uint64_t seed, cudaStream_t stream);
// q[i] = bf16(0.5 * o[i] + noise(seed, i)) for i < n.
cudaError_t NextQueries(const float* o, uint16_t* q, int64_t n, uint64_t seed, cudaStream_t stream);
// A decode step's inputs in one launch: NextQueries(o, q, q_n, key), then FillBf16 of k and v
// (kv_n each) with key ^ 1 and key ^ 2 and of x (x_n, none when 0) with key ^ 3, the same
// values. The decode worker's per-layer producer: the work a model's layer does before its
// attention is not in the in-process cuDNN loop it is compared with, so it costs one
// launch, not four.
cudaError_t ProduceStep(const float* o, uint16_t* q, int64_t q_n, uint16_t* k, uint16_t* v,
                        int64_t kv_n, uint16_t* x, int64_t x_n, uint64_t key, cudaStream_t stream);

}  // namespace kvcd::workers
