#include "client/cluster/attention_across.h"

#include <cmath>
#include <cstring>
#include <future>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvcd/kernels/attention_state.h"

namespace kvcd::cluster {
namespace {

absl::StatusOr<std::vector<float>> Floats(const v1::TensorRef& t, const char* what) {
  if (t.dtype() != v1::DTYPE_F32 || t.payload_case() != v1::TensorRef::kInlineData) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     ": expected inline F32 data (attention outputs written to device "
                     "regions cannot be merged here)"));
  }
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  if (n < 0 || static_cast<size_t>(n) * sizeof(float) != t.inline_data().size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shape [", absl::StrJoin(t.shape(), ", "), "] does not match ",
                     t.inline_data().size(), " bytes"));
  }
  std::vector<float> out(static_cast<size_t>(n));
  std::memcpy(out.data(), t.inline_data().data(), t.inline_data().size());
  return out;
}

}  // namespace

absl::StatusOr<MergedAttention> MergeAttention(const v1::AttentionDecodeResponse& a,
                                               const v1::AttentionDecodeResponse& b) {
  const auto& sa = a.o().shape();
  const auto& sb = b.o().shape();
  if (sa.size() != 3 || !std::equal(sa.begin(), sa.end(), sb.begin(), sb.end()) ||
      a.lse().shape_size() != 2 || a.lse().shape(0) != sa[0] || a.lse().shape(1) != sa[1] ||
      !std::equal(a.lse().shape().begin(), a.lse().shape().end(), b.lse().shape().begin(),
                  b.lse().shape().end())) {
    return absl::InvalidArgumentError(
        absl::StrCat("the two answers do not merge: o [", absl::StrJoin(sa, ", "), "] and [",
                     absl::StrJoin(sb, ", "), "], lse [", absl::StrJoin(a.lse().shape(), ", "),
                     "] and [", absl::StrJoin(b.lse().shape(), ", "),
                     "]; expected o [B, heads, head_dim] and lse "
                     "[B, heads] alike on both"));
  }
  absl::StatusOr<std::vector<float>> oa = Floats(a.o(), "o of the first answer");
  if (!oa.ok()) return oa.status();
  absl::StatusOr<std::vector<float>> ob = Floats(b.o(), "o of the second answer");
  if (!ob.ok()) return ob.status();
  absl::StatusOr<std::vector<float>> la = Floats(a.lse(), "lse of the first answer");
  if (!la.ok()) return la.status();
  absl::StatusOr<std::vector<float>> lb = Floats(b.lse(), "lse of the second answer");
  if (!lb.ok()) return lb.status();
  for (const std::vector<float>* l : {&*la, &*lb}) {
    for (float x : *l) {
      if (std::isnan(x) || (std::isinf(x) && x > 0)) {
        return absl::InvalidArgumentError("an LSE is NaN or +inf: that part is not valid");
      }
    }
  }
  const int rows = static_cast<int>(sa[0] * sa[1]);
  const int head_dim = static_cast<int>(sa[2]);
  kernels::MergeStates(rows, head_dim, oa->data(), la->data(), ob->data(), lb->data());
  return MergedAttention{std::move(*oa), std::move(*la), {sa.begin(), sa.end()}};
}

absl::StatusOr<MergedAttention> AttendAcross(Client& a, const v1::AttentionDecodeRequest& req_a,
                                             Client& b, const v1::AttentionDecodeRequest& req_b) {
  auto fa = std::async(std::launch::async, [&] { return a.AttentionDecode(req_a); });
  absl::StatusOr<v1::AttentionDecodeResponse> rb = b.AttentionDecode(req_b);
  absl::StatusOr<v1::AttentionDecodeResponse> ra = fa.get();
  if (!ra.ok()) return ra.status();
  if (!rb.ok()) return rb.status();
  return MergeAttention(*ra, *rb);
}

}  // namespace kvcd::cluster
