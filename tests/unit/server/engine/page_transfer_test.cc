// CacheEngine's pages moved whole (server/engine/page_transfer.cc): pages fetched as
// stored push into another tenant and attend bit for bit as their source.
#include <gtest/gtest.h>

#include <string>

#include "server/engine/cache_engine.h"
#include "test_util.h"

namespace kvcd {
namespace page_transfer_test {

using testing_util::MakePut;
using testing_util::Profile;

// Pages fetched as stored from one tenant's sequence and pushed as stored for another give
// the same attention: INT2 pages travel without re-encoding.
TEST(PushPagesTest, StoredPagesRoundTripIntoAnotherTenant) {
  CacheEngine engine(testing_util::TestConfig(), MakeCpuBackend(2));
  const ModelSpec spec = testing_util::TinyInt2Spec();
  ASSERT_TRUE(engine.RegisterModelSpec(spec).ok());
  const auto p = Profile(spec);
  v1::PutResponse put;
  ASSERT_TRUE(engine.Put(MakePut(spec, 3, 24), &put).ok());
  const auto tokens = synthetic::Tokens(3, 0, 24);
  auto open = [&](const std::string& salt) {
    v1::OpenSequenceRequest o;
    o.set_model(spec.name);
    o.set_cache_salt(salt);
    o.mutable_tokens()->Add(tokens.begin(), tokens.end());
    v1::OpenSequenceResponse r;
    EXPECT_TRUE(engine.OpenSequence(o, &r).ok());
    return r;
  };
  const auto a = open("");
  ASSERT_EQ(a.matched_tokens(), 24);
  v1::FetchPagesRequest f;
  f.set_sequence_id(a.sequence_id());
  v1::FetchPagesResponse stored;
  ASSERT_TRUE(engine.FetchPages(f, &stored).ok());
  ASSERT_EQ(stored.pages_size(), 6);
  // Push in two chunks: pages 0..1, then 2..5 (first_page = 2).
  v1::PushPagesRequest push;
  push.set_model(spec.name);
  push.set_cache_salt("other");
  push.mutable_tokens()->Add(tokens.begin(), tokens.begin() + 8);
  for (int i = 0; i < 2; ++i) *push.add_inline_pages() = stored.pages(i);
  v1::PushPagesResponse pr;
  ASSERT_TRUE(engine.PushPages(push, &pr).ok());
  EXPECT_EQ(pr.inserted_tokens(), 8);
  push.clear_inline_pages();
  push.clear_tokens();
  push.mutable_tokens()->Add(tokens.begin(), tokens.end());
  push.set_first_page(2);
  for (int i = 2; i < 6; ++i) *push.add_inline_pages() = stored.pages(i);
  ASSERT_TRUE(engine.PushPages(push, &pr).ok()) << engine.PushPages(push, &pr);
  const auto b = open("other");
  ASSERT_EQ(b.matched_tokens(), 24);
  v1::AttentionDecodeRequest req;
  req.set_layer(1);
  req.add_sequence_ids(a.sequence_id());
  const auto q = synthetic::Row(3, p, 1, 24, 2);
  SetF32Tensor(req.mutable_q(), {1, 4, 16}, q.data());
  v1::AttentionDecodeResponse ra, rb;
  ASSERT_TRUE(engine.AttentionDecode(req, &ra).ok());
  req.set_sequence_ids(0, b.sequence_id());
  ASSERT_TRUE(engine.AttentionDecode(req, &rb).ok());
  EXPECT_EQ(ra.o().inline_data(), rb.o().inline_data());  // bit-identical
  EXPECT_EQ(ra.lse().inline_data(), rb.lse().inline_data());
}

}  // namespace page_transfer_test
}  // namespace kvcd
