// PagePool: fixed-size pages of one storage format, carved once from backend memory.
//
// Memory layout: [num_layers][num_pages][layer_page_bytes], so a kernel walks one
// layer's pages from one base pointer and a page table (docs/architecture.md "The cache").
// Page ids are indices, never pointers. Allocation is all-or-nothing and never touches the heap.
//
// Thread safety: Allocate/Free/counters are thread-safe. Page contents are not
// synchronized here; callers own the pages they allocated.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/types/span.h"

namespace kvcd {

class PagePool {
 public:
  // `base` points at num_layers * num_pages * layer_page_bytes bytes owned by the caller
  // (the backend), which must outlive the pool.
  PagePool(std::string format, uint8_t* base, int32_t num_layers, int64_t layer_page_bytes,
           int32_t num_pages);
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  const std::string& format() const { return format_; }
  int32_t num_pages() const { return num_pages_; }
  int32_t num_layers() const { return num_layers_; }
  int64_t layer_page_bytes() const { return layer_page_bytes_; }
  // Bytes of one page over all layers.
  int64_t page_bytes() const { return layer_page_bytes_ * num_layers_; }

  // Allocates n pages into *out (appended). Returns false, allocating none, when fewer
  // than n are free.
  bool Allocate(int32_t n, std::vector<int32_t>* out);
  // REQUIRES: every id was allocated and not yet freed.
  void Free(absl::Span<const int32_t> ids);

  int32_t used_pages() const;
  int32_t free_pages() const;

  uint8_t* LayerBase(int32_t layer) const {
    return base_ + static_cast<int64_t>(layer) * num_pages_ * layer_page_bytes_;
  }
  uint8_t* PagePtr(int32_t layer, int32_t page) const {
    return LayerBase(layer) + static_cast<int64_t>(page) * layer_page_bytes_;
  }

 private:
  const std::string format_;
  uint8_t* const base_;
  const int32_t num_layers_;
  const int64_t layer_page_bytes_;
  const int32_t num_pages_;
  mutable std::mutex mu_;
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);  // stack of free ids
};

}  // namespace kvcd
