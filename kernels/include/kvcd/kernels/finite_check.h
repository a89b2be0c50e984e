// Finite-value checks of K/V rows, residuals and queries as they arrive from a client
// (host memory, any alignment). A NaN or an infinity stored in a shared prefix poisons
// every later reader of it (an LSE of inf), so the daemon refuses them at the edge.
// Framework-free; the scan is a branch-free OR over blocks that the compiler vectorizes,
// and it stops at the first block that holds a bad value.
#pragma once

#include <cstdint>

namespace kvcd::kernels {

// Index of the first NaN or ±Inf among `count` values at `data` (BF16 if bf16, else
// IEEE F32), or -1 when all are finite. `data` needs no alignment.
int64_t FirstNonFinite(const void* data, int64_t count, bool bf16);

// The scalar reference: the same answer, one value at a time through std::isfinite.
int64_t FirstNonFiniteReference(const void* data, int64_t count, bool bf16);

// Copies `count` BF16 values from src to dst (no overlap) and returns whether all are
// finite, in one loop: each value is read once (the check fused into a page write).
bool CopyBf16AllFinite(const uint16_t* src, uint16_t* dst, int64_t count);

// Whether all `count` values at `data` are finite (FirstNonFinite(...) < 0, one pass
// without early exit, for rows that were just read and sit in L1).
bool AllFinite(const void* data, int64_t count, bool bf16);

}  // namespace kvcd::kernels
