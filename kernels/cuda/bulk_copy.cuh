// mbarrier and bulk-copy primitives (sm_90) for kernels that stream global memory into
// shared-memory stages: one thread arms a stage's mbarrier with the bytes it expects and
// issues the copies (cp.async.bulk, completing on that mbarrier); the readers wait on the
// stage's phase parity. Shared-memory addresses as 32-bit (__cvta_generic_to_shared).
#pragma once

#include <cstdint>

namespace kvcd::kernels::cuda {

// An mbarrier for one arrival (the thread that issues a stage's copies).
__device__ __forceinline__ void InitBarrier(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
// Makes initialized mbarriers visible to the async proxy (the copies).
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Orders this thread's earlier shared-memory accesses before its later bulk copies.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// This thread's arrival on `bar`, which then also waits for `bytes` of bulk copies.
__device__ __forceinline__ void ExpectBytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// (No memory clobber: what reads the copy is ordered by the mbarrier wait, which has one.)
__device__ __forceinline__ void BulkCopy(uint32_t dst, const void* src, uint32_t bytes,
                                         uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :
               : "r"(dst), "l"(src), "r"(bytes), "r"(bar));
}
// Until the phase with this parity has completed (every expected byte arrived).
__device__ __forceinline__ void WaitBarrier(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}

}  // namespace kvcd::kernels::cuda
