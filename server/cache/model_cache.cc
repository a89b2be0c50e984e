#include "server/cache/model_cache.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/bf16_attention.h"
#include "kvcd/kernels/int2_attention.h"
#include "kvcd/kernels/int2_codec.h"

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

void KvRows::CopyRowFloat(int64_t layer, int64_t token, int32_t head, int32_t head_dim,
                          float* out) const {
  const int64_t off = layer * layer_stride + token * token_stride + int64_t{head} * head_dim;
  if (is_bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(data) + off;
    for (int32_t i = 0; i < head_dim; ++i) out[i] = kernels::Bf16ToFloat(src[i]);
  } else {
    std::memcpy(out, static_cast<const float*>(data) + off, sizeof(float) * head_dim);
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
  for (size_t i = 0; i < memory_.size(); ++i)
    backend_->FreePoolMemory(memory_[i], memory_bytes_[i]);
}

absl::StatusOr<std::unique_ptr<ModelCache>> ModelCache::Create(
    const ModelSpec& spec, Backend* backend, double high_watermark, double low_watermark,
    CacheCounters* counters, const std::string& codec_blob) {
  std::unique_ptr<ModelCache> cache(
      new ModelCache(spec, backend, high_watermark, low_watermark, counters));
  const bool int2 = spec.history_format == HistoryFormat::kInt2Oscar;
  if (!int2 && !codec_blob.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", spec.name, "': codec_blob is only used with history_format int2-oscar"));
  }
  if (int2) {
    if (!codec_blob.empty() || !spec.codec_file.empty()) {
      auto file = codec_blob.empty() ? SafetensorsFile::Load(spec.codec_file)
                                     : SafetensorsFile::Parse(codec_blob);
      if (!file.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("model '", spec.name, "': codec file: ", file.status().message()));
      }
      const std::string what = codec_blob.empty() ? "oscar (" + spec.codec_file + ")"
                                                  : std::string("oscar (registered codec)");
      auto codec = CodecProfile::FromSafetensors(*file, spec.num_layers, spec.head_dim, what);
      if (!codec.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("model '", spec.name, "': ", codec.status().message()));
      }
      cache->codec_ = std::make_unique<CodecProfile>(std::move(*codec));
    } else if (spec.codec == "identity") {
      cache->codec_ =
          std::make_unique<CodecProfile>(CodecProfile::Identity(spec.num_layers, spec.head_dim));
    } else {
      cache->codec_ =
          std::make_unique<CodecProfile>(CodecProfile::Hadamard(spec.num_layers, spec.head_dim));
      if (spec.codec.empty()) {
        std::fprintf(stderr,
                     "kvcd: model '%s': no codec file, INT2 history uses the Hadamard rotation\n",
                     spec.name.c_str());
        cache->codec_->set_description("hadamard (no codec file)");
      }
    }
  }
  if (cache->codec_ != nullptr) {
    for (int l = 0; l < spec.num_layers; ++l) {
      cache->rho_k_.push_back(cache->codec_->RhoK(l));
      cache->rho_v_.push_back(cache->codec_->RhoV(l));
    }
  }
  const int64_t bf16_layer_bytes =
      kernels::Bf16PageElems(spec.num_kv_heads, spec.page_size, spec.head_dim) * 2;
  const int64_t int2_layer_bytes =
      kernels::Int2PageBytes(spec.num_kv_heads, spec.page_size, spec.head_dim);
  struct PoolPlan {
    const char* format;
    int64_t layer_bytes;
    uint64_t budget;
  };
  std::vector<PoolPlan> plan;
  if (int2) {
    const auto bf16_budget =
        static_cast<uint64_t>(static_cast<double>(spec.memory_bytes) * spec.bf16_fraction);
    plan.push_back({"bf16", bf16_layer_bytes, bf16_budget});
    plan.push_back({"int2-oscar", int2_layer_bytes, spec.memory_bytes - bf16_budget});
  } else {
    plan.push_back({"bf16", bf16_layer_bytes, spec.memory_bytes});
  }
  for (const PoolPlan& pp : plan) {
    const int64_t page_bytes = pp.layer_bytes * spec.num_layers;
    const uint64_t pages = pp.budget / static_cast<uint64_t>(page_bytes);
    if (pages < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("model '", spec.name, "': its ", pp.format, " pool gets ", pp.budget,
                       " bytes of memory_bytes ", spec.memory_bytes, ", less than one page (",
                       page_bytes, " bytes for ", spec.num_layers, " layers); raise memory_bytes",
                       int2 ? " or adjust bf16_fraction" : ""));
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
    cache->pools_.push_back(std::make_unique<PagePool>(
        pp.format, *mem, spec.num_layers, pp.layer_bytes, static_cast<int32_t>(pages)));
  }
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

void ModelCache::QueueDeviceRows(const PageRef& page, int32_t slot, int32_t layer,
                                 const NewToken& t, std::vector<Backend::RowStoreJob>* out) const {
  const int32_t ps = spec_.page_size;
  const int32_t d = spec_.head_dim;
  const int32_t hkv = spec_.num_kv_heads;
  const int64_t elem = t.k.is_bf16 ? 2 : 4;
  uint8_t* base = pools_[page.pool]->PagePtr(layer, page.page);
  for (int which = 0; which < 2; ++which) {
    const uint8_t* src = static_cast<const uint8_t*>(which == 0 ? t.k_device : t.v_device);
    for (int32_t h = 0; h < hkv; ++h) {
      Backend::RowStoreJob j;
      j.src = src + int64_t{h} * d * elem;
      j.dst = base + 2 * ((int64_t{which} * hkv + h) * ps + slot) * d;
      j.rotation = codec_ ? (which == 0 ? codec_->RK(layer) : codec_->RV(layer)) : nullptr;
      out->push_back(j);
    }
  }
}

void ModelCache::WriteBf16Rows(const PageRef& page, int32_t slot, const KvRows& k, const KvRows& v,
                               int64_t src_token, int32_t count, int32_t layer) {
  const int32_t ps = spec_.page_size;
  const int32_t d = spec_.head_dim;
  const int32_t hkv = spec_.num_kv_heads;
  const int64_t v_offset = int64_t{hkv} * ps * d;  // elements
  uint16_t row[256];
  float f[256], rot[256];
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
        for (int which = 0; which < 2; ++which) {
          const KvRows& src = which == 0 ? k : v;
          if (codec_ != nullptr) {  // the windows of an INT2 model hold rotated rows
            src.CopyRowFloat(src_layer, src_token + t, h, d, f);
            kernels::RotateRows(f, 1, d, which == 0 ? codec_->RK(l) : codec_->RV(l), rot);
            kernels::FloatToBf16N(rot, row, d);
          } else {
            src.CopyRowBf16(src_layer, src_token + t, h, d, row);
          }
          backend_->CopyToPool(reinterpret_cast<uint8_t*>(base + (which ? v_offset : 0) + dst), row,
                               sizeof(uint16_t) * d);
        }
      }
    }
  }
}

void ModelCache::WriteInt2Page(const PageRef& page, const KvRows& k, const KvRows& v,
                               int64_t src_token) {
  const int32_t ps = spec_.page_size, d = spec_.head_dim, hkv = spec_.num_kv_heads;
  const kernels::Int2PageLayout layout{hkv, ps, d};
  const PagePool& pool = *pools_[page.pool];
  std::vector<float> rows(static_cast<size_t>(ps) * d);
  std::vector<uint8_t> staged(static_cast<size_t>(pool.layer_page_bytes()));
  for (int32_t l = 0; l < spec_.num_layers; ++l) {
    for (int32_t h = 0; h < hkv; ++h) {
      for (int which = 0; which < 2; ++which) {
        const KvRows& src = which == 0 ? k : v;
        for (int32_t t = 0; t < ps; ++t)
          src.CopyRowFloat(l, src_token + t, h, d, rows.data() + t * d);
        kernels::DemoteRowsToInt2(
            rows.data(), ps, d, which == 0 ? codec_->RK(l) : codec_->RV(l),
            which == 0 ? codec_->RhoK(l) : codec_->RhoV(l),
            which == 0 ? layout.K(staged.data(), h) : layout.V(staged.data(), h));
      }
    }
    backend_->CopyToPool(pool.PagePtr(l, page.page), staged.data(), staged.size());
  }
}

void ModelCache::ReadRows(const PageRef& page, int32_t layer, int32_t head, int which, int32_t slot,
                          int32_t count, float* out) const {
  const int32_t ps = spec_.page_size, d = spec_.head_dim, hkv = spec_.num_kv_heads;
  const PagePool& pool = *pools_[page.pool];
  const uint8_t* base = pool.PagePtr(layer, page.page);
  if (page.pool == 0) {
    std::vector<uint16_t> raw(static_cast<size_t>(count) * d);
    const int64_t off = (int64_t{which} * hkv * ps + int64_t{head} * ps + slot) * d;
    backend_->CopyFromPool(raw.data(), base + off * 2, raw.size() * 2);
    kernels::Bf16ToFloatN(raw.data(), out, static_cast<int64_t>(raw.size()));
    return;
  }
  const kernels::Int2PageLayout layout{hkv, ps, d};
  std::vector<uint8_t> staged(static_cast<size_t>(pool.layer_page_bytes()));
  backend_->CopyFromPool(staged.data(), base, staged.size());
  kernels::ExpandInt2Rows(
      which == 0 ? layout.K(staged.data(), head) : layout.V(staged.data(), head), count, d, nullptr,
      out, slot);
}

void ModelCache::DemotePages(Sequence* seq) {
  if (codec_ == nullptr) return;
  const int32_t ps = spec_.page_size, d = spec_.head_dim, hkv = spec_.num_kv_heads;
  const int64_t len = seq->length();
  const int64_t first = std::max<int64_t>(
      {seq->next_demote_page, seq->shared_pages, static_cast<int64_t>(spec_.sink_pages())});
  int64_t i = first;
  // Page i is demoted once all its tokens are older than the recent window.
  for (; (i + 1) * ps <= len - spec_.recent_tokens; ++i) {
    const PageRef old = seq->pages[static_cast<size_t>(i)];
    if (old.pool != 0) continue;
    std::vector<PageRef> fresh;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!AllocateLocked(1, 1, &fresh).ok()) break;  // INT2 pool full: stay BF16, retry later
    }
    if (backend_->DemotesOnDevice()) {
      Backend::DemoteJob job{pools_[0].get(),
                             old.page,
                             pools_[1].get(),
                             fresh[0].page,
                             spec_.num_layers,
                             hkv,
                             ps,
                             d,
                             rho_k_.data(),
                             rho_v_.data()};
      if (!backend_->DemotePage(job).ok()) {  // keep the BF16 page; the next append retries
        std::lock_guard<std::mutex> lock(mu_);
        FreeLocked(fresh);
        break;
      }
    } else {
      const kernels::Int2PageLayout layout{hkv, ps, d};
      const PagePool& pool = *pools_[1];
      std::vector<float> rows(static_cast<size_t>(ps) * d);
      std::vector<uint8_t> staged(static_cast<size_t>(pool.layer_page_bytes()));
      for (int32_t l = 0; l < spec_.num_layers; ++l) {
        for (int32_t h = 0; h < hkv; ++h) {
          for (int which = 0; which < 2; ++which) {
            ReadRows(old, l, h, which, 0, ps, rows.data());  // already rotated
            kernels::DemoteRowsToInt2(
                rows.data(), ps, d, nullptr, which == 0 ? codec_->RhoK(l) : codec_->RhoV(l),
                which == 0 ? layout.K(staged.data(), h) : layout.V(staged.data(), h));
          }
        }
        backend_->CopyToPool(pool.PagePtr(l, fresh[0].page), staged.data(), staged.size());
      }
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

absl::StatusOr<PutResult> ModelCache::StorePrefix(
    const std::string& salt, absl::Span<const int32_t> tokens, int64_t full_pages,
    int64_t required_pages, const std::function<void(int64_t, const PageRef&)>& write,
    const std::function<absl::Status()>& check) {
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
    // Sink pages stay BF16; every other page is stored in the history format.
    const int64_t sink_end =
        codec_ ? std::min<int64_t>(spec_.sink_pages(), full_pages) : full_pages;
    const int32_t bf16_needed = static_cast<int32_t>(std::max<int64_t>(0, sink_end - cached_pages));
    const int32_t hist_needed =
        static_cast<int32_t>(full_pages - std::max<int64_t>(cached_pages, sink_end));
    absl::Status s = AllocateLocked(0, bf16_needed, &fresh);
    if (s.ok() && codec_) s = AllocateLocked(1, hist_needed, &fresh);
    if (!s.ok()) {
      FreeLocked(fresh);
      tree_.Unpin(match.node);
      return s;
    }
  }
  // Write outside the lock: the fresh pages are private until Insert publishes them.
  const int64_t first_new = static_cast<int64_t>(match.pages.size());
  for (int64_t i = 0; i < static_cast<int64_t>(fresh.size()); ++i) write(first_new + i, fresh[i]);
  if (check) {
    absl::Status s = check();
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      FreeLocked(fresh);
      tree_.Unpin(match.node);
      return s;
    }
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
    tree_.Unpin(match.node);
    result.inserted_tokens = ins.new_pages * ps;
    counters_->inserted_pages.fetch_add(static_cast<uint64_t>(ins.new_pages));
    counters_->hit_tokens.fetch_add(static_cast<uint64_t>(result.cached_tokens));
    counters_->miss_tokens.fetch_add(static_cast<uint64_t>(n - result.cached_tokens));
    EvictToWatermarksLocked();
  }
  return result;
}

absl::StatusOr<PutResult> ModelCache::Put(const std::string& salt, absl::Span<const int32_t> tokens,
                                          int64_t kv_first, const KvRows& k, const KvRows& v) {
  const int32_t ps = spec_.page_size;
  const int64_t full_pages = static_cast<int64_t>(tokens.size()) / ps;
  return StorePrefix(salt, tokens, full_pages, kv_first / ps,
                     [&](int64_t page_index, const PageRef& page) {
                       const int64_t src = page_index * ps - kv_first;
                       if (page.pool == 0) {
                         WriteBf16Rows(page, 0, k, v, src, ps, -1);
                       } else {
                         WriteInt2Page(page, k, v, src);
                       }
                     });
}

int32_t ModelCache::PoolForPage(int64_t page_index) const {
  return codec_ != nullptr && page_index >= spec_.sink_pages() ? 1 : 0;
}

absl::Status ModelCache::CheckStoredPage(int64_t page_index, const std::string& format,
                                         absl::string_view data) const {
  const PagePool& pool = *pools_[PoolForPage(page_index)];
  if (format != pool.format()) {
    return absl::InvalidArgumentError(absl::StrCat("page ", page_index, " has format '", format,
                                                   "', expected '", pool.format(), "' there"));
  }
  if (static_cast<int64_t>(data.size()) != pool.page_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("page ", page_index, " has ", data.size(),
                                                   " bytes, expected ", pool.page_bytes(), " (one ",
                                                   pool.format(), " page, all layers)"));
  }
  auto non_finite = [](uint16_t h, bool bf16) {
    return bf16 ? (h & 0x7f80u) == 0x7f80u : (h & 0x7c00u) == 0x7c00u;
  };
  const int64_t layer_bytes = pool.layer_page_bytes();
  for (int32_t l = 0; l < spec_.num_layers; ++l) {
    const char* base = data.data() + l * layer_bytes;
    if (PoolForPage(page_index) == 0) {  // BF16 K and V rows
      for (int64_t i = 0; i < layer_bytes / 2; ++i) {
        uint16_t h;
        std::memcpy(&h, base + 2 * i, 2);
        if (non_finite(h, true)) {
          return absl::InvalidArgumentError(
              absl::StrCat("page ", page_index, " layer ", l, " holds a non-finite BF16 value"));
        }
      }
    } else {  // INT2: codes are any bytes; FP16 scales (>= 0) and minimums must be finite
      const kernels::Int2PageLayout layout{spec_.num_kv_heads, spec_.page_size, spec_.head_dim};
      const int64_t first = layout.KScale(0),
                    count = 2LL * 2 * spec_.num_kv_heads * spec_.page_size;
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, base + 2 * (first + i), 2);
        const bool is_scale = (i / spec_.page_size) % 2 == 0;
        if (non_finite(h, false) || (is_scale && (h & 0x8000u) != 0 && (h & 0x7fffu) != 0)) {
          return absl::InvalidArgumentError(absl::StrCat("page ", page_index, " layer ", l,
                                                         " holds a non-finite FP16 parameter or a ",
                                                         "negative scale"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PutResult> ModelCache::PushPages(const std::string& salt,
                                                absl::Span<const int32_t> tokens,
                                                int64_t first_page,
                                                absl::Span<const StoredPageIn> pages) {
  const int32_t ps = spec_.page_size;
  const int64_t end_page = first_page + static_cast<int64_t>(pages.size());
  for (size_t i = 0; i < pages.size(); ++i) {
    absl::Status s =
        CheckStoredPage(first_page + static_cast<int64_t>(i), pages[i].format, pages[i].data);
    if (!s.ok())
      return absl::Status(s.code(), absl::StrCat("inline_pages[", i, "]: ", s.message()));
  }
  return StorePrefix(
      salt, tokens.subspan(0, static_cast<size_t>(end_page * ps)), end_page, first_page,
      [&](int64_t page_index, const PageRef& page) {
        const PagePool& pool = *pools_[page.pool];
        const char* src = pages[static_cast<size_t>(page_index - first_page)].data.data();
        for (int32_t l = 0; l < spec_.num_layers; ++l) {
          backend_->CopyToPool(pool.PagePtr(l, page.page), src + l * pool.layer_page_bytes(),
                               static_cast<size_t>(pool.layer_page_bytes()));
        }
      });
}

const std::string& ModelCache::StoredFormat(int64_t page_index) const {
  return pools_[PoolForPage(page_index)]->format();
}

int64_t ModelCache::StoredPageBytes(int64_t page_index) const {
  return pools_[PoolForPage(page_index)]->page_bytes();
}

absl::StatusOr<PutResult> ModelCache::PushDevicePages(const std::string& salt,
                                                      absl::Span<const int32_t> tokens,
                                                      int64_t first_page, int64_t num_pages,
                                                      const uint8_t* src) {
  const int32_t ps = spec_.page_size;
  const int64_t end_page = first_page + num_pages;
  std::vector<int64_t> offset(static_cast<size_t>(num_pages) + 1, 0);
  for (int64_t i = 0; i < num_pages; ++i) {
    offset[static_cast<size_t>(i) + 1] = offset[static_cast<size_t>(i)] + StoredPageBytes(first_page + i);
  }
  const kernels::Int2PageLayout layout{spec_.num_kv_heads, spec_.page_size, spec_.head_dim};
  std::vector<DeviceSpan> spans;
  // Every pushed page is checked (also those already cached); new pages are copied.
  for (int64_t i = 0; i < num_pages; ++i) {
    const PagePool& pool = *pools_[PoolForPage(first_page + i)];
    for (int32_t l = 0; l < spec_.num_layers; ++l) {
      const uint8_t* layer_src = src + offset[static_cast<size_t>(i)] + l * pool.layer_page_bytes();
      DeviceSpan c;
      if (PoolForPage(first_page + i) == 0) {
        c.src = layer_src;
        c.bytes = static_cast<uint64_t>(pool.layer_page_bytes());
        c.check = DeviceSpan::kBf16Finite;
      } else {
        c.src = layer_src + 2 * layout.KScale(0);
        c.bytes = 2ull * 2 * 2 * spec_.num_kv_heads * spec_.page_size;
        c.check = DeviceSpan::kFp16ScaleMin;
        c.check_block = static_cast<uint32_t>(spec_.page_size);
      }
      spans.push_back(c);
    }
  }
  return StorePrefix(
      salt, tokens.subspan(0, static_cast<size_t>(end_page * ps)), end_page, first_page,
      [&](int64_t page_index, const PageRef& page) {
        const PagePool& pool = *pools_[page.pool];
        const uint8_t* page_src = src + offset[static_cast<size_t>(page_index - first_page)];
        for (int32_t l = 0; l < spec_.num_layers; ++l) {
          DeviceSpan c;
          c.src = page_src + l * pool.layer_page_bytes();
          c.dst = pool.PagePtr(l, page.page);
          c.bytes = static_cast<uint64_t>(pool.layer_page_bytes());
          spans.push_back(c);
        }
      },
      [&]() -> absl::Status {
        uint64_t bad = 0;
        KVCD_RETURN_IF_ERROR(backend_->CopySpans(spans, &bad));
        if (bad != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "pages hold ", bad,
              " non-finite BF16 values, non-finite FP16 parameters or negative scales; "
              "nothing was stored"));
        }
        return absl::OkStatus();
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
  DemotePages(seq);
  return len + n;
}

std::vector<AttentionSegment> ModelCache::Segments(const Sequence& seq, int64_t len) const {
  // Consecutive pages of one pool form one segment (sink | history | recent).
  std::vector<AttentionSegment> segs;
  const int32_t ps = spec_.page_size;
  const int64_t num_pages = (len + ps - 1) / ps;
  for (int64_t i = 0; i < num_pages; ++i) {
    const PageRef& r = seq.pages[static_cast<size_t>(i)];
    if (segs.empty() || segs.back().pool != pools_[r.pool].get()) {
      AttentionSegment s;
      s.format = r.pool == 0 ? PageFormat::kBf16 : PageFormat::kInt2Oscar;
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
                                float* o, float* lse, std::vector<int64_t>* lengths,
                                const DeviceIo* device) {
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
    std::vector<Backend::RowStoreJob> device_rows;
    for (size_t b = 0; b < seqs.size(); ++b) {
      Sequence* s = seqs[b];
      const int64_t pos = s->layer_len[layer];
      if (pos == static_cast<int64_t>(s->pages.size()) * ps)
        s->pages.push_back(fresh[next_fresh++]);
      const PageRef& page = s->pages[static_cast<size_t>(pos / ps)];
      const int32_t slot = static_cast<int32_t>(pos % ps);
      if (new_tokens[b].k_device != nullptr) {
        QueueDeviceRows(page, slot, layer, new_tokens[b], &device_rows);
      } else {
        WriteBf16Rows(page, slot, new_tokens[b].k, new_tokens[b].v, 0, 1, layer);
      }
      const int64_t before = s->length();
      if (std::all_of(s->layer_len.begin(), s->layer_len.end(),
                      [&](int64_t l) { return l == before; })) {
        s->pending_token = new_tokens[b].token;
      }
      ++s->layer_len[layer];
      if (s->length() > before) {
        s->tokens.push_back(s->pending_token);
        if (!device_rows.empty()) {  // the rows must be in their pages before demotion reads them
          KVCD_RETURN_IF_ERROR(backend_->StoreRows(device_rows, spec_.head_dim,
                                                   new_tokens.front().k.is_bf16));
          device_rows.clear();
        }
        DemotePages(s);
      }
    }
    if (!device_rows.empty()) {
      KVCD_RETURN_IF_ERROR(
          backend_->StoreRows(device_rows, spec_.head_dim, new_tokens.front().k.is_bf16));
    }
  }

  AttentionBatch batch;
  batch.layer = layer;
  batch.num_q_heads = spec_.num_q_heads;
  batch.num_kv_heads = spec_.num_kv_heads;
  batch.head_dim = spec_.head_dim;
  batch.page_size = ps;
  batch.softmax_scale = softmax_scale;
  batch.r_k = codec_ ? codec_->RK(layer) : nullptr;
  batch.r_v_t = codec_ ? codec_->RVT(layer) : nullptr;
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
  return backend_->Attend(batch);
}

absl::Status ModelCache::CheckReadable(const Sequence& seq, int64_t first, int64_t n) const {
  if (seq.closed) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq.id, " is closed"));
  }
  const int64_t len = seq.length();
  if (first + n > len) {
    return absl::InvalidArgumentError(absl::StrCat("first_token + num_tokens = ", first + n,
                                                   " exceeds the sequence length ", len));
  }
  return absl::OkStatus();
}

absl::Status ModelCache::Fetch(Sequence* seq, int64_t first, int64_t n, uint16_t* k_out,
                               uint16_t* v_out, std::vector<std::string>* page_formats) {
  const int32_t ps = spec_.page_size;
  const int32_t d = spec_.head_dim;
  const int32_t hkv = spec_.num_kv_heads;
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  KVCD_RETURN_IF_ERROR(CheckReadable(*seq, first, n));
  for (int64_t p = first / ps; p * ps < first + n; ++p) {
    page_formats->push_back(pools_[seq->pages[static_cast<size_t>(p)].pool]->format());
  }
  std::vector<float> rows(static_cast<size_t>(ps) * d), plain(static_cast<size_t>(ps) * d);
  for (int32_t l = 0; l < spec_.num_layers; ++l) {
    for (int64_t t0 = first; t0 < first + n;) {
      const int32_t slot = static_cast<int32_t>(t0 % ps);
      const int32_t count = static_cast<int32_t>(std::min<int64_t>(ps - slot, first + n - t0));
      const PageRef& r = seq->pages[static_cast<size_t>(t0 / ps)];
      for (int32_t h = 0; h < hkv; ++h) {
        for (int which = 0; which < 2; ++which) {
          ReadRows(r, l, h, which, slot, count, rows.data());
          const float* src = rows.data();
          if (codec_ != nullptr) {  // stored rotated: x = x_rot · R^T
            kernels::RotateRows(rows.data(), count, d, which == 0 ? codec_->RKT(l) : codec_->RVT(l),
                                plain.data());
            src = plain.data();
          }
          uint16_t* out = which == 0 ? k_out : v_out;
          for (int32_t t = 0; t < count; ++t) {
            kernels::FloatToBf16N(src + t * d,
                                  out + ((int64_t{l} * n + (t0 - first + t)) * hkv + h) * d, d);
          }
        }
      }
      t0 += count;
    }
  }
  return absl::OkStatus();
}

absl::Status ModelCache::FetchStored(Sequence* seq, int64_t first, int64_t n,
                                     std::vector<StoredPageCopy>* pages) {
  const int32_t ps = spec_.page_size;
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  KVCD_RETURN_IF_ERROR(CheckReadable(*seq, first, n));
  const int64_t len = seq->length();
  for (int64_t p = first / ps; p * ps < first + n; ++p) {
    const PageRef& r = seq->pages[static_cast<size_t>(p)];
    const PagePool& pool = *pools_[r.pool];
    StoredPageCopy c;
    c.format = pool.format();
    c.first_token = p * ps;
    c.num_tokens = static_cast<int32_t>(std::min<int64_t>(ps, len - p * ps));
    c.data.resize(static_cast<size_t>(pool.page_bytes()));
    for (int32_t l = 0; l < spec_.num_layers; ++l) {
      backend_->CopyFromPool(c.data.data() + l * pool.layer_page_bytes(), pool.PagePtr(l, r.page),
                             static_cast<size_t>(pool.layer_page_bytes()));
    }
    pages->push_back(std::move(c));
  }
  return absl::OkStatus();
}

absl::Status ModelCache::FetchStoredToDevice(Sequence* seq, int64_t first, int64_t n, uint8_t* dst,
                                             int64_t dst_bytes,
                                             std::vector<StoredPageCopy>* pages) {
  const int32_t ps = spec_.page_size;
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  KVCD_RETURN_IF_ERROR(CheckReadable(*seq, first, n));
  const int64_t len = seq->length();
  std::vector<DeviceSpan> spans;
  int64_t at = 0;
  for (int64_t p = first / ps; p * ps < first + n; ++p) {
    const PageRef& r = seq->pages[static_cast<size_t>(p)];
    const PagePool& pool = *pools_[r.pool];
    StoredPageCopy c;
    c.format = pool.format();
    c.first_token = p * ps;
    c.num_tokens = static_cast<int32_t>(std::min<int64_t>(ps, len - p * ps));
    if (at + pool.page_bytes() > dst_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "destination has ", dst_bytes, " bytes, too few for the pages from token ", first,
          " (page ", p, " alone ends at byte ", at + pool.page_bytes(), ")"));
    }
    for (int32_t l = 0; l < spec_.num_layers; ++l) {
      DeviceSpan sp;
      sp.src = pool.PagePtr(l, r.page);
      sp.dst = dst + at + l * pool.layer_page_bytes();
      sp.bytes = static_cast<uint64_t>(pool.layer_page_bytes());
      spans.push_back(sp);
    }
    at += pool.page_bytes();
    pages->push_back(std::move(c));
  }
  return backend_->CopySpans(spans, nullptr);
}

int64_t ModelCache::Length(Sequence* seq) {
  std::lock_guard<std::mutex> seq_lock(seq->mu);
  return seq->length();
}

ModelSnapshot ModelCache::Snapshot() const {
  ModelSnapshot s;
  const double bf16_token = 2.0 * 2 * spec_.num_layers * spec_.num_kv_heads * spec_.head_dim;
  double dense = 0, used = 0;
  for (const auto& p : pools_) {
    s.pools.push_back(PoolSnapshot{p->format(), p->page_bytes(), p->num_pages(), p->used_pages()});
    dense += bf16_token * spec_.page_size * p->used_pages();
    used += static_cast<double>(p->page_bytes()) * p->used_pages();
  }
  s.bf16_bytes_per_token = bf16_token;
  s.history_bytes_per_token = static_cast<double>(pools_.back()->page_bytes()) / spec_.page_size;
  s.history_bits_per_element =
      codec_ ? 2.0 + 32.0 / spec_.head_dim : 16.0;  // codes + FP16 scale and minimum per row
  s.compression_ratio = used > 0 ? dense / used : 1.0;
  s.demoted_pages = demoted_pages_.load();
  std::lock_guard<std::mutex> lock(mu_);
  s.cached_tokens = tree_.cached_pages() * spec_.page_size;
  s.pinned_pages = tree_.PinnedPages();
  s.active_sequences = open_sequences_.load();
  s.codec = codec_ ? codec_->description() : HistoryFormatName(spec_.history_format);
  return s;
}

}  // namespace kvcd
