// The fault-word protocol of pipelined device calls (kernels/device_fault.h,
// server/backends/device_fault_words.h) on the host: what a kernel stores, what the owner
// reads, and that a word reused by a later owner ignores the earlier owner's late writes.
#include "server/backends/device_fault_words.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>

namespace kvcd {
namespace device_fault_words_test {

using kernels::FaultInputOf;
using kernels::FaultLayerOf;
using kernels::FaultMatches;
using kernels::FaultTag;

// What a kernel stores for `input` (the device code's expression).
uint64_t KernelWord(const kernels::DeviceFault& f, kernels::FaultInput input) {
  return f.tag | (static_cast<uint64_t>(input) << kernels::kFaultInputShift);
}

TEST(DeviceFaultWordsTest, OwnerReadsWhatItsKernelsStored) {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 1000; ++i) {
    uint64_t host = 0, device = 0;
    DeviceFaultWords w;
    w.host = &host;
    w.target.host_word = reinterpret_cast<unsigned long long*>(&host);
    w.target.device_word = reinterpret_cast<unsigned long long*>(&device);
    const uint64_t owner = 1 + rng() % ((uint64_t{1} << 48) - 1);
    w.target.tag = FaultTag(owner, 0);
    EXPECT_EQ(w.Read(), 0u);  // clean
    const int64_t layer = static_cast<int64_t>(rng() % 16384);
    const auto input = static_cast<kernels::FaultInput>(1 + rng() % 3);
    const kernels::DeviceFault at = w.AtLayer(layer);
    EXPECT_TRUE(FaultMatches(FaultTag(owner, layer), w.target.tag));
    host = KernelWord(at, input);
    const uint64_t got = w.Read();
    ASSERT_NE(got, 0u);
    EXPECT_EQ(FaultInputOf(got), input);
    EXPECT_EQ(FaultLayerOf(got), layer);
    // The pair goes to a later owner: the earlier owner's word (a late kernel write) does
    // not count for it, its own does.
    DeviceFaultWords next = w;
    next.target.tag = FaultTag(owner + 1 + rng() % 1000, 0);
    EXPECT_EQ(next.Read(), 0u);
    host = KernelWord(next.AtLayer(3), kernels::kFaultQuery);
    EXPECT_EQ(FaultInputOf(next.Read()), kernels::kFaultQuery);
    EXPECT_EQ(w.Read(), 0u);
  }
}

TEST(DeviceFaultWordsTest, LayersBeyondTheFieldAreClampedNotSpilledIntoTheOwner) {
  const uint64_t tag = FaultTag(5, int64_t{1} << 20);
  EXPECT_EQ(FaultLayerOf(tag), static_cast<int64_t>(kernels::kFaultLayerMask));
  EXPECT_EQ(tag >> kernels::kFaultOwnerShift, 5u);
  EXPECT_EQ(FaultLayerOf(FaultTag(5, -3)), 0);
  DeviceFaultWords none;  // no pair held: always clean, targets carry tag 0
  EXPECT_FALSE(none.held());
  EXPECT_EQ(none.Read(), 0u);
  EXPECT_EQ(none.AtLayer(7).tag, 0u);
}

}  // namespace device_fault_words_test
}  // namespace kvcd
