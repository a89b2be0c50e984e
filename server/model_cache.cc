#include "server/model_cache.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"

namespace kvcd {

void KvRows::CopyRowBf16(int64_t layer, int64_t token, int32_t head, int32_t head_dim,
                         uint16_t* out) const {
  const int64_t off = layer * layer_stride + token * token_stride + int64_t{head} * head_dim;
  if (is_bf16) {
    std::memcpy(out, static_cast<const uint16_t*>(data) + off, sizeof(uint16_t) * head_dim);
  } else {
    const float* src = static_cast<const float*>(data) + off;
    for (int32_t i = 0; i < head_dim; ++i) out[i] = kernels::FloatToBf16(src[i]);
  }
}

ModelCache::ModelCache(const ModelSpec& spec, Backend* backend, double high, double low,
                       CacheCounters* counters)
    : spec_(spec),
      backend_(backend),
      high_watermark_(high),
      low_watermark_(low),
      counters_(counters),
      tree_(spec.page_size) {}

ModelCache::~ModelCache() {
  pools_.clear();
  for (size_t i = 0; i < memory_.size(); ++i) backend_->FreePoolMemory(memory_[i], memory_bytes_[i]);
}

absl::StatusOr<std::unique_ptr<ModelCache>> ModelCache::Create(const ModelSpec& spec,
                                                               Backend* backend,
                                                               double high_watermark,
                                                               double low_watermark,
                                                               CacheCounters* counters) {
  if (spec.history_format != HistoryFormat::kBf16) {
    return absl::UnimplementedError(absl::StrCat("model '", spec.name, "': history_format ",
                                                 HistoryFormatName(spec.history_format),
                                                 " is not available in this build; use bf16"));
  }
  std::unique_ptr<ModelCache> cache(
      new ModelCache(spec, backend, high_watermark, low_watermark, counters));
  const int64_t layer_page_bytes =
      kernels::Bf16PageElems(spec.num_kv_heads, spec.page_size, spec.head_dim) * 2;
  const int64_t page_bytes = layer_page_bytes * spec.num_layers;
  const uint64_t pages = spec.memory_bytes / static_cast<uint64_t>(page_bytes);
  if (pages < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", spec.name, "': memory_bytes ", spec.memory_bytes,
        " is smaller than one BF16 page (", page_bytes, " bytes = ", spec.num_layers,
        " layers x K,V x ", spec.num_kv_heads, " heads x ", spec.page_size, " tokens x ",
        spec.head_dim, " x 2 bytes)"));
  }
  if (pages > (1u << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", spec.name, "': ", pages, " pages exceed the 2^30 page limit"));
  }
  const uint64_t bytes = pages * static_cast<uint64_t>(page_bytes);
  auto mem = backend->AllocatePoolMemory(bytes);
  if (!mem.ok()) return mem.status();
  cache->memory_.push_back(*mem);
  cache->memory_bytes_.push_back(bytes);
  cache->pools_.push_back(std::make_unique<PagePool>("bf16", *mem, spec.num_layers,
                                                     layer_page_bytes,
                                                     static_cast<int32_t>(pages)));
  return cache;
}

absl::Status ModelCache::AllocateLocked(int32_t pool, int32_t n, std::vector<PageRef>* out) {
  if (n == 0) return absl::OkStatus();
  PagePool& p = *pools_[pool];
  if (p.free_pages() < n) {
    tree_.Evict([&] { return p.free_pages() < n; },
                [&](const PageRef& r) {
                  pools_[r.pool]->Free({r.page});
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
  for (int32_t id : ids) out->push_back(PageRef{pool, id});
  return absl::OkStatus();
}

void ModelCache::FreeLocked(absl::Span<const PageRef> pages) {
  for (const PageRef& r : pages) pools_[r.pool]->Free({r.page});
}

void ModelCache::EvictToWatermarksLocked() {
  for (auto& pool : pools_) {
    const int32_t total = pool->num_pages();
    if (pool->used_pages() <= high_watermark_ * total) continue;
    const double low = low_watermark_ * total;
    PagePool* p = pool.get();
    tree_.Evict([&] { return p->used_pages() > low; },
                [&](const PageRef& r) {
                  pools_[r.pool]->Free({r.page});
                  counters_->evicted_pages.fetch_add(1, std::memory_order_relaxed);
                });
  }
}

void ModelCache::WriteBf16Rows(const PageRef& page, int32_t slot, const KvRows& k,
                               const KvRows& v, int64_t src_token, int32_t count, int32_t layer) {
  const int32_t ps = spec_.page_size;
  const int32_t d = spec_.head_dim;
  const int32_t hkv = spec_.num_kv_heads;
  const int64_t v_offset = int64_t{hkv} * ps * d;  // elements
  uint16_t row[256];
  const PagePool& pool = *pools_[page.pool];
  const int32_t l_begin = layer >= 0 ? layer : 0;
  const int32_t l_end = layer >= 0 ? layer + 1 : spec_.num_layers;
  for (int32_t l = l_begin; l < l_end; ++l) {
    // Rows of a single-layer input (fused append) have no layer offset.
    const int64_t src_layer = layer >= 0 ? 0 : l;
    uint16_t* base = reinterpret_cast<uint16_t*>(pool.PagePtr(l, page.page));
    for (int32_t t = 0; t < count; ++t) {
      for (int32_t h = 0; h < hkv; ++h) {
        const int64_t dst = (int64_t{h} * ps + slot + t) * d;
        k.CopyRowBf16(src_layer, src_token + t, h, d, row);
        backend_->CopyToPool(reinterpret_cast<uint8_t*>(base + dst), row, sizeof(uint16_t) * d);
        v.CopyRowBf16(src_layer, src_token + t, h, d, row);
        backend_->CopyToPool(reinterpret_cast<uint8_t*>(base + v_offset + dst), row,
                             sizeof(uint16_t) * d);
      }
    }
  }
}

absl::StatusOr<PutResult> ModelCache::Put(const std::string& salt,
                                          absl::Span<const int32_t> tokens, int64_t kv_first,
                                          const KvRows& k, const KvRows& v) {
  const int32_t ps = spec_.page_size;
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t full_pages = n / ps;
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
    if (result.cached_tokens < std::min<int64_t>(kv_first, full_pages * ps)) {
      tree_.Unpin(match.node);
      return absl::FailedPreconditionError(absl::StrCat(
          "kv_first_token is ", kv_first, " but only ", result.cached_tokens,
          " tokens of this prompt are cached (evicted, or never put); resend from ",
          result.cached_tokens));
    }
    absl::Status s = AllocateLocked(0, static_cast<int32_t>(full_pages - cached_pages), &fresh);
    if (!s.ok()) {
      tree_.Unpin(match.node);
      return s;
    }
  }
  // Write outside the lock: the fresh pages are private until Insert publishes them.
  const int64_t first_new = static_cast<int64_t>(match.pages.size());
  for (int64_t i = 0; i < static_cast<int64_t>(fresh.size()); ++i) {
    WriteBf16Rows(fresh[i], 0, k, v, (first_new + i) * ps - kv_first, ps, -1);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<PageRef> all = match.pages;
    all.insert(all.end(), fresh.begin(), fresh.end());
    RadixTree::InsertResult ins = tree_.Insert(salt, full, all);
    // Chunks another Put inserted meanwhile: keep the tree's copy, free ours. Pages of
    // our own pinned match come back as duplicates of themselves and are kept.
    std::vector<PageRef> to_free;
    for (const PageRef& dup : ins.duplicates) {
      if (std::find(match.pages.begin(), match.pages.end(), dup) == match.pages.end()) {
        to_free.push_back(dup);
      }
    }
    FreeLocked(to_free);
    tree_.Unpin(match.node);
    result.inserted_tokens = ins.new_pages * ps;
    counters_->inserted_pages.fetch_add(static_cast<uint64_t>(ins.new_pages));
    counters_->hit_tokens.fetch_add(static_cast<uint64_t>(result.cached_tokens));
    counters_->miss_tokens.fetch_add(static_cast<uint64_t>(n - result.cached_tokens));
    EvictToWatermarksLocked();
  }
  return result;
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
                                           const KvRows& k, const KvRows& v) {
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
    absl::Status s = AllocateLocked(0, static_cast<int32_t>(pages_needed), &fresh);
    if (!s.ok()) return s;
  }
  seq->pages.insert(seq->pages.end(), fresh.begin(), fresh.end());
  for (int64_t t = 0; t < n;) {
    const int64_t pos = len + t;
    const int32_t slot = static_cast<int32_t>(pos % ps);
    const int32_t count = static_cast<int32_t>(std::min<int64_t>(ps - slot, n - t));
    WriteBf16Rows(seq->pages[static_cast<size_t>(pos / ps)], slot, k, v, t, count, -1);
    t += count;
  }
  for (auto& l : seq->layer_len) l += n;
  seq->tokens.insert(seq->tokens.end(), tokens.begin(), tokens.end());
  return len + n;
}

std::vector<AttentionSegment> ModelCache::Segments(const Sequence& seq, int64_t len) const {
  // Consecutive pages of one pool form one segment.
  std::vector<AttentionSegment> segs;
  const int32_t ps = spec_.page_size;
  const int64_t num_pages = (len + ps - 1) / ps;
  for (int64_t i = 0; i < num_pages; ++i) {
    const PageRef& r = seq.pages[static_cast<size_t>(i)];
    if (segs.empty() || segs.back().pool != pools_[r.pool].get()) {
      AttentionSegment s;
      s.format = PageFormat::kBf16;
      s.pool = pools_[r.pool].get();
      segs.push_back(std::move(s));
    }
    AttentionSegment& s = segs.back();
    s.page_ids.push_back(r.page);
    s.token_end += std::min<int64_t>(ps, len - i * ps);  // only the last page is partial
  }
  return segs;
}

absl::Status ModelCache::Attend(int32_t layer, absl::Span<Sequence* const> seqs, const float* q,
                                float softmax_scale, absl::Span<const NewToken> new_tokens,
                                float* o, float* lse, std::vector<int64_t>* lengths) {
  const int32_t ps = spec_.page_size;
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
    if (!new_tokens.empty() && s->layer_len[layer] != s->length()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", s->id, ": layer ", layer, " already holds token ", s->layer_len[layer] - 1,
          "; send the other layers' k_new/v_new before the next token"));
    }
  }
  if (!new_tokens.empty()) {
    // All-or-nothing: allocate every page the batch needs before writing any row.
    int32_t pages_needed = 0;
    for (Sequence* s : seqs) {
      if (s->layer_len[layer] == static_cast<int64_t>(s->pages.size()) * ps) ++pages_needed;
    }
    std::vector<PageRef> fresh;
    if (pages_needed > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      absl::Status st = AllocateLocked(0, pages_needed, &fresh);
      if (!st.ok()) return st;
    }
    size_t next_fresh = 0;
    for (size_t b = 0; b < seqs.size(); ++b) {
      Sequence* s = seqs[b];
      const int64_t pos = s->layer_len[layer];
      if (pos == static_cast<int64_t>(s->pages.size()) * ps) s->pages.push_back(fresh[next_fresh++]);
      WriteBf16Rows(s->pages[static_cast<size_t>(pos / ps)], static_cast<int32_t>(pos % ps),
                    new_tokens[b].k, new_tokens[b].v, 0, 1, layer);
      const int64_t before = s->length();
      if (std::all_of(s->layer_len.begin(), s->layer_len.end(),
                      [&](int64_t l) { return l == before; })) {
        s->pending_token = new_tokens[b].token;
      }
      ++s->layer_len[layer];
      if (s->length() > before) s->tokens.push_back(s->pending_token);
    }
  }

  AttentionBatch batch;
  batch.layer = layer;
  batch.num_q_heads = spec_.num_q_heads;
  batch.num_kv_heads = spec_.num_kv_heads;
  batch.head_dim = spec_.head_dim;
  batch.page_size = ps;
  batch.softmax_scale = softmax_scale;
  const int64_t q_stride = int64_t{spec_.num_q_heads} * spec_.head_dim;
  lengths->clear();
  for (size_t b = 0; b < seqs.size(); ++b) {
    AttentionJob job;
    const int64_t len = seqs[b]->layer_len[layer];
    job.segments = Segments(*seqs[b], len);
    job.q = q + static_cast<int64_t>(b) * q_stride;
    job.o = o + static_cast<int64_t>(b) * q_stride;
    job.lse = lse + static_cast<int64_t>(b) * spec_.num_q_heads;
    batch.jobs.push_back(std::move(job));
    lengths->push_back(len);
  }
  counters_->attention_calls.fetch_add(1, std::memory_order_relaxed);
  return backend_->Attend(batch);
}

absl::Status ModelCache::Fetch(Sequence* seq, int64_t first, int64_t n, uint16_t* k_out,
                               uint16_t* v_out, std::vector<std::string>* page_formats) {
  const int32_t ps = spec_.page_size;
  const int32_t d = spec_.head_dim;
  const int32_t hkv = spec_.num_kv_heads;
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  if (seq->closed) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq->id, " is closed"));
  }
  const int64_t len = seq->length();
  if (first + n > len) {
    return absl::InvalidArgumentError(absl::StrCat("first_token + num_tokens = ", first + n,
                                                   " exceeds the sequence length ", len));
  }
  const int64_t v_offset = int64_t{hkv} * ps * d;
  for (int64_t p = first / ps; p * ps < first + n; ++p) {
    page_formats->push_back(pools_[seq->pages[static_cast<size_t>(p)].pool]->format());
  }
  for (int32_t l = 0; l < spec_.num_layers; ++l) {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = first + t;
      const PageRef& r = seq->pages[static_cast<size_t>(pos / ps)];
      const uint16_t* base = reinterpret_cast<const uint16_t*>(pools_[r.pool]->PagePtr(l, r.page));
      for (int32_t h = 0; h < hkv; ++h) {
        const int64_t src = (int64_t{h} * ps + pos % ps) * d;
        const int64_t dst = ((int64_t{l} * n + t) * hkv + h) * d;
        backend_->CopyFromPool(k_out + dst, reinterpret_cast<const uint8_t*>(base + src),
                               sizeof(uint16_t) * d);
        backend_->CopyFromPool(v_out + dst, reinterpret_cast<const uint8_t*>(base + v_offset + src),
                               sizeof(uint16_t) * d);
      }
    }
  }
  return absl::OkStatus();
}

int64_t ModelCache::Length(Sequence* seq) {
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  return seq->length();
}

ModelSnapshot ModelCache::Snapshot() const {
  ModelSnapshot s;
  for (const auto& p : pools_) {
    s.pools.push_back(PoolSnapshot{p->format(), p->page_bytes(), p->num_pages(), p->used_pages()});
  }
  std::lock_guard<std::mutex> lock(mu_);
  s.cached_tokens = tree_.cached_pages() * spec_.page_size;
  s.pinned_pages = tree_.PinnedPages();
  s.active_sequences = open_sequences_.load();
  s.codec = HistoryFormatName(spec_.history_format);
  return s;
}

}  // namespace kvcd
