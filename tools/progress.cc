#include "tools/progress.h"

#include <unistd.h>

namespace kvcd {

std::function<void(int, int)> LayerProgress(std::FILE* out) {
  return LayerProgress(out, isatty(fileno(out)) == 1);
}

std::function<void(int, int)> LayerProgress(std::FILE* out, bool terminal) {
  if (!terminal) return [](int, int) {};
  return [out](int layer, int total) {
    const int width = 30, filled = total ? width * layer / total : width;
    std::fprintf(out, "\r[%.*s%*s] layer %d/%d", filled,
                 "==============================", width - filled, "", layer, total);
    if (layer == total) std::fprintf(out, "\n");
    std::fflush(out);
  };
}

}  // namespace kvcd
