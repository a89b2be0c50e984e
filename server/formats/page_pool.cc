#include "server/formats/page_pool.h"

namespace kvcd {

PagePool::PagePool(std::string format, uint8_t* base, int32_t num_layers, int64_t layer_page_bytes,
                   int32_t num_pages)
    : format_(std::move(format)),
      base_(base),
      num_layers_(num_layers),
      layer_page_bytes_(layer_page_bytes),
      num_pages_(num_pages) {
  free_.reserve(static_cast<size_t>(num_pages));
  // Lowest ids on top of the stack, so a fresh pool hands out 0, 1, 2, ...
  for (int32_t i = num_pages - 1; i >= 0; --i) free_.push_back(i);
}

bool PagePool::Allocate(int32_t n, std::vector<int32_t>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (n < 0 || static_cast<size_t>(n) > free_.size()) return false;
  for (int32_t i = 0; i < n; ++i) {
    out->push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void PagePool::Free(absl::Span<const int32_t> ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int32_t id : ids) free_.push_back(id);
}

int32_t PagePool::used_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_pages_ - static_cast<int32_t>(free_.size());
}

int32_t PagePool::free_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int32_t>(free_.size());
}

}  // namespace kvcd
