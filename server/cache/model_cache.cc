#include "server/cache/model_cache.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/backends/device_runtime.h"

namespace kvcd {
ModelCache::ModelCache(const ModelSpec& spec, Backend* backend, double high, double low,
                       CacheCounters* counters)
    : spec_(spec),
      backend_(backend),
      high_watermark_(high),
      low_watermark_(low),
      counters_(counters),
      tree_(spec.page_size) {}

ModelCache::~ModelCache() {
  for (PageStore& s : stores_) {
    s.pool.reset();
    if (s.memory != nullptr) backend_->FreePoolMemory(s.memory, s.bytes);
  }
}

absl::StatusOr<std::unique_ptr<ModelCache>> ModelCache::Create(
    const ModelSpec& spec, Backend* backend, double high_watermark, double low_watermark,
    CacheCounters* counters, const std::string& codec_blob, uint64_t allocation_limit,
    const std::string& limit_what) {
  // The model's codec and formats come from its history format's factory (the format
  // registry): the window format first, then the history's when it has its own.
  KVCD_ASSIGN_OR_RETURN(std::unique_ptr<const ModelCodec> codec, LoadModelCodec(spec, codec_blob));
  return Create(spec, backend, high_watermark, low_watermark, counters, std::move(codec),
                allocation_limit, limit_what);
}

absl::StatusOr<std::unique_ptr<ModelCache>> ModelCache::Create(
    const ModelSpec& spec, Backend* backend, double high_watermark, double low_watermark,
    CacheCounters* counters, std::unique_ptr<const ModelCodec> codec, uint64_t allocation_limit,
    const std::string& limit_what) {
  std::unique_ptr<ModelCache> cache(
      new ModelCache(spec, backend, high_watermark, low_watermark, counters));
  cache->codec_description_ = codec->description();
  const PageGeometry geometry{spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.page_size};
  auto formats = codec->CreateFormats(geometry, backend->kind());
  if (!formats.ok()) {
    return absl::Status(formats.status().code(),
                        absl::StrCat("model ", Quote(spec.name), ": ", formats.status().message()));
  }
  const size_t num_formats = formats->size();
  const bool split = num_formats > 1;
  const auto window_budget = static_cast<uint64_t>(
      split ? static_cast<double>(spec.memory_bytes) * spec.bf16_fraction : spec.memory_bytes);
  // Sizes first, then the budget check on what the backend will really allocate, then the
  // allocations: a registration that does not fit allocates nothing.
  std::vector<uint64_t> pool_pages;
  uint64_t allocation = 0;
  for (size_t i = 0; i < num_formats; ++i) {
    const PageFormat& format = *(*formats)[i];
    const uint64_t budget = i == 0 ? window_budget : spec.memory_bytes - window_budget;
    const int64_t page_bytes = format.page_bytes();
    const uint64_t pages = budget / static_cast<uint64_t>(page_bytes);
    if (pages < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("model ", Quote(spec.name), ": its ", format.name(), " pool gets ", budget,
                       " bytes of memory_bytes ", spec.memory_bytes, ", less than one page (",
                       page_bytes, " bytes for ", spec.num_layers, " layers); raise memory_bytes",
                       split ? " or adjust bf16_fraction" : ""));
    }
    if (pages > (1u << 30)) {
      return absl::InvalidArgumentError(absl::StrCat("model ", Quote(spec.name), ": ", pages,
                                                     " pages exceed the 2^30 page limit"));
    }
    pool_pages.push_back(pages);
    allocation += backend->PoolAllocationBytes(pages * static_cast<uint64_t>(page_bytes));
  }
  if (allocation > allocation_limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("model ", Quote(spec.name), ": its pools take ", allocation,
                     " bytes once rounded to the backend's allocation granularity (memory_bytes ",
                     spec.memory_bytes, "), but only ", allocation_limit,
                     limit_what.empty() ? " bytes of the daemon's memory_budget are unassigned"
                                        : " bytes are left under " + limit_what));
  }
  cache->allocated_bytes_ = allocation;
  for (size_t i = 0; i < num_formats; ++i) {
    PageStore store;
    store.format = std::move((*formats)[i]);
    const uint64_t pages = pool_pages[i];
    store.bytes = pages * static_cast<uint64_t>(store.format->page_bytes());
    KVCD_ASSIGN_OR_RETURN(store.memory, backend->AllocatePoolMemory(store.bytes));
    store.pool =
        std::make_unique<PagePool>(store.format->name(), store.memory, spec.num_layers,
                                   store.format->layer_page_bytes(), static_cast<int32_t>(pages));
    cache->stores_.push_back(std::move(store));
  }
  std::vector<int32_t> pages_per_store;
  for (const PageStore& store : cache->stores_) pages_per_store.push_back(store.pool->num_pages());
  std::lock_guard<std::mutex> lock(cache->mu_);
  cache->owners_ = std::make_unique<PageOwners>(pages_per_store);
  return cache;
}

int32_t ModelCache::StoreForPage(int64_t page_index) const {
  return page_index >= spec_.sink_pages() ? HistoryStore() : kWindow;
}

int64_t ModelCache::StoredPageBytes(int64_t page_index) const {
  return stores_[StoreForPage(page_index)].format->page_bytes();
}

int64_t ModelCache::MaxPageBytes() const {
  int64_t m = 0;
  for (const PageStore& s : stores_) m = std::max(m, s.format->page_bytes());
  return m;
}

int64_t ModelCache::ShareLimit(const std::string& tenant, int32_t store) const {
  if (!share_of_) return INT64_MAX;
  const double share = share_of_(tenant);
  if (!(share < 1)) return INT64_MAX;
  return static_cast<int64_t>(std::floor(std::max(share, 0.0) * stores_[store].pool->num_pages()));
}

int64_t ModelCache::HeldLocked(const std::string& tenant, int32_t store) const {
  return owners_->Held(tenant, store);
}

namespace {

// The needs of one call summed per tenant, in order of first appearance.
// (Need: ModelCache::TenantNeed.)
template <class Need>
std::vector<std::pair<const std::string*, int64_t>> PerTenant(absl::Span<const Need> needs) {
  std::vector<std::pair<const std::string*, int64_t>> out;
  for (const Need& n : needs) {
    if (n.pages == 0) continue;
    auto it =
        std::find_if(out.begin(), out.end(), [&](const auto& t) { return *t.first == *n.tenant; });
    if (it == out.end()) {
      out.emplace_back(n.tenant, n.pages);
    } else {
      it->second += n.pages;
    }
  }
  return out;
}

}  // namespace

absl::Status ModelCache::CheckFitsLocked(int32_t store, absl::Span<const TenantNeed> needs) const {
  const PagePool& p = *stores_[store].pool;
  // A tree page a sequence (a fork) still holds is not freed by evicting it.
  const auto frees = [this](const PageRef& r) { return owners_->holders(r) == 1; };
  int64_t free = p.free_pages();
  int64_t own_evicted = 0;  // by tenants past their share, from their own pages
  int64_t others = 0;       // pages of tenants within their share
  for (const auto& [tenant, n] : PerTenant(needs)) {
    const int64_t limit = ShareLimit(*tenant, store);
    const int64_t held = HeldLocked(*tenant, store);
    if (n <= limit && held <= limit - n) {
      others += n;
      continue;
    }
    // Past its share: its own unpinned pages must make room under the share, and in the
    // pool when it has too few free pages.
    const int64_t own = tree_.EvictablePages(store, tenant, frees);
    const int64_t must = n > limit ? INT64_MAX : std::max(held + n - limit, n - free);
    if (own < must) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "model ", Quote(spec_.name), ": tenant ", Quote(*tenant), " (cache_salt) holds ", held,
          " of the ", p.num_pages(), " pages of the ", p.format(),
          " pool, and its max_memory_share ", share_of_(*tenant), " lets it hold ", limit,
          "; this call needs ", n, " page(s) more", n > limit ? ", more than its whole share" : "",
          ", and a tenant at its share evicts only its own pages: ", own,
          " of them are unpinned; nothing was evicted; close its sequences, send fewer tokens "
          "or raise its max_memory_share; retry later"));
    }
    free += must - n;
    own_evicted += must;
  }
  if (others <= free) return absl::OkStatus();
  const int64_t evictable = tree_.EvictablePages(store, nullptr, frees) - own_evicted;
  if (others <= free + evictable) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "model ", Quote(spec_.name), ": the ", p.format(), " pool cannot hold the request: need ",
      others, " page(s), ", free, " free + ", evictable, " evictable of ", p.num_pages(), " (",
      tree_.PinnedPages(),
      " cached pages pinned by open sequences or prefix pins); nothing was evicted; close "
      "sequences, unpin prefixes, send fewer tokens or give the model more memory; retry later"));
}

absl::Status ModelCache::WriteCodes(int32_t store, const RowSource* x,
                                    absl::Span<const RowSlot> rows, int32_t layer) const {
  const PageStore& s = stores_[store];
  if (!s.format->needs_residuals()) return absl::OkStatus();
  if (x == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", Quote(spec_.name),
                     " stores FSQ codes: the residuals x of the tokens are required"));
  }
  return s.format->WriteCodes(*x, rows, layer, *s.pool);
}

std::string ModelCache::BlockFormat() const {
  for (const PageStore& st : stores_) {
    if (st.format->id() == FormatId::kInt2Transform) return FormatName(FormatId::kInt2Transform);
  }
  return FormatName(spec_.history_format);
}

void ModelCache::set_block_observer(BlockObserver* observer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (observer == nullptr) {
    tree_.set_listener(nullptr);
    block_namer_.reset();
    return;
  }
  block_namer_ = std::make_unique<BlockNamer>(spec_.name, BlockFormat(), spec_.page_size, observer);
  tree_.set_listener(block_namer_.get());
}

void ModelCache::ReplayBlocks(BlockObserver* to) {
  BlockNamer namer(spec_.name, BlockFormat(), spec_.page_size, to);
  std::lock_guard<std::mutex> lock(mu_);
  tree_.ReplayTo(&namer);
}

void ModelCache::EvictLocked(const std::function<bool()>& want_more, const std::string* tenant) {
  const int64_t committed_before = tree_.committed_pages();
  tree_.Evict(
      want_more,
      [&](const PageRef& r) {
        FreeLocked({r});
        counters_->evicted_pages.fetch_add(1, std::memory_order_relaxed);
      },
      tenant);
  counters_->evicted_pages_committed.fetch_add(
      static_cast<uint64_t>(committed_before - tree_.committed_pages()), std::memory_order_relaxed);
}

absl::Status ModelCache::AllocateLocked(int32_t store, absl::Span<const TenantNeed> needs,
                                        std::vector<PageRef>* out) {
  const auto per_tenant = PerTenant(needs);
  if (per_tenant.empty()) return absl::OkStatus();
  PagePool& p = *stores_[store].pool;
  // Feasibility first: an impossible request must not flush the cache on its way to failing.
  KVCD_RETURN_IF_ERROR(CheckFitsLocked(store, needs));
  // In CheckFitsLocked's order: tenants past their share (evicting their own pages), then
  // the others (LRU over everyone's).
  std::vector<std::vector<int32_t>> ids(per_tenant.size());
  std::vector<bool> past(per_tenant.size());  // decided once, before anything moves
  for (size_t i = 0; i < per_tenant.size(); ++i) {
    const std::string& tenant = *per_tenant[i].first;
    past[i] = HeldLocked(tenant, store) + per_tenant[i].second > ShareLimit(tenant, store);
  }
  absl::Status status;
  for (int pass = 0; pass < 2 && status.ok(); ++pass) {
    for (size_t i = 0; i < per_tenant.size() && status.ok(); ++i) {
      const std::string& tenant = *per_tenant[i].first;
      const int64_t n = per_tenant[i].second;
      const int64_t limit = ShareLimit(tenant, store);
      const bool past_share = past[i];
      if (past_share != (pass == 0)) continue;
      auto want_more = [&] {
        return p.free_pages() < n || (past_share && HeldLocked(tenant, store) + n > limit);
      };
      if (want_more()) EvictLocked(want_more, past_share ? &tenant : nullptr);
      if (!p.Allocate(static_cast<int32_t>(n), &ids[i])) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "model ", Quote(spec_.name), ": the ", p.format(), " pool is full: need ", n,
            " page(s), ", p.free_pages(), " free of ", p.num_pages(), ", nothing evictable (",
            tree_.PinnedPages(),
            " cached pages pinned by open sequences or prefix pins); close sequences, unpin "
            "prefixes or give the model more memory; retry later"));
        break;
      }
      owners_->Claim(store, ids[i], tenant);
    }
  }
  if (!status.ok()) {
    for (const auto& got : ids) {
      for (int32_t id : got) FreeLocked({PageRef{store, id}});
    }
    return status;
  }
  // Hand the pages out in the order of `needs`.
  std::vector<size_t> next(per_tenant.size(), 0);
  for (const TenantNeed& need : needs) {
    if (need.pages == 0) continue;
    size_t i = 0;
    while (*per_tenant[i].first != *need.tenant) ++i;
    for (int64_t k = 0; k < need.pages; ++k) out->push_back(PageRef{store, ids[i][next[i]++]});
  }
  return absl::OkStatus();
}

void ModelCache::FreeLocked(absl::Span<const PageRef> pages) {
  for (const PageRef& r : pages) {
    if (owners_->Release(r)) stores_[r.pool].pool->Free({r.page});
  }
}

void ModelCache::EvictToWatermarksLocked(const std::string& tenant) {
  for (size_t st = 0; st < stores_.size(); ++st) {
    PagePool* p = stores_[st].pool.get();
    const int32_t total = p->num_pages();
    if (p->used_pages() <= high_watermark_ * total) continue;
    const double low = low_watermark_ * total;
    const int32_t store = static_cast<int32_t>(st);
    const bool at_share = HeldLocked(tenant, store) >= ShareLimit(tenant, store);
    EvictLocked([&] { return p->used_pages() > low; }, at_share ? &tenant : nullptr);
  }
}

absl::StatusOr<PutResult> ModelCache::StorePrefix(const std::string& salt,
                                                  absl::Span<const int32_t> tokens,
                                                  int64_t full_pages, int64_t required_pages,
                                                  const PageWriter& write) {
  const int32_t ps = spec_.page_size;
  const int64_t n = static_cast<int64_t>(tokens.size());
  PutResult result;
  result.ignored_tokens = n - full_pages * ps;
  const auto full = tokens.subspan(0, static_cast<size_t>(full_pages * ps));
  RadixTree::MatchResult match;
  std::vector<PageRef> fresh;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Pin the cached part so it cannot be evicted while the new pages are written.
    match = tree_.MatchAndPin(salt, full);
    const int64_t cached_pages = static_cast<int64_t>(match.pages.size());
    result.cached_tokens = cached_pages * ps;
    if (cached_pages < required_pages) {
      tree_.Unpin(match.node);
      return absl::FailedPreconditionError(
          absl::StrCat("the first ", required_pages * ps,
                       " tokens must already be cached but only ", result.cached_tokens,
                       " are (evicted, or never put); resend from token ", result.cached_tokens));
    }
    // Pages go to the store StoreForPage names: window pages first, then history pages.
    // Every store's need is checked before any store evicts.
    absl::Status s;
    std::vector<int64_t> need(stores_.size(), 0);
    for (int64_t i = cached_pages; i < full_pages; ++i) ++need[StoreForPage(i)];
    for (size_t st = 0; s.ok() && st < stores_.size(); ++st) {
      const TenantNeed tenant_need{&salt, need[st]};
      s = CheckFitsLocked(static_cast<int32_t>(st), absl::MakeConstSpan(&tenant_need, 1));
    }
    for (int64_t i = cached_pages; s.ok() && i < full_pages;) {
      const int32_t store = StoreForPage(i);
      int64_t j = i;
      while (j < full_pages && StoreForPage(j) == store) ++j;
      s = AllocateLocked(store, salt, j - i, &fresh);
      i = j;
    }
    if (!s.ok()) {
      FreeLocked(fresh);
      tree_.Unpin(match.node);
      return s;
    }
  }
  // Write outside the lock: the fresh pages are private until Insert publishes them.
  const int64_t first_new = static_cast<int64_t>(match.pages.size());
  absl::Status written;
  for (size_t i = 0; written.ok() && i < fresh.size();) {
    size_t j = i;
    std::vector<int32_t> ids;
    while (j < fresh.size() && fresh[j].pool == fresh[i].pool) ids.push_back(fresh[j++].page);
    written = write(first_new + static_cast<int64_t>(i), fresh[i].pool, ids);
    i = j;
  }
  if (!written.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    FreeLocked(fresh);
    tree_.Unpin(match.node);
    return written;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<PageRef> all = match.pages;
    all.insert(all.end(), fresh.begin(), fresh.end());
    RadixTree::InsertResult ins = tree_.Insert(salt, full, all);
    // Chunks another writer inserted meanwhile: keep the tree's copy, free ours. Pages of
    // our own pinned match come back as duplicates of themselves and are kept.
    std::vector<PageRef> to_free;
    for (const PageRef& dup : ins.duplicates) {
      if (std::find(match.pages.begin(), match.pages.end(), dup) == match.pages.end()) {
        to_free.push_back(dup);
      }
    }
    FreeLocked(to_free);
    // Keep the whole put prefix pinned while the pools are brought back under the
    // watermarks, so that eviction cannot take the pages this call reports as inserted.
    const RadixTree::MatchResult own = tree_.MatchAndPin(salt, full);
    tree_.Unpin(match.node);
    EvictToWatermarksLocked(salt);
    tree_.Unpin(own.node);
    result.inserted_tokens = ins.new_pages * ps;
    counters_->inserted_pages.fetch_add(static_cast<uint64_t>(ins.new_pages));
    counters_->hit_tokens.fetch_add(static_cast<uint64_t>(result.cached_tokens));
    counters_->hit_tokens_committed.fetch_add(static_cast<uint64_t>(match.committed_tokens));
    counters_->miss_tokens.fetch_add(static_cast<uint64_t>(n - result.cached_tokens));
  }
  return result;
}

absl::StatusOr<PutResult> ModelCache::Put(const std::string& salt, absl::Span<const int32_t> tokens,
                                          int64_t kv_first, const RowSource& k, const RowSource& v,
                                          const RowSource* x) {
  const int32_t ps = spec_.page_size;
  const int64_t full_pages = static_cast<int64_t>(tokens.size()) / ps;
  return StorePrefix(
      salt, tokens, full_pages, kv_first / ps,
      [&](int64_t first_page, int32_t store, absl::Span<const int32_t> pages) {
        const PageStore& s = stores_[store];
        const int64_t first_token = first_page * ps - kv_first;
        if (s.format->stores_kv()) {
          KVCD_RETURN_IF_ERROR(s.format->WritePages(k, v, first_token, pages, *s.pool));
        }
        return WriteCodes(store, x, PageRowSlots(first_token, pages, ps), -1);
      });
}

absl::StatusOr<PutResult> ModelCache::PushPages(const std::string& salt,
                                                absl::Span<const int32_t> tokens,
                                                int64_t first_page,
                                                absl::Span<const StoredPageIn> pages) {
  const int32_t ps = spec_.page_size;
  const int64_t end_page = first_page + static_cast<int64_t>(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    const int64_t index = first_page + static_cast<int64_t>(i);
    const PageFormat& f = *stores_[StoreForPage(index)].format;
    absl::Status s;
    if (pages[i].format != f.name()) {
      s = absl::InvalidArgumentError(absl::StrCat("page ", index, " has format '", pages[i].format,
                                                  "', expected '", f.name(), "' there"));
    } else if (static_cast<int64_t>(pages[i].data.size()) != f.page_bytes()) {
      s = absl::InvalidArgumentError(absl::StrCat("page ", index, " has ", pages[i].data.size(),
                                                  " bytes, expected ", f.page_bytes(), " (one ",
                                                  f.name(), " page, all layers)"));
    } else {
      s = f.CheckPages(reinterpret_cast<const uint8_t*>(pages[i].data.data()), 1, index);
    }
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("inline_pages[", i, "]: ", s.message()));
    }
  }
  return StorePrefix(
      salt, tokens.subspan(0, static_cast<size_t>(end_page * ps)), end_page, first_page,
      [&](int64_t first, int32_t store, absl::Span<const int32_t> ids) {
        // The pages (one string each) as one run in host memory.
        std::string run;
        run.reserve(ids.size() * static_cast<size_t>(stores_[store].pool->page_bytes()));
        for (size_t i = 0; i < ids.size(); ++i) {
          const absl::string_view data = pages[static_cast<size_t>(first - first_page) + i].data;
          run.append(data.data(), data.size());
        }
        return backend_->WritePages(*stores_[store].pool, ids,
                                    reinterpret_cast<const uint8_t*>(run.data()),
                                    /*run_on_device=*/false);
      });
}

absl::StatusOr<PutResult> ModelCache::PushDevicePages(const std::string& salt,
                                                      absl::Span<const int32_t> tokens,
                                                      int64_t first_page, int64_t num_pages,
                                                      const uint8_t* src) {
  const int32_t ps = spec_.page_size;
  const int64_t end_page = first_page + num_pages;
  std::vector<int64_t> offset(static_cast<size_t>(num_pages) + 1, 0);
  for (int64_t i = 0; i < num_pages; ++i) {
    offset[static_cast<size_t>(i) + 1] =
        offset[static_cast<size_t>(i)] + StoredPageBytes(first_page + i);
  }
  // Every pushed page is checked on the device (also those already cached), one run of
  // same-format pages at a time, before anything is allocated.
  for (int64_t i = 0; i < num_pages;) {
    const int32_t store = StoreForPage(first_page + i);
    int64_t j = i;
    while (j < num_pages && StoreForPage(first_page + j) == store) ++j;
    KVCD_RETURN_IF_ERROR(stores_[store].format->CheckDevicePages(
        src + offset[static_cast<size_t>(i)], j - i, first_page + i));
    i = j;
  }
  return StorePrefix(salt, tokens.subspan(0, static_cast<size_t>(end_page * ps)), end_page,
                     first_page, [&](int64_t first, int32_t store, absl::Span<const int32_t> ids) {
                       return backend_->WritePages(
                           *stores_[store].pool, ids,
                           src + offset[static_cast<size_t>(first - first_page)],
                           /*run_on_device=*/true);
                     });
}

int64_t ModelCache::Match(const std::string& salt, absl::Span<const int32_t> tokens,
                          int64_t* committed_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  const RadixTree::MatchResult m = tree_.Match(salt, tokens);
  if (committed_tokens != nullptr) *committed_tokens = m.committed_tokens;
  return m.tokens;
}

std::shared_ptr<Sequence> ModelCache::Open(uint64_t id, const std::string& salt,
                                           absl::Span<const int32_t> tokens) {
  auto seq = std::make_shared<Sequence>(id, this, salt);
  if (DeviceRuntime* device = backend_->device(); device != nullptr) {
    // Without fault words the device inputs of this sequence are checked synchronously.
    if (auto words = device->AcquireFaultWords(); words.ok()) seq->device_fault = *words;
  }
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  std::lock_guard<std::mutex> lock(mu_);
  RadixTree::MatchResult m = tree_.MatchAndPin(salt, tokens);
  seq->pinned = m.node;
  seq->pages = std::move(m.pages);
  seq->shared_pages = static_cast<int64_t>(seq->pages.size());
  seq->layer_len.assign(static_cast<size_t>(spec_.num_layers), m.tokens);
  seq->tokens.assign(tokens.begin(), tokens.begin() + m.tokens);
  counters_->hit_tokens.fetch_add(static_cast<uint64_t>(m.tokens));
  counters_->hit_tokens_committed.fetch_add(static_cast<uint64_t>(m.committed_tokens));
  counters_->miss_tokens.fetch_add(static_cast<uint64_t>(tokens.size()) -
                                   static_cast<uint64_t>(m.tokens));
  open_sequences_.fetch_add(1);
  return seq;
}

void ModelCache::Close(Sequence* seq) {
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  if (seq->closed) return;
  std::lock_guard<std::mutex> lock(mu_);
  CloseLocked(seq);
}

std::vector<PageRef> ModelCache::OwnPages(const Sequence& seq) {
  std::vector<PageRef> own(
      seq.pages.begin() +
          std::min<int64_t>(seq.shared_pages, static_cast<int64_t>(seq.pages.size())),
      seq.pages.end());
  for (const Sequence::WindowCopy& w : seq.window_copies) {
    if (!(seq.pages[static_cast<size_t>(w.index)] == w.tree)) {
      own.push_back(seq.pages[static_cast<size_t>(w.index)]);
    }
  }
  return own;
}

void ModelCache::CloseLocked(Sequence* seq) {
  seq->closed = true;
  tree_.Unpin(seq->pinned);
  seq->pinned = nullptr;
  FreeLocked(OwnPages(*seq));
  seq->pages.clear();
  seq->window_copies.clear();
  seq->shared_pages = 0;
  open_sequences_.fetch_sub(1);
  if (seq->device_fault.held()) backend_->device()->ReleaseFaultWords(seq->device_fault);
}

absl::StatusOr<ModelCache::PinnedPrefix> ModelCache::PinPrefix(
    const std::string& salt, absl::Span<const int32_t> tokens,
    const std::function<absl::Status(int64_t pages)>& admit) {
  std::lock_guard<std::mutex> lock(mu_);
  // Counted first without splitting anything, so that a refused pin leaves the tree as it was.
  const int64_t pages = static_cast<int64_t>(tree_.Match(salt, tokens).pages.size());
  if (pages == 0) {
    return absl::NotFoundError(
        absl::StrCat("model ", Quote(spec_.name), ", cache_salt ", Quote(salt), ": not one page (",
                     spec_.page_size, " tokens) of the ", tokens.size(),
                     " tokens is cached, so there is nothing to pin; Put the prefix first"));
  }
  KVCD_RETURN_IF_ERROR(admit(pages));
  const RadixTree::MatchResult m = tree_.MatchAndPin(salt, tokens);
  return PinnedPrefix{m.node, m.tokens, static_cast<int64_t>(m.pages.size())};
}

void ModelCache::UnpinPrefix(RadixTree::Node* node) {
  std::lock_guard<std::mutex> lock(mu_);
  tree_.Unpin(node);
}

ModelSnapshot ModelCache::Snapshot() const {
  ModelSnapshot s;
  const double bf16_token = 2.0 * 2 * spec_.num_layers * spec_.num_kv_heads * spec_.head_dim;
  double dense = 0, used = 0;
  for (const PageStore& st : stores_) {
    const PagePool& p = *st.pool;
    s.pools.push_back(PoolSnapshot{p.format(), p.page_bytes(), p.num_pages(), p.used_pages()});
    dense += bf16_token * spec_.page_size * p.used_pages();
    used += static_cast<double>(p.page_bytes()) * p.used_pages();
  }
  const PageFormat& history = *stores_[HistoryStore()].format;
  // Stored bytes per window token (BF16 K/V, plus the code beside them for FSQ models).
  s.bf16_bytes_per_token =
      static_cast<double>(stores_[kWindow].format->page_bytes()) / spec_.page_size;
  s.history_bytes_per_token = static_cast<double>(history.page_bytes()) / spec_.page_size;
  s.history_bits_per_element = history.bits_per_element();
  s.compression_ratio = used > 0 ? dense / used : 1.0;
  s.demoted_pages = demoted_pages_.load();
  std::lock_guard<std::mutex> lock(mu_);
  s.cached_tokens = tree_.cached_pages() * spec_.page_size;
  s.committed_pages = tree_.committed_pages();
  s.pinned_pages = tree_.PinnedPages();
  s.active_sequences = open_sequences_.load();
  for (PageOwners::TenantPages& t : owners_->Tenants()) {
    TenantPagesSnapshot tp;
    tp.tenant = std::move(t.tenant);
    tp.pages = std::move(t.pages);
    for (size_t st = 0; st < stores_.size(); ++st) {
      tp.limit.push_back(ShareLimit(tp.tenant, static_cast<int32_t>(st)));
    }
    s.tenants.push_back(std::move(tp));
  }
  std::sort(s.tenants.begin(), s.tenants.end(),
            [](const auto& a, const auto& b) { return a.tenant < b.tenant; });
  s.codec = codec_description_;
  return s;
}

}  // namespace kvcd
