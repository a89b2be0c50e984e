// Part of CacheEngine (cache_engine.h): pages leaving and entering the cache whole:
// FetchPages (to the caller, expanded or as stored) and PushPages (from a peer or a worker,
// checked like Put's input).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checked_math.h"
#include "common/status_macros.h"
#include "proto/tensor_ref.h"
#include "server/backends/device_runtime.h"
#include "server/engine/cache_engine.h"
#include "server/engine/request_checks.h"
#include "server/engine/tensor_checks.h"

namespace kvcd {
namespace {

// The pages FetchPages returns as stored: each one's format, tokens and (inline, `with_data`)
// its bytes, moved out of `copies`.
void AddStoredPages(std::vector<ModelCache::StoredPageCopy>& copies, bool with_data,
                    v1::FetchPagesResponse* resp) {
  for (auto& c : copies) {
    resp->add_page_formats(c.format);
    v1::StoredPage* sp = resp->add_pages();
    sp->set_format(c.format);
    sp->set_first_token(c.first_token);
    sp->set_num_tokens(c.num_tokens);
    if (with_data) sp->set_data(std::move(c.data));
  }
}

// INVALID_ARGUMENT unless pages [first, first + n_pages) of `page_size` tokens lie within
// the request's tokens (overflow-safe).
absl::Status CheckPushedRange(const v1::PushPagesRequest& req, int64_t first, int64_t n_pages,
                              int64_t page_size) {
  const auto end_pages = CheckedAdd(first, n_pages);
  const auto end_tokens = end_pages ? CheckedMul(*end_pages, page_size) : std::nullopt;
  if (first < 0 || !end_tokens || *end_tokens > req.tokens_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_page ", first, " + ", n_pages, " pages of ", page_size, " tokens need ",
                     end_tokens ? *end_tokens : -1, " tokens, but tokens has ", req.tokens_size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CacheEngine::FetchPages(const v1::FetchPagesRequest& req, v1::FetchPagesResponse* resp,
                                     const FoundSequences& found) {
  KVCD_ASSIGN_OR_RETURN(auto seq, sequences_.Use(req.sequence_id(), found, 0));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));
  const ModelSpec& s = seq->model->spec();
  if (req.first_token() < 0 || req.first_token() % s.page_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("first_token is ", req.first_token(),
                                                   ", expected a non-negative multiple of "
                                                   "page_size (",
                                                   s.page_size, ")"));
  }
  if (req.num_tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens is ", req.num_tokens(), ", expected >= 0 (0 = to the end)"));
  }
  const int64_t len = seq->model->Length(seq.get());
  if (req.first_token() > len) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_token ", req.first_token(), " is past the sequence length ", len));
  }
  // first_token <= len here, so len - first_token cannot overflow; a num_tokens past the
  // end is refused before any arithmetic on it (first_token + num_tokens may not fit).
  if (req.num_tokens() > len - req.first_token()) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_token ", req.first_token(), " + num_tokens ", req.num_tokens(),
                     " is past the sequence length ", len,
                     "; expected num_tokens <= ", len - req.first_token()));
  }
  const int64_t n = req.num_tokens() == 0 ? len - req.first_token() : req.num_tokens();
  const int64_t limit = config_.max_message_bytes - (1 << 16);
  resp->set_first_token(req.first_token());
  resp->set_num_tokens(n);
  if (req.has_destination()) {
    if (req.expand_to_bf16()) {
      return absl::InvalidArgumentError(
          "destination is set with expand_to_bf16; device destinations receive pages as stored "
          "(expand_to_bf16 = false)");
    }
    // The bytes of the pages as this sequence holds them (a recent-window page is BF16 until
    // it is demoted, wherever it sits): the destination's size once its kind is accepted.
    int64_t total = 0;
    TensorSpec spec;
    spec.field = "destination";
    spec.dtypes = TensorSpec::DTypes::kU8;
    spec.kinds = TensorResolver::kIpc | TensorResolver::kNccl;
    // The worker may still read the region's older bytes: wait for its ready event.
    spec.access = TensorSpec::Access::kOverwrite;
    spec.shape_after_payload = [&]() -> absl::StatusOr<std::vector<int64_t>> {
      KVCD_ASSIGN_OR_RETURN(total, seq->model->StoredBytes(seq.get(), req.first_token(), n));
      if (total == 0) {
        return absl::InvalidArgumentError(
            "the range holds no page; nothing to send to destination");
      }
      return std::vector<int64_t>{total};
    };
    KVCD_ASSIGN_OR_RETURN(TensorResolver::Bytes dst, tensors_.Resolve(req.destination(), spec));
    std::vector<ModelCache::StoredPageCopy> copies;
    if (!dst.is_nccl) {
      KVCD_RETURN_IF_ERROR(seq->model->FetchStoredToDevice(seq.get(), req.first_token(), n,
                                                           dst.region.ptr, total, &copies));
      KVCD_RETURN_IF_ERROR(tensors_.MarkWritten(dst.region));
    } else {
      KVCD_RETURN_IF_ERROR(
          nccl_.Send(dst.nccl_communicator, static_cast<uint64_t>(total), [&](uint8_t* staging) {
            return seq->model->FetchStoredToDevice(seq.get(), req.first_token(), n, staging, total,
                                                   &copies);
          }));
    }
    AddStoredPages(copies, false, resp);
    *resp->mutable_k() = req.destination();
    return absl::OkStatus();
  }
  if (!req.expand_to_bf16()) {
    const int64_t pages = (n + s.page_size - 1) / s.page_size;
    const auto stored = CheckedMul(pages, seq->model->MaxPageBytes());
    if (!stored || *stored > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_tokens ", n, " covers pages larger than max_message_bytes (",
                       config_.max_message_bytes, "); fetch fewer tokens per call"));
    }
    std::vector<ModelCache::StoredPageCopy> copies;
    KVCD_RETURN_IF_ERROR(seq->model->FetchStored(seq.get(), req.first_token(), n, &copies));
    // The read waited for the device: a fault of a call still in flight before is known now.
    KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));
    AddStoredPages(copies, true, resp);
    return absl::OkStatus();
  }
  const auto bytes = CheckedProduct({2, 2, s.num_layers, n, s.num_kv_heads, s.head_dim});
  if (!bytes || *bytes > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_tokens ", n, " would need a response larger than max_message_bytes (",
        config_.max_message_bytes, "); fetch at most ",
        limit / (4LL * s.num_layers * s.num_kv_heads * s.head_dim), " tokens per call"));
  }
  const int64_t elems = *bytes / 4;
  std::vector<uint16_t> k(static_cast<size_t>(elems)), v(static_cast<size_t>(elems));
  std::vector<std::string> formats;
  KVCD_RETURN_IF_ERROR(
      seq->model->Fetch(seq.get(), req.first_token(), n, k.data(), v.data(), &formats));
  KVCD_RETURN_IF_ERROR(DeviceFaultStatus(*seq));  // as above
  const std::vector<int64_t> shape = {s.num_layers, n, s.num_kv_heads, s.head_dim};
  SetBf16Tensor(resp->mutable_k(), shape, k.data());
  SetBf16Tensor(resp->mutable_v(), shape, v.data());
  for (auto& f : formats) resp->add_page_formats(f);
  return absl::OkStatus();
}

absl::Status CacheEngine::PushPages(const v1::PushPagesRequest& req, v1::PushPagesResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(req.model()));
  KVCD_RETURN_IF_ERROR(CheckSalt(req.cache_salt()));
  KVCD_RETURN_IF_ERROR(CheckTokens(req.tokens(), "tokens", false));
  const int64_t ps = m->spec().page_size;
  if (req.has_pages()) return PushDevicePages(*m, req, resp);
  const int64_t n_pages = req.inline_pages_size();
  const int64_t first = req.first_page();
  if (n_pages < 1) return absl::InvalidArgumentError("inline_pages is empty, expected >= 1 page");
  KVCD_RETURN_IF_ERROR(CheckPushedRange(req, first, n_pages, ps));
  std::vector<ModelCache::StoredPageIn> pages;
  for (const auto& p : req.inline_pages()) pages.push_back({p.format(), p.data()});
  KVCD_ASSIGN_OR_RETURN(PutResult r, m->PushPages(req.cache_salt(), req.tokens(), first, pages));
  resp->set_inserted_tokens(r.inserted_tokens);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CacheEngine::PushedPagesBytes(const ModelCache& m,
                                                      const v1::PushPagesRequest& req) {
  const int64_t ps = m.spec().page_size;
  const int64_t n_pages = req.num_pages();
  const int64_t first = req.first_page();
  if (n_pages < 1 || n_pages > kMaxTokensPerCall) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages is ", n_pages, ", expected 1..", kMaxTokensPerCall,
                     " with pages (the count of pages in the device bytes)"));
  }
  KVCD_RETURN_IF_ERROR(CheckPushedRange(req, first, n_pages, ps));
  int64_t total = 0;
  for (int64_t i = 0; i < n_pages; ++i) total += m.StoredPageBytes(first + i);
  return total;
}

absl::Status CacheEngine::PushDevicePages(ModelCache& m, const v1::PushPagesRequest& req,
                                          v1::PushPagesResponse* resp) {
  if (req.inline_pages_size() != 0) {
    return absl::InvalidArgumentError(
        "both pages and inline_pages are set; send the pages one way");
  }
  const int64_t n_pages = req.num_pages();
  const int64_t first = req.first_page();
  // The pages' bytes as this model stores them: the tensor's size once its kind is accepted.
  int64_t total = 0;
  TensorSpec spec;
  spec.field = "pages";
  spec.dtypes = TensorSpec::DTypes::kU8;
  spec.kinds = TensorResolver::kIpc | TensorResolver::kNccl;
  spec.shape_after_payload = [&]() -> absl::StatusOr<std::vector<int64_t>> {
    KVCD_ASSIGN_OR_RETURN(total, PushedPagesBytes(m, req));
    return std::vector<int64_t>{total};
  };
  KVCD_ASSIGN_OR_RETURN(TensorResolver::Bytes src, tensors_.Resolve(req.pages(), spec));
  PutResult r;
  auto store = [&](const uint8_t* src) -> absl::Status {
    auto stored = m.PushDevicePages(req.cache_salt(), req.tokens(), first, n_pages, src);
    if (!stored.ok()) return stored.status();
    r = *stored;
    return absl::OkStatus();
  };
  if (!src.is_nccl) {
    KVCD_RETURN_IF_ERROR(store(src.region.ptr));
  } else {
    KVCD_RETURN_IF_ERROR(nccl_.Receive(src.nccl_communicator, static_cast<uint64_t>(total), store));
  }
  resp->set_inserted_tokens(r.inserted_tokens);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CacheEngine::StoredPagesBytes(const v1::PushPagesRequest& req) {
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(req.model()));
  return PushedPagesBytes(*m, req);
}

absl::Status CacheEngine::PushPagesFromDevice(const v1::PushPagesRequest& req,
                                              const uint8_t* device_pages, int64_t bytes,
                                              v1::PushPagesResponse* resp) {
  KVCD_ASSIGN_OR_RETURN(ModelCache * m, FindModel(req.model()));
  KVCD_RETURN_IF_ERROR(CheckSalt(req.cache_salt()));
  KVCD_RETURN_IF_ERROR(CheckTokens(req.tokens(), "tokens", false));
  KVCD_RETURN_IF_ERROR(RequireDevice(*backend_).status());
  if (req.has_pages() || req.inline_pages_size() != 0) {
    return absl::InvalidArgumentError(
        "pages already in device memory come without pages or inline_pages");
  }
  KVCD_ASSIGN_OR_RETURN(int64_t total, PushedPagesBytes(*m, req));
  if (bytes != total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the device pages hold ", bytes, " bytes, but ", req.num_pages(), " pages from page ",
        req.first_page(), " take ", total, " bytes as this model stores them"));
  }
  KVCD_ASSIGN_OR_RETURN(PutResult r,
                        m->PushDevicePages(req.cache_salt(), req.tokens(), req.first_page(),
                                           req.num_pages(), device_pages));
  resp->set_inserted_tokens(r.inserted_tokens);
  return absl::OkStatus();
}

}  // namespace kvcd
