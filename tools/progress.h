// A per-layer progress bar for the tools: `\r`-redrawn frames on a terminal, nothing when
// the stream is a file or a pipe (logs stay free of carriage-return frames).
#pragma once

#include <cstdio>
#include <functional>

namespace kvcd {

// Draws "[=====     ] layer i/n" on `out` when `out` is a terminal (isatty); otherwise the
// returned function writes nothing.
std::function<void(int layer, int num_layers)> LayerProgress(std::FILE* out);

// The same with the terminal test decided by the caller.
std::function<void(int layer, int num_layers)> LayerProgress(std::FILE* out, bool terminal);

}  // namespace kvcd
