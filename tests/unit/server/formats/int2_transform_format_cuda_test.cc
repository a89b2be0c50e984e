// The host-side checks of the CUDA int2-transform format (no GPU needed): which version-3
// models the CUDA kernels serve, and the clear refusal of the others before any device
// memory is touched.
#include "server/formats/int2_transform/int2_transform_format_cuda.h"

#include <gtest/gtest.h>

#include <string>

namespace kvcd {
namespace int2_transform_format_cuda_test {

KeyTransformProfile Profile(int layers, int heads, int d) {
  auto file = SafetensorsFile::Parse(
      KeyTransformProfile::ToSafetensors(KeyTransformProfile::SyntheticHeads(layers, heads, d, 3),
                                         layers, heads, d, "test")
          .Serialize());
  auto p = KeyTransformProfile::FromSafetensors(*file, layers, heads, d);
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(*p);
}

void ExpectRefused(const absl::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(needle), std::string::npos) << s;
}

TEST(Int2TransformCudaFormatTest, ServedGeometries) {
  for (int d : {64, 128, 256}) {
    for (int ps : {32, 64, 256}) {
      const PageGeometry g{2, 3, d, ps};
      EXPECT_TRUE(CheckTransformCudaGeometry(g, Profile(2, 3, d)).ok()) << d << " " << ps;
    }
  }
}

TEST(Int2TransformCudaFormatTest, RefusesWhatTheKernelsCannotRun) {
  const PageGeometry small{2, 3, 32, 32};
  ExpectRefused(CheckTransformCudaGeometry(small, Profile(2, 3, 32)),
                "head_dim is 32, expected 64, 128 or 256");
  for (int ps : {16, 48, 8}) {
    const PageGeometry g{2, 3, 64, ps};
    ExpectRefused(CheckTransformCudaGeometry(g, Profile(2, 3, 64)),
                  "page_size is " + std::to_string(ps) + ", expected a multiple of 32");
  }
  const PageGeometry g{2, 3, 64, 32};
  ExpectRefused(CheckTransformCudaGeometry(g, Profile(3, 3, 64)),
                "the codec file (version 3) is for 3 layers x 3 KV heads x 64");
  ExpectRefused(CheckTransformCudaGeometry(g, Profile(2, 2, 64)), "expected the profile's 2 x 3");
}

}  // namespace int2_transform_format_cuda_test
}  // namespace kvcd
