// ModelCache's read paths (model_cache.h): a sequence's tokens as BF16 (Fetch) or its pages
// as stored (FetchStored, StoredBytes, FetchStoredToDevice), and its length. Reads hold
// only the sequence's lock: its pages are pinned or private, so eviction cannot free them.
#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kvcd/kernels/bf16.h"
#include "server/cache/model_cache.h"

namespace kvcd {

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

}  // namespace kvcd
