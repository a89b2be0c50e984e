// What the rest of a cluster hears of this daemon's tree (docs/cluster.md): full pages
// entering and leaving it, each named by its block hash (common/block_hash.h). The cache
// knows nothing of who listens (the Redis block index, the ZeroMQ KV events); a model's
// BlockNamer turns the tree's token paths into named blocks for one BlockObserver.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/block_hash.h"
#include "server/cache/radix_tree.h"

namespace kvcd {

struct StoredBlock {
  BlockHash hash;
  BlockHash parent;             // kRootBlockHash for page 0
  std::vector<int32_t> tokens;  // the page's page_size token ids
};

// Called under a model's lock, on the request's thread: implementations queue and return,
// never block on I/O.
class BlockObserver {
 public:
  virtual ~BlockObserver() = default;
  // Pages entered the tree, in chain order (each block's parent is the one before it, or
  // an ancestor already stored).
  virtual void BlocksStored(const BlockNamespace& ns, std::vector<StoredBlock> blocks) = 0;
  // Pages left the tree (eviction).
  virtual void BlocksRemoved(const BlockNamespace& ns, std::vector<BlockHash> hashes) = 0;
};

// Several observers (the block index, the events), each told everything, in order.
class BlockObservers final : public BlockObserver {
 public:
  void Add(BlockObserver* o) { list_.push_back(o); }
  bool empty() const { return list_.empty(); }
  void BlocksStored(const BlockNamespace& ns, std::vector<StoredBlock> blocks) override {
    for (size_t i = 0; i < list_.size(); ++i) {
      list_[i]->BlocksStored(ns, i + 1 == list_.size() ? std::move(blocks) : blocks);
    }
  }
  void BlocksRemoved(const BlockNamespace& ns, std::vector<BlockHash> hashes) override {
    for (size_t i = 0; i < list_.size(); ++i) {
      list_[i]->BlocksRemoved(ns, i + 1 == list_.size() ? std::move(hashes) : hashes);
    }
  }

 private:
  std::vector<BlockObserver*> list_;
};

// The RadixTree listener of one model: names the pages with the model's name, history
// format and page size, the tree's namespace being the tenant (cache_salt).
class BlockNamer final : public RadixTree::Listener {
 public:
  BlockNamer(std::string model, std::string format, int32_t page_size, BlockObserver* observer)
      : model_(std::move(model)),
        format_(std::move(format)),
        page_size_(page_size),
        observer_(observer) {}
  void PagesChanged(const std::string& ns, absl::Span<const int32_t> path, int64_t first_page,
                    bool entered) override;

 private:
  const std::string model_, format_;
  const int32_t page_size_;
  BlockObserver* const observer_;
};

}  // namespace kvcd
