// The order gRPC gives a callback reactor's steps, stated for ThreadSanitizer.
//
// gRPC runs a server reactor's reactions (OnReadDone, OnWriteDone, OnCancel, OnDone) on its
// own threads, each after the constructor and after the operation (StartRead, StartWrite,
// Finish) that led to it. It orders them with locks and atomics inside libgrpc and
// libgrpc++. Where those libraries are not compiled with -fsanitize=thread (the
// distribution's packages, scripts/test-lib.sh tsan_phase), TSan cannot see that order: a
// reaction's first read of a member the constructor wrote (the service pointer, say) looks
// like a race, and so does OnDone's delete.
//
// A reactor calls HandToGrpc(this) before each operation it starts and at the end of its
// constructor, and TakeFromGrpc(this) first in each reaction: a release and an acquire on
// the reactor's address, which is what gRPC guarantees. Races between kvcd's own threads
// (the executor, Drain, SetServing) stay visible: those go through kvcd's mutexes, and the
// annotations only order what gRPC orders. Outside a TSan build both compile to nothing.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define KVCD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVCD_TSAN 1
#endif
#endif

#ifdef KVCD_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace kvcd {

inline void HandToGrpc(const void* reactor) {
#ifdef KVCD_TSAN
  __tsan_release(const_cast<void*>(reactor));
#else
  (void)reactor;
#endif
}

inline void TakeFromGrpc(const void* reactor) {
#ifdef KVCD_TSAN
  __tsan_acquire(const_cast<void*>(reactor));
#else
  (void)reactor;
#endif
}

}  // namespace kvcd
