#include "server/cache/radix_tree.h"

#include <algorithm>
#include <queue>
#include <tuple>

#include "absl/hash/hash.h"

namespace kvcd {

namespace {

// Transparent hash/equality so children can be looked up by a span of the request's
// tokens without copying them into a vector.
struct PageKeyHash {
  using is_transparent = void;
  size_t operator()(absl::Span<const int32_t> s) const {
    return absl::Hash<absl::Span<const int32_t>>()(s);
  }
  size_t operator()(const std::vector<int32_t>& v) const { return (*this)(absl::MakeConstSpan(v)); }
};
struct PageKeyEq {
  using is_transparent = void;
  bool operator()(absl::Span<const int32_t> a, absl::Span<const int32_t> b) const { return a == b; }
};

}  // namespace

struct RadixTree::Node {
  std::vector<int32_t> key;    // edge tokens, a multiple of page_size
  std::vector<PageRef> pages;  // key.size() / page_size
  Node* parent = nullptr;
  // Children keyed by the first page of their edge.
  absl::flat_hash_map<std::vector<int32_t>, std::unique_ptr<Node>, PageKeyHash, PageKeyEq> children;
  int32_t pins = 0;  // pins of this node and of its descendants
  uint64_t last_access = 0;
  Origin origin = Origin::kPut;
};

namespace {

std::vector<int32_t> FirstPage(absl::Span<const int32_t> tokens, int32_t page_size) {
  return std::vector<int32_t>(tokens.begin(), tokens.begin() + page_size);
}

}  // namespace

RadixTree::RadixTree(int32_t page_size) : page_size_(page_size) {}
RadixTree::~RadixTree() = default;

RadixTree::Node* RadixTree::Root(const std::string& ns, bool create) {
  auto it = roots_.find(ns);
  if (it != roots_.end()) return it->second.get();
  if (!create) return nullptr;
  auto root = std::make_unique<Node>();
  Node* raw = root.get();
  roots_.emplace(ns, std::move(root));
  return raw;
}

RadixTree::Node* RadixTree::Split(Node* node, int64_t keep_pages) {
  // node (key = A|B) becomes mid (key = A) -> node (key = B).
  Node* parent = node->parent;
  auto mid = std::make_unique<Node>();
  mid->key.assign(node->key.begin(), node->key.begin() + keep_pages * page_size_);
  mid->pages.assign(node->pages.begin(), node->pages.begin() + keep_pages);
  mid->parent = parent;
  mid->pins = node->pins;
  mid->last_access = node->last_access;
  mid->origin = node->origin;
  node->key.erase(node->key.begin(), node->key.begin() + keep_pages * page_size_);
  node->pages.erase(node->pages.begin(), node->pages.begin() + keep_pages);
  auto self = parent->children.extract(FirstPage(mid->key, page_size_));
  std::unique_ptr<Node> owned = std::move(self.mapped());
  owned->parent = mid.get();
  Node* mid_raw = mid.get();
  mid->children.emplace(FirstPage(owned->key, page_size_), std::move(owned));
  parent->children.emplace(FirstPage(mid_raw->key, page_size_), std::move(mid));
  ++num_nodes_;
  return mid_raw;
}

RadixTree::MatchResult RadixTree::Walk(Node* root, absl::Span<const int32_t> tokens, bool split) {
  MatchResult r;
  Node* node = root;
  const int64_t n = static_cast<int64_t>(tokens.size());
  int64_t pos = 0;
  const uint64_t now = ++clock_;
  while (pos + page_size_ <= n) {
    auto it = node->children.find(tokens.subspan(pos, page_size_));
    if (it == node->children.end()) break;
    Node* child = it->second.get();
    const int64_t child_pages = static_cast<int64_t>(child->pages.size());
    int64_t m = 1;  // the first page matched through the hash key
    while (m < child_pages && pos + (m + 1) * page_size_ <= n &&
           std::equal(child->key.begin() + m * page_size_,
                      child->key.begin() + (m + 1) * page_size_,
                      tokens.begin() + pos + m * page_size_)) {
      ++m;
    }
    if (m < child_pages && split) child = Split(child, m);
    child->last_access = now;
    r.pages.insert(r.pages.end(), child->pages.begin(), child->pages.begin() + m);
    if (child->origin == Origin::kCommit) r.committed_tokens += m * page_size_;
    pos += m * page_size_;
    r.node = child;
    if (m < child_pages) break;
    node = child;
  }
  r.tokens = pos;
  return r;
}

RadixTree::MatchResult RadixTree::Match(const std::string& ns, absl::Span<const int32_t> tokens) {
  Node* root = Root(ns, false);
  if (root == nullptr) return {};
  return Walk(root, tokens, /*split=*/false);
}

RadixTree::MatchResult RadixTree::MatchAndPin(const std::string& ns,
                                              absl::Span<const int32_t> tokens) {
  Node* root = Root(ns, false);
  if (root == nullptr) return {};
  MatchResult r = Walk(root, tokens, /*split=*/true);
  for (Node* p = r.node; p != nullptr && p != root; p = p->parent) ++p->pins;
  return r;
}

void RadixTree::Unpin(Node* node) {
  for (Node* p = node; p != nullptr && p->parent != nullptr; p = p->parent) --p->pins;
}

void RadixTree::Pin(Node* node) {
  for (Node* p = node; p != nullptr && p->parent != nullptr; p = p->parent) ++p->pins;
}

RadixTree::InsertResult RadixTree::Insert(const std::string& ns, absl::Span<const int32_t> tokens,
                                          absl::Span<const PageRef> pages, Origin origin) {
  InsertResult r;
  const int64_t total_pages = static_cast<int64_t>(pages.size());
  if (total_pages == 0) return r;
  Node* node = Root(ns, true);
  const uint64_t now = ++clock_;
  int64_t page = 0;
  while (page < total_pages) {
    const auto chunk = tokens.subspan(page * page_size_, page_size_);
    auto it = node->children.find(chunk);
    if (it == node->children.end()) {
      auto leaf = std::make_unique<Node>();
      leaf->key.assign(tokens.begin() + page * page_size_,
                       tokens.begin() + total_pages * page_size_);
      leaf->pages.assign(pages.begin() + page, pages.end());
      leaf->parent = node;
      leaf->last_access = now;
      leaf->origin = origin;
      node->children.emplace(FirstPage(chunk, page_size_), std::move(leaf));
      if (listener_ != nullptr) {
        listener_->PagesChanged(ns, tokens.first(total_pages * page_size_), page, true);
      }
      r.new_pages += total_pages - page;
      cached_pages_ += total_pages - page;
      if (origin == Origin::kCommit) committed_pages_ += total_pages - page;
      ++num_nodes_;
      return r;
    }
    Node* child = it->second.get();
    const int64_t child_pages = static_cast<int64_t>(child->pages.size());
    int64_t m = 1;
    while (m < child_pages && page + m < total_pages &&
           std::equal(child->key.begin() + m * page_size_,
                      child->key.begin() + (m + 1) * page_size_,
                      tokens.begin() + (page + m) * page_size_)) {
      ++m;
    }
    r.duplicates.insert(r.duplicates.end(), pages.begin() + page, pages.begin() + page + m);
    if (m < child_pages) child = Split(child, m);
    child->last_access = now;
    page += m;
    node = child;
  }
  return r;
}

int64_t RadixTree::Evict(const std::function<bool()>& want_more,
                         const std::function<void(const PageRef&)>& on_free,
                         const std::string* only) {
  // (last access, node, its namespace: roots_ is not changed until the end, so the key
  // pointers stay valid).
  using Entry = std::tuple<uint64_t, Node*, const std::string*>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  std::vector<std::pair<Node*, const std::string*>> stack;
  for (auto& [ns, root] : roots_) {
    if (only == nullptr || ns == *only) stack.emplace_back(root.get(), &ns);
  }
  while (!stack.empty()) {
    auto [n, ns] = stack.back();
    stack.pop_back();
    if (n->parent != nullptr && n->children.empty() && n->pins == 0) {
      heap.emplace(n->last_access, n, ns);
    }
    for (auto& [k, c] : n->children) stack.emplace_back(c.get(), ns);
  }
  int64_t freed = 0;
  while (!heap.empty() && want_more()) {
    Node* leaf = std::get<1>(heap.top());
    const std::string* leaf_ns = std::get<2>(heap.top());
    heap.pop();
    if (listener_ != nullptr) {
      const std::vector<int32_t> path = PathTo(leaf);
      listener_->PagesChanged(
          *leaf_ns, path,
          static_cast<int64_t>(path.size()) / page_size_ - static_cast<int64_t>(leaf->pages.size()),
          false);
    }
    for (const PageRef& p : leaf->pages) on_free(p);
    freed += static_cast<int64_t>(leaf->pages.size());
    cached_pages_ -= static_cast<int64_t>(leaf->pages.size());
    if (leaf->origin == Origin::kCommit) {
      committed_pages_ -= static_cast<int64_t>(leaf->pages.size());
    }
    Node* parent = leaf->parent;
    parent->children.erase(FirstPage(leaf->key, page_size_));  // destroys leaf
    --num_nodes_;
    if (parent->parent != nullptr && parent->children.empty() && parent->pins == 0) {
      heap.emplace(parent->last_access, parent, leaf_ns);
    }
  }
  // Drop namespaces that became empty.
  for (auto it = roots_.begin(); it != roots_.end();) {
    if (it->second->children.empty()) {
      roots_.erase(it++);
    } else {
      ++it;
    }
  }
  return freed;
}

std::vector<int32_t> RadixTree::PathTo(const Node* node) {
  std::vector<const Node*> chain;
  size_t n = 0;
  for (const Node* at = node; at != nullptr; at = at->parent) {
    chain.push_back(at);
    n += at->key.size();
  }
  std::vector<int32_t> path;
  path.reserve(n);
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    path.insert(path.end(), (*it)->key.begin(), (*it)->key.end());
  }
  return path;
}

void RadixTree::ReplayTo(Listener* listener) const {
  if (listener == nullptr) return;
  for (const auto& [ns, root] : roots_) {
    // Depth first, parents before children, the path kept as a stack of edges.
    std::vector<int32_t> path;
    std::vector<std::pair<const Node*, size_t>> stack;  // node, path length before its edge
    for (const auto& [k, c] : root->children) stack.emplace_back(c.get(), 0);
    while (!stack.empty()) {
      auto [n, before] = stack.back();
      stack.pop_back();
      path.resize(before);
      path.insert(path.end(), n->key.begin(), n->key.end());
      listener->PagesChanged(ns, path, static_cast<int64_t>(before) / page_size_, true);
      for (const auto& [k, c] : n->children) stack.emplace_back(c.get(), path.size());
    }
  }
}

int64_t RadixTree::EvictablePages(int32_t pool, const std::string* only,
                                  const std::function<bool(const PageRef&)>& frees) const {
  int64_t evictable = 0;
  std::vector<const Node*> stack;
  for (const auto& [ns, root] : roots_) {
    if (only == nullptr || ns == *only) stack.push_back(root.get());
  }
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    if (n->parent != nullptr && n->pins == 0) {
      for (const PageRef& p : n->pages) {
        evictable += p.pool == pool && (!frees || frees(p)) ? 1 : 0;
      }
    }
    for (const auto& [k, c] : n->children) stack.push_back(c.get());
  }
  return evictable;
}

int64_t RadixTree::PinnedPages() const {
  int64_t pinned = 0;
  std::vector<const Node*> stack;
  for (const auto& [ns, root] : roots_) stack.push_back(root.get());
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    if (n->parent != nullptr && n->pins > 0) pinned += static_cast<int64_t>(n->pages.size());
    for (const auto& [k, c] : n->children) stack.push_back(c.get());
  }
  return pinned;
}

}  // namespace kvcd
