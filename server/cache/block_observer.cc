#include "server/cache/block_observer.h"

namespace kvcd {

void BlockNamer::PagesChanged(const std::string& ns, absl::Span<const int32_t> path,
                              int64_t first_page, bool entered) {
  const BlockNamespace block_ns{model_, ns, format_, static_cast<uint32_t>(page_size_)};
  const std::vector<BlockHash> hashes = BlockHashes(block_ns, path);
  if (first_page < 0 || first_page >= static_cast<int64_t>(hashes.size())) return;
  if (!entered) {
    observer_->BlocksRemoved(block_ns,
                             std::vector<BlockHash>(hashes.begin() + first_page, hashes.end()));
    return;
  }
  std::vector<StoredBlock> blocks;
  blocks.reserve(hashes.size() - static_cast<size_t>(first_page));
  for (size_t i = static_cast<size_t>(first_page); i < hashes.size(); ++i) {
    StoredBlock b;
    b.hash = hashes[i];
    b.parent = i == 0 ? kRootBlockHash : hashes[i - 1];
    b.tokens.assign(path.begin() + static_cast<int64_t>(i) * page_size_,
                    path.begin() + static_cast<int64_t>(i + 1) * page_size_);
    blocks.push_back(std::move(b));
  }
  observer_->BlocksStored(block_ns, std::move(blocks));
}

}  // namespace kvcd
