// RadixTree: page-granular prefix cache over token ids (docs/architecture.md "The cache").
//
// Edges are page-aligned token chunks; each node owns the pages of its edge. Keys are
// namespaced (model profile is implicit: one tree per model; the namespace is the
// tenant's cache_salt), so a tenant never matches another tenant's pages. A partial
// trailing page is never stored. Pinned nodes (and their ancestors) are never evicted;
// eviction removes least-recently-used unpinned leaves. Every node records the origin of
// its pages: a Put / PushPages (kPut) or a sequence's commit (kCommit, docs/sessions.md);
// a chunk already present keeps the origin it entered with.
//
// Thread safety: none; the owner (ModelCache) serializes all calls.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace kvcd {

// A page in one of a model's pools.
struct PageRef {
  int32_t pool = 0;  // index into the model's pools
  int32_t page = 0;  // page id in that pool
  bool operator==(const PageRef& o) const { return pool == o.pool && page == o.page; }
};

class RadixTree {
 public:
  struct Node;

  explicit RadixTree(int32_t page_size);
  ~RadixTree();
  RadixTree(const RadixTree&) = delete;
  RadixTree& operator=(const RadixTree&) = delete;

  // Where a node's pages came from.
  enum class Origin : uint8_t { kPut, kCommit };

  struct MatchResult {
    int64_t tokens = 0;            // page-aligned matched length
    int64_t committed_tokens = 0;  // of them, those whose pages entered by a commit
    std::vector<PageRef> pages;    // tokens / page_size pages
    Node* node = nullptr;          // deepest node covering the match (pinned by MatchAndPin)
  };

  // Longest cached page-aligned prefix of `tokens`; refreshes the LRU clock of the path.
  MatchResult Match(const std::string& ns, absl::Span<const int32_t> tokens);

  // As Match, but splits the last node at the match boundary so the match ends on a
  // node, and pins that node and its ancestors. Unpin(result.node) releases it
  // (a null node means nothing matched and nothing was pinned).
  MatchResult MatchAndPin(const std::string& ns, absl::Span<const int32_t> tokens);
  void Unpin(Node* node);
  // Pins `node` and its ancestors once more (a second holder of a match, e.g. a fork of a
  // sequence pinned there); Unpin releases each pin. A null node does nothing.
  void Pin(Node* node);

  struct InsertResult {
    int64_t new_pages = 0;            // pages taken over by the tree
    std::vector<PageRef> duplicates;  // caller's pages for chunks already cached
  };
  // Inserts the first pages.size() pages of `tokens` (REQUIRES: tokens.size() >=
  // pages.size() * page_size). Pages of chunks already present are returned as
  // duplicates, for the caller to free; the others belong to the tree from now on, in
  // nodes of origin `origin` (a chunk already present keeps its origin).
  InsertResult Insert(const std::string& ns, absl::Span<const int32_t> tokens,
                      absl::Span<const PageRef> pages, Origin origin = Origin::kPut);

  // Evicts least-recently-used unpinned leaves while want_more() is true, handing
  // every freed page to on_free. Returns the number of pages freed. With `ns`, only
  // leaves of that namespace (a tenant evicting its own pages).
  int64_t Evict(const std::function<bool()>& want_more,
                const std::function<void(const PageRef&)>& on_free,
                const std::string* ns = nullptr);

  // Told of every page that enters or leaves the tree, with the token path from the
  // namespace's root through it: what names a page (common/block_hash.h) for the cluster's
  // block index and KV events. Called inside Insert and Evict, under the owner's lock: a
  // listener queues and returns.
  class Listener {
   public:
    virtual ~Listener() = default;
    // The pages [first_page, path.size() / page_size) of `path` entered the tree (`entered`)
    // or left it. The pages before first_page are their ancestors.
    virtual void PagesChanged(const std::string& ns, absl::Span<const int32_t> path,
                              int64_t first_page, bool entered) = 0;
  };
  // nullptr: none (the default).
  void set_listener(Listener* listener) { listener_ = listener; }
  // Tells `listener` that every page of the tree entered (parents before children): a
  // listener that lost track (a restarted index) hears the whole tree again.
  void ReplayTo(Listener* listener) const;

  int64_t cached_pages() const { return cached_pages_; }
  // Of cached_pages(), those in nodes of origin kCommit.
  int64_t committed_pages() const { return committed_pages_; }
  int64_t num_nodes() const { return num_nodes_; }
  int32_t page_size() const { return page_size_; }
  // Number of pages reachable only through pinned nodes (for tests/metrics).
  int64_t PinnedPages() const;
  // Pages of pool `pool` that Evict could free if asked to free everything: those of
  // unpinned nodes (a node with no pins has no pinned descendant, so all of them are
  // leaves in turn). Callers decide feasibility with it before evicting anything.
  // With `ns`, only that namespace's pages. With `frees`, only the pages for which it is
  // true (the owner's pages that eviction really returns to the pool: a page a sequence
  // still holds as well is only let go by the tree).
  int64_t EvictablePages(int32_t pool, const std::string* ns = nullptr,
                         const std::function<bool(const PageRef&)>& frees = nullptr) const;

 private:
  Node* Root(const std::string& ns, bool create);
  MatchResult Walk(Node* root, absl::Span<const int32_t> tokens, bool split);
  Node* Split(Node* node, int64_t keep_pages);
  // The tokens from the namespace's root through `node`'s edge.
  static std::vector<int32_t> PathTo(const Node* node);

  const int32_t page_size_;
  uint64_t clock_ = 0;
  int64_t cached_pages_ = 0;
  int64_t committed_pages_ = 0;
  int64_t num_nodes_ = 0;
  absl::flat_hash_map<std::string, std::unique_ptr<Node>> roots_;
  Listener* listener_ = nullptr;
};

}  // namespace kvcd
