// Unguessable 64-bit ids (sequences, buffers, decode channels, NCCL communicators): drawn
// from the kernel's random source, so an id cannot be predicted from another one and an
// id handed out by an earlier daemon process is, with overwhelming probability, never
// handed out again. Never returns 0 (0 means "unset" in the API).
#pragma once

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>

namespace kvcd {

inline uint64_t RandomId64() {
  uint64_t id = 0;
  while (id == 0) {
    char* p = reinterpret_cast<char*>(&id);
    size_t got = 0;
    while (got < sizeof(id)) {
      const ssize_t n = getrandom(p + got, sizeof(id) - got, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) std::abort();  // no kernel random source at all: ids would be guessable
      got += static_cast<size_t>(n);
    }
  }
  return id;
}

}  // namespace kvcd
