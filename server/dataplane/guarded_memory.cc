#include "server/dataplane/guarded_memory.h"

#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace kvcd {
namespace {

struct Guard {
  sigjmp_buf env;
  uintptr_t lo = 0;
  uintptr_t hi = 0;
};

thread_local Guard* t_guard = nullptr;
struct sigaction g_previous {};

void OnSigbus(int sig, siginfo_t* info, void* context) {
  Guard* g = t_guard;
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  if (g != nullptr && addr >= g->lo && addr < g->hi) siglongjmp(g->env, 1);
  // Not a guarded access: what would have happened without this handler.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: returning re-runs the faulting access, which now kills the process.
  signal(sig, SIG_DFL);
}

void InstallOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous);
  });
}

struct CopyArgs {
  void* dst;
  const void* src;
  size_t n;
};

}  // namespace

bool RunGuarded(const void* lo, size_t bytes, void (*fn)(void*), void* arg) {
  InstallOnce();
  Guard g;
  g.lo = reinterpret_cast<uintptr_t>(lo);
  g.hi = g.lo + bytes;
  Guard* const outer = t_guard;  // guards nest (never in practice, but stay correct)
  if (sigsetjmp(g.env, 1) != 0) {
    t_guard = outer;
    return false;
  }
  t_guard = &g;
  fn(arg);
  t_guard = outer;
  return true;
}

bool CopyGuarded(void* dst, const void* src, size_t n, const void* lo, size_t bytes) {
  CopyArgs a{dst, src, n};
  return RunGuarded(
      lo, bytes,
      [](void* p) {
        auto* c = static_cast<CopyArgs*>(p);
        std::memcpy(c->dst, c->src, c->n);
      },
      &a);
}

}  // namespace kvcd
