#include "server/cache/model_cache.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/phase_times.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kvcd/kernels/bf16.h"

namespace kvcd {
namespace {

// The rotation of a model whose history format stores rotated rows (int2-oscar): from the
// registered codec file bytes, the configured codec file, or a named codec.
absl::StatusOr<std::shared_ptr<const CodecProfile>> LoadCodec(const ModelSpec& spec,
                                                              const std::string& codec_blob) {
  if (spec.history_format != FormatId::kInt2Oscar) {
    if (!codec_blob.empty() && !spec.is_fsq()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model '", spec.name, "': codec_blob is only used with history_format int2-oscar"));
    }
    return std::shared_ptr<const CodecProfile>();
  }
  if (!codec_blob.empty() || !spec.codec_file.empty()) {
    auto file = codec_blob.empty() ? SafetensorsFile::Load(spec.codec_file)
                                   : SafetensorsFile::Parse(codec_blob);
    if (!file.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model ", Quote(spec.name), ": codec file: ", file.status().message()));
    }
    const std::string what = codec_blob.empty() ? "oscar (" + spec.codec_file + ")"
                                                : std::string("oscar (registered codec)");
    auto codec = CodecProfile::FromSafetensors(*file, spec.num_layers, spec.head_dim, what);
    if (!codec.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model ", Quote(spec.name), ": ", codec.status().message()));
    }
    return std::make_shared<const CodecProfile>(std::move(*codec));
  }
  if (spec.codec == "identity") {
    return std::make_shared<const CodecProfile>(
        CodecProfile::Identity(spec.num_layers, spec.head_dim));
  }
  auto hadamard =
      std::make_shared<CodecProfile>(CodecProfile::Hadamard(spec.num_layers, spec.head_dim));
  if (spec.codec.empty()) {
    std::fprintf(stderr,
                 "kvcd: model '%s': no codec file, INT2 history uses the Hadamard rotation\n",
                 spec.name.c_str());
    hadamard->set_description("hadamard (no codec file)");
  }
  return std::shared_ptr<const CodecProfile>(std::move(hadamard));
}

// The FSQ codec of an FSQ model: from the registered codec file bytes, else the configured
// codec file; it must match the profile (docs/fsq.md).
absl::StatusOr<std::shared_ptr<const FsqModelCodec>> LoadFsqCodec(const ModelSpec& spec,
                                                                  const std::string& codec_blob) {
  if (!spec.is_fsq()) return std::shared_ptr<const FsqModelCodec>();
  if (codec_blob.empty() && spec.codec_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", spec.name,
                     "': history_format fsq needs its codec: codec_blob (RegisterModel) or "
                     "codec_file (config), a safetensors file as docs/fsq.md describes"));
  }
  auto file = codec_blob.empty() ? SafetensorsFile::Load(spec.codec_file)
                                 : SafetensorsFile::Parse(codec_blob);
  if (!file.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", spec.name, "': codec file: ", file.status().message()));
  }
  FsqCodecShape shape;
  shape.num_layers = spec.num_layers;
  shape.residual_width = spec.fsq_residual_width;
  shape.latent_width = spec.fsq_latent_width;
  shape.num_kv_heads = spec.num_kv_heads;
  shape.head_dim = spec.head_dim;
  shape.key_norm = spec.key_norm;
  shape.key_norm_eps = spec.key_norm_eps;
  auto codec = FsqCodec::FromSafetensors(*file, shape);
  if (!codec.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", spec.name, "': codec_blob: ", codec.status().message()));
  }
  auto m = std::make_shared<FsqModelCodec>();
  m->codec = std::move(*codec);
  m->rope.theta = spec.rope_theta;
  m->rope.rotary_dims = spec.rotary_dims();
  m->rope.scaling = spec.rope_scaling;
  m->rope.pairing =
      spec.rope_interleaved ? kernels::RopePairing::kInterleaved : kernels::RopePairing::kHalf;
  return std::shared_ptr<const FsqModelCodec>(std::move(m));
}

}  // namespace

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
    CacheCounters* counters, const std::string& codec_blob, uint64_t allocation_limit) {
  std::unique_ptr<ModelCache> cache(
      new ModelCache(spec, backend, high_watermark, low_watermark, counters));
  KVCD_ASSIGN_OR_RETURN(cache->codec_, LoadCodec(spec, codec_blob));
  KVCD_ASSIGN_OR_RETURN(cache->fsq_, LoadFsqCodec(spec, codec_blob));
  // The window is BF16 (with each token's code beside it for FSQ models); a history format
  // of its own gets the rest of the memory.
  std::vector<FormatId> ids = {spec.is_fsq() ? FormatId::kFsqWindow : FormatId::kBf16};
  if (spec.history_format != FormatId::kBf16) ids.push_back(spec.history_format);
  const PageGeometry geometry{spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.page_size};
  auto formats = backend->CreateFormats(ids, geometry, cache->codec_, cache->fsq_);
  if (!formats.ok()) {
    return absl::Status(formats.status().code(),
                        absl::StrCat("model ", Quote(spec.name), ": ", formats.status().message()));
  }
  const bool split = ids.size() > 1;
  const auto window_budget = static_cast<uint64_t>(
      split ? static_cast<double>(spec.memory_bytes) * spec.bf16_fraction : spec.memory_bytes);
  // Sizes first, then the budget check on what the backend will really allocate, then the
  // allocations: a registration that does not fit allocates nothing.
  std::vector<uint64_t> pool_pages;
  uint64_t allocation = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
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
                     " bytes of the daemon's memory_budget are unassigned"));
  }
  cache->allocated_bytes_ = allocation;
  for (size_t i = 0; i < ids.size(); ++i) {
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

absl::Status ModelCache::CheckFitsLocked(int32_t store, int64_t n) const {
  const PagePool& p = *stores_[store].pool;
  if (n <= p.free_pages()) return absl::OkStatus();
  const int64_t evictable = tree_.EvictablePages(store);
  if (n <= p.free_pages() + evictable) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "model ", Quote(spec_.name), ": the ", p.format(), " pool cannot hold the request: need ", n,
      " page(s), ", p.free_pages(), " free + ", evictable, " evictable of ", p.num_pages(), " (",
      tree_.PinnedPages(),
      " cached pages pinned by open sequences); nothing was evicted; close sequences, send "
      "fewer tokens or give the model more memory; retry later"));
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

absl::Status ModelCache::AllocateLocked(int32_t store, int32_t n, std::vector<PageRef>* out) {
  if (n == 0) return absl::OkStatus();
  PagePool& p = *stores_[store].pool;
  // Feasibility first: an impossible request must not flush the cache on its way to failing.
  KVCD_RETURN_IF_ERROR(CheckFitsLocked(store, n));
  if (p.free_pages() < n) {
    tree_.Evict([&] { return p.free_pages() < n; },
                [&](const PageRef& r) {
                  stores_[r.pool].pool->Free({r.page});
                  counters_->evicted_pages.fetch_add(1, std::memory_order_relaxed);
                });
  }
  std::vector<int32_t> ids;
  if (!p.Allocate(n, &ids)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "model '", spec_.name, "': the ", p.format(), " pool is full: need ", n, " page(s), ",
        p.free_pages(), " free of ", p.num_pages(), ", nothing evictable (", tree_.PinnedPages(),
        " cached pages pinned by open sequences); close sequences or give the model more "
        "memory; retry later"));
  }
  for (int32_t id : ids) out->push_back(PageRef{store, id});
  return absl::OkStatus();
}

void ModelCache::FreeLocked(absl::Span<const PageRef> pages) {
  for (const PageRef& r : pages) stores_[r.pool].pool->Free({r.page});
}

void ModelCache::EvictToWatermarksLocked() {
  for (PageStore& store : stores_) {
    PagePool* p = store.pool.get();
    const int32_t total = p->num_pages();
    if (p->used_pages() <= high_watermark_ * total) continue;
    const double low = low_watermark_ * total;
    tree_.Evict([&] { return p->used_pages() > low; },
                [&](const PageRef& r) {
                  stores_[r.pool].pool->Free({r.page});
                  counters_->evicted_pages.fetch_add(1, std::memory_order_relaxed);
                });
  }
}

void ModelCache::DemotePages(Sequence* seq) {
  if (!DemotesHistory()) return;
  const int32_t ps = spec_.page_size;
  const int64_t len = seq->length();
  const int64_t first = std::max<int64_t>(
      {seq->next_demote_page, seq->shared_pages, static_cast<int64_t>(spec_.sink_pages())});
  const PageStore& window = stores_[kWindow];
  const PageStore& history = stores_[HistoryStore()];
  int64_t i = first;
  // Page i is demoted once all its tokens are older than the recent window.
  for (; (i + 1) * ps <= len - spec_.recent_tokens; ++i) {
    const PageRef old = seq->pages[static_cast<size_t>(i)];
    if (old.pool != kWindow) continue;
    std::vector<PageRef> fresh;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!AllocateLocked(HistoryStore(), 1, &fresh).ok()) break;  // full: stay, retry later
    }
    const absl::Status s =
        history.format->Demote(*window.pool, {old.page}, *history.pool, {fresh[0].page});
    if (!s.ok()) {  // keep the window page; the next append retries
      std::fprintf(stderr, "kvcd: model '%s': demotion failed, page kept: %s\n", spec_.name.c_str(),
                   std::string(s.message()).c_str());
      std::lock_guard<std::mutex> lock(mu_);
      FreeLocked(fresh);
      break;
    }
    seq->pages[static_cast<size_t>(i)] = fresh[0];
    {
      std::lock_guard<std::mutex> lock(mu_);
      FreeLocked({old});
    }
    demoted_pages_.fetch_add(1);
    counters_->demoted_pages.fetch_add(1);
  }
  seq->next_demote_page = i;
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
      s = CheckFitsLocked(static_cast<int32_t>(st), need[st]);
    }
    for (int64_t i = cached_pages; s.ok() && i < full_pages;) {
      const int32_t store = StoreForPage(i);
      int64_t j = i;
      while (j < full_pages && StoreForPage(j) == store) ++j;
      s = AllocateLocked(store, static_cast<int32_t>(j - i), &fresh);
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
    EvictToWatermarksLocked();
    tree_.Unpin(own.node);
    result.inserted_tokens = ins.new_pages * ps;
    counters_->inserted_pages.fetch_add(static_cast<uint64_t>(ins.new_pages));
    counters_->hit_tokens.fetch_add(static_cast<uint64_t>(result.cached_tokens));
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

int64_t ModelCache::Match(const std::string& salt, absl::Span<const int32_t> tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  return tree_.Match(salt, tokens).tokens;
}

std::shared_ptr<Sequence> ModelCache::Open(uint64_t id, const std::string& salt,
                                           absl::Span<const int32_t> tokens) {
  auto seq = std::make_shared<Sequence>(id, this, salt);
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  std::lock_guard<std::mutex> lock(mu_);
  RadixTree::MatchResult m = tree_.MatchAndPin(salt, tokens);
  seq->pinned = m.node;
  seq->pages = std::move(m.pages);
  seq->shared_pages = static_cast<int64_t>(seq->pages.size());
  seq->layer_len.assign(static_cast<size_t>(spec_.num_layers), m.tokens);
  seq->tokens.assign(tokens.begin(), tokens.begin() + m.tokens);
  counters_->hit_tokens.fetch_add(static_cast<uint64_t>(m.tokens));
  counters_->miss_tokens.fetch_add(static_cast<uint64_t>(tokens.size()) -
                                   static_cast<uint64_t>(m.tokens));
  open_sequences_.fetch_add(1);
  return seq;
}

void ModelCache::Close(Sequence* seq) {
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  if (seq->closed) return;
  seq->closed = true;
  std::lock_guard<std::mutex> lock(mu_);
  tree_.Unpin(seq->pinned);
  seq->pinned = nullptr;
  FreeLocked(absl::MakeConstSpan(seq->pages).subspan(static_cast<size_t>(seq->shared_pages)));
  seq->pages.clear();
  open_sequences_.fetch_sub(1);
}

absl::StatusOr<int64_t> ModelCache::Append(Sequence* seq, absl::Span<const int32_t> tokens,
                                           const RowSource& k, const RowSource& v,
                                           const RowSource* x) {
  const int32_t ps = spec_.page_size;
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  if (seq->closed) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq->id, " is closed"));
  }
  const int64_t len = seq->length();
  const auto [lo, hi] = std::minmax_element(seq->layer_len.begin(), seq->layer_len.end());
  if (*lo != *hi) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", seq->id, " has a token pending at some layers (per-layer decode loop): ",
        "send k_new/v_new for the remaining layers through AttentionDecode before Append"));
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t pages_needed = (len + n + ps - 1) / ps - static_cast<int64_t>(seq->pages.size());
  std::vector<PageRef> fresh;
  if (pages_needed > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (pages_needed > (1 << 30)) return absl::ResourceExhaustedError("append too large");
    KVCD_RETURN_IF_ERROR(AllocateLocked(kWindow, static_cast<int32_t>(pages_needed), &fresh));
  }
  std::vector<RowSlot> slots;
  slots.reserve(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = len + t;
    const size_t page = static_cast<size_t>(pos / ps);
    const PageRef& r =
        page < seq->pages.size() ? seq->pages[page] : fresh[page - seq->pages.size()];
    slots.push_back({t, r.page, static_cast<int32_t>(pos % ps)});
  }
  const PageStore& window = stores_[kWindow];
  absl::Status written = window.format->WriteRows(k, v, slots, -1, *window.pool);
  if (written.ok()) written = WriteCodes(kWindow, x, slots, -1);
  if (!written.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    FreeLocked(fresh);
    return written;
  }
  seq->pages.insert(seq->pages.end(), fresh.begin(), fresh.end());
  for (auto& l : seq->layer_len) l += n;
  seq->tokens.insert(seq->tokens.end(), tokens.begin(), tokens.end());
  DemotePages(seq);
  return len + n;
}

std::vector<AttentionSegment> ModelCache::Segments(const Sequence& seq, int64_t len) const {
  // Consecutive pages of one store form one segment (sink | history | recent).
  std::vector<AttentionSegment> segs;
  const int32_t ps = spec_.page_size;
  const int64_t num_pages = (len + ps - 1) / ps;
  for (int64_t i = 0; i < num_pages; ++i) {
    const PageRef& r = seq.pages[static_cast<size_t>(i)];
    if (segs.empty() || segs.back().pool != &PoolOf(r)) {
      AttentionSegment s;
      s.format = &FormatOf(r);
      s.pool = &PoolOf(r);
      s.first_position = i * ps;
      segs.push_back(std::move(s));
    }
    AttentionSegment& s = segs.back();
    s.page_ids.push_back(r.page);
    s.token_end += std::min<int64_t>(ps, len - i * ps);  // only the last page is partial
  }
  return segs;
}

absl::Status ModelCache::Attend(int32_t layer, absl::Span<Sequence* const> seqs, const float* q,
                                float softmax_scale, const NewTokens& new_tokens, float* o,
                                float* lse, std::vector<int64_t>* lengths, const DeviceIo* device) {
  static const int kLock = PhaseTimes::Phase("daemon.cache.lock+check");
  static const int kStore = PhaseTimes::Phase("daemon.cache.append row (alloc+store+demote)");
  static const int kSegments = PhaseTimes::Phase("daemon.cache.page segments");
  static const int kBackend = PhaseTimes::Phase("daemon.cache.backend attend");
  PhaseLap lap;
  const int32_t ps = spec_.page_size;
  const bool append = !new_tokens.tokens.empty();
  // Lock in id order so concurrent batches sharing sequences cannot deadlock.
  std::vector<Sequence*> order(seqs.begin(), seqs.end());
  std::sort(order.begin(), order.end(),
            [](const Sequence* a, const Sequence* b) { return a->id < b->id; });
  std::vector<std::unique_lock<std::mutex>> locks;
  locks.reserve(order.size());
  for (Sequence* s : order) locks.emplace_back(s->mu);

  for (Sequence* s : seqs) {
    if (s->closed) {
      return absl::FailedPreconditionError(absl::StrCat("sequence ", s->id, " is closed"));
    }
    if (append && s->layer_len[layer] != s->length()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", s->id, ": layer ", layer, " already holds token ", s->layer_len[layer] - 1,
          "; send the other layers' k_new/v_new before the next token"));
    }
  }
  lap.Mark(kLock);
  if (append) {
    // All-or-nothing: allocate every page the batch needs, then write every row.
    int32_t pages_needed = 0;
    for (Sequence* s : seqs) {
      if (s->layer_len[layer] == static_cast<int64_t>(s->pages.size()) * ps) ++pages_needed;
    }
    std::vector<PageRef> fresh;
    if (pages_needed > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      KVCD_RETURN_IF_ERROR(AllocateLocked(kWindow, pages_needed, &fresh));
    }
    std::vector<RowSlot> slots;
    size_t next_fresh = 0;
    for (size_t b = 0; b < seqs.size(); ++b) {
      const Sequence* s = seqs[b];
      const int64_t pos = s->layer_len[layer];
      const size_t page = static_cast<size_t>(pos / ps);
      const PageRef& r = page < s->pages.size() ? s->pages[page] : fresh[next_fresh++];
      slots.push_back({static_cast<int64_t>(b), r.page, static_cast<int32_t>(pos % ps)});
    }
    const PageStore& window = stores_[kWindow];
    absl::Status written =
        window.format->WriteRows(new_tokens.k, new_tokens.v, slots, layer, *window.pool);
    if (written.ok()) written = WriteCodes(kWindow, new_tokens.x, slots, layer);
    if (!written.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      FreeLocked(fresh);
      return written;
    }
    next_fresh = 0;
    for (size_t b = 0; b < seqs.size(); ++b) {
      Sequence* s = seqs[b];
      const int64_t pos = s->layer_len[layer];
      if (pos == static_cast<int64_t>(s->pages.size()) * ps)
        s->pages.push_back(fresh[next_fresh++]);
      const int64_t before = s->length();
      if (std::all_of(s->layer_len.begin(), s->layer_len.end(),
                      [&](int64_t l) { return l == before; })) {
        s->pending_token = new_tokens.tokens[b];
      }
      ++s->layer_len[layer];
      if (s->length() > before) {  // the token is complete: commit it, demote what aged out
        s->tokens.push_back(s->pending_token);
        DemotePages(s);
      }
    }
  }

  lap.Mark(kStore);
  AttentionBatch batch;
  batch.layer = layer;
  batch.num_q_heads = spec_.num_q_heads;
  batch.num_kv_heads = spec_.num_kv_heads;
  batch.head_dim = spec_.head_dim;
  batch.page_size = ps;
  batch.softmax_scale = softmax_scale;
  batch.model_format = stores_[kWindow].format.get();
  const int64_t q_stride = int64_t{spec_.num_q_heads} * spec_.head_dim;
  lengths->clear();
  for (size_t b = 0; b < seqs.size(); ++b) {
    AttentionJob job;
    const int64_t len = seqs[b]->layer_len[layer];
    job.segments = Segments(*seqs[b], len);
    if (device == nullptr) {
      job.q = q + static_cast<int64_t>(b) * q_stride;
      job.o = o + static_cast<int64_t>(b) * q_stride;
      job.lse = lse + static_cast<int64_t>(b) * spec_.num_q_heads;
    }
    batch.jobs.push_back(std::move(job));
    lengths->push_back(len);
  }
  if (device != nullptr) {
    batch.device_q = device->q;
    batch.device_q_bf16 = device->q_bf16;
    batch.device_o = device->o;
    batch.device_lse = device->lse;
  }
  counters_->attention_calls.fetch_add(1, std::memory_order_relaxed);
  lap.Mark(kSegments);
  absl::Status attended = backend_->Attend(batch);
  lap.Mark(kBackend);
  return attended;
}

absl::Status ModelCache::CheckReadable(const Sequence& seq, int64_t first, int64_t n) const {
  if (seq.closed) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq.id, " is closed"));
  }
  const int64_t len = seq.length();
  if (first < 0 || n < 0 || first > len || n > len - first) {  // no first + n: it may overflow
    return absl::InvalidArgumentError(absl::StrCat("first_token ", first, " + num_tokens ", n,
                                                   " exceeds the sequence length ", len));
  }
  return absl::OkStatus();
}

int64_t ModelCache::ReadRuns(const Sequence& seq, int64_t first, int64_t n, uint8_t* dst,
                             bool dst_on_device, std::vector<StoredPageCopy>* pages,
                             absl::Status* status) const {
  const int32_t ps = spec_.page_size;
  const int64_t len = seq.length();
  int64_t at = 0;
  for (int64_t p = first / ps; p * ps < first + n;) {
    // A run of consecutive pages of one store goes in one ReadPages.
    const int32_t store = seq.pages[static_cast<size_t>(p)].pool;
    std::vector<int32_t> ids;
    const int64_t run_at = at;
    for (; p * ps < first + n && seq.pages[static_cast<size_t>(p)].pool == store; ++p) {
      ids.push_back(seq.pages[static_cast<size_t>(p)].page);
      StoredPageCopy c;
      c.format = stores_[store].format->name();
      c.first_token = p * ps;
      c.num_tokens = static_cast<int32_t>(std::min<int64_t>(ps, len - p * ps));
      c.bytes = stores_[store].pool->page_bytes();
      at += c.bytes;
      pages->push_back(std::move(c));
    }
    if (dst != nullptr && status->ok()) {
      *status = backend_->ReadPages(*stores_[store].pool, ids, dst + run_at, dst_on_device);
    }
  }
  return at;
}

absl::StatusOr<std::string> ModelCache::ReadToHost(const Sequence& seq, int64_t first, int64_t n,
                                                   std::vector<StoredPageCopy>* pages) const {
  std::vector<StoredPageCopy> sizes;
  absl::Status read;
  std::string staged(static_cast<size_t>(ReadRuns(seq, first, n, nullptr, false, &sizes, &read)),
                     '\0');
  ReadRuns(seq, first, n, reinterpret_cast<uint8_t*>(staged.data()), false, pages, &read);
  if (!read.ok()) return read;
  return staged;
}

absl::Status ModelCache::Fetch(Sequence* seq, int64_t first, int64_t n, uint16_t* k_out,
                               uint16_t* v_out, std::vector<std::string>* page_formats) {
  const int32_t ps = spec_.page_size, d = spec_.head_dim, hkv = spec_.num_kv_heads;
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  KVCD_RETURN_IF_ERROR(CheckReadable(*seq, first, n));
  // The pages as stored, in host memory, then each format expands its rows.
  std::vector<StoredPageCopy> copies;
  KVCD_ASSIGN_OR_RETURN(std::string staged, ReadToHost(*seq, first, n, &copies));
  for (const auto& c : copies) page_formats->push_back(c.format);
  std::vector<float> rows(static_cast<size_t>(ps) * d);
  int64_t page_at = 0;
  for (int64_t p = first / ps; p * ps < first + n; ++p) {
    const PageRef& r = seq->pages[static_cast<size_t>(p)];
    const PageFormat& f = FormatOf(r);
    const int64_t t0 = std::max(first, p * ps);
    const int64_t t1 = std::min(first + n, (p + 1) * ps);
    const int32_t slot = static_cast<int32_t>(t0 - p * ps);
    const int32_t count = static_cast<int32_t>(t1 - t0);
    for (int32_t l = 0; l < spec_.num_layers; ++l) {
      const auto* layer_page =
          reinterpret_cast<const uint8_t*>(staged.data()) + page_at + l * f.layer_page_bytes();
      for (int32_t h = 0; h < hkv; ++h) {
        for (int which = 0; which < 2; ++which) {
          f.ExpandRows(layer_page, l, h, which, p * ps, slot, count, rows.data());
          uint16_t* out = which == 0 ? k_out : v_out;
          for (int32_t t = 0; t < count; ++t) {
            kernels::FloatToBf16N(rows.data() + int64_t{t} * d,
                                  out + ((int64_t{l} * n + (t0 - first + t)) * hkv + h) * d, d);
          }
        }
      }
    }
    page_at += f.page_bytes();
  }
  return absl::OkStatus();
}

absl::Status ModelCache::FetchStored(Sequence* seq, int64_t first, int64_t n,
                                     std::vector<StoredPageCopy>* pages) {
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  KVCD_RETURN_IF_ERROR(CheckReadable(*seq, first, n));
  std::vector<StoredPageCopy> copies;
  KVCD_ASSIGN_OR_RETURN(std::string staged, ReadToHost(*seq, first, n, &copies));
  size_t at = 0;
  for (StoredPageCopy& c : copies) {
    c.data = staged.substr(at, static_cast<size_t>(c.bytes));
    at += static_cast<size_t>(c.bytes);
    pages->push_back(std::move(c));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ModelCache::StoredBytes(Sequence* seq, int64_t first, int64_t n) {
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  KVCD_RETURN_IF_ERROR(CheckReadable(*seq, first, n));
  std::vector<StoredPageCopy> pages;
  absl::Status unused;
  return ReadRuns(*seq, first, n, nullptr, false, &pages, &unused);
}

absl::Status ModelCache::FetchStoredToDevice(Sequence* seq, int64_t first, int64_t n, uint8_t* dst,
                                             int64_t dst_bytes,
                                             std::vector<StoredPageCopy>* pages) {
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  KVCD_RETURN_IF_ERROR(CheckReadable(*seq, first, n));
  std::vector<StoredPageCopy> sizes;
  absl::Status read;
  const int64_t total = ReadRuns(*seq, first, n, nullptr, true, &sizes, &read);
  if (total > dst_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("destination has ", dst_bytes,
                                                   " bytes, too few for the pages from token ",
                                                   first, " (", total, " bytes)"));
  }
  ReadRuns(*seq, first, n, dst, true, pages, &read);
  return read;
}

int64_t ModelCache::Length(Sequence* seq) {
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  return seq->length();
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
  s.pinned_pages = tree_.PinnedPages();
  s.active_sequences = open_sequences_.load();
  s.codec = codec_ ? codec_->description() : std::string(history.name());
  if (fsq_ != nullptr) {
    s.codec = absl::StrCat("fsq G=", fsq_->codec.shape().latent_width,
                           fsq_->codec.source().empty() ? "" : " (" + fsq_->codec.source() + ")");
  }
  return s;
}

}  // namespace kvcd
