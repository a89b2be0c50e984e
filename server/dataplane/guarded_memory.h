// Guarded access to memory that another process can take away: a decode channel maps a
// shared-memory object that its client created and may ftruncate at any time, after
// which touching the mapping raises SIGBUS. Sealing (F_SEAL_SHRINK) would prevent that,
// but only on a memfd the daemon created and handed over; the channel's object is the
// client's (the protocol names it by shm_name), so the daemon cannot stop the shrink and
// instead survives it: every access to the mapping goes through RunGuarded, which turns a
// SIGBUS inside [lo, lo + bytes) on the calling thread into a false return. The caller
// then closes that one channel; other channels and the daemon carry on.
//
// The SIGBUS handler is installed once per process (first use) and hands faults outside
// a guarded range to the disposition it replaced (by default: the process dies, as it
// would have without it).
//
// Thread safety: thread-safe; guards are per thread.
#pragma once

#include <cstddef>

namespace kvcd {

// Runs fn(arg) and returns true, or returns false if fn faulted with SIGBUS on an
// address in [lo, lo + bytes). REQUIRES: fn owns no resources that a jump out of it
// would leak (plain copies and atomic loads/stores of the mapping only).
bool RunGuarded(const void* lo, size_t bytes, void (*fn)(void*), void* arg);

// Guarded memcpy; false if the copy faulted inside [lo, lo + bytes).
bool CopyGuarded(void* dst, const void* src, size_t n, const void* lo, size_t bytes);

}  // namespace kvcd
