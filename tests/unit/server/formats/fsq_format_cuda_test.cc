// The host-side checks of the CUDA FSQ formats (no GPU needed): which FSQ models the CUDA
// kernels serve, and the clear refusal of the others before any device memory is touched;
// which device encoder KVCD_FSQ_ENCODER selects.
#include "server/formats/fsq/fsq_format_cuda.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "server/formats/fsq/fsq_device_codec.h"

namespace kvcd {
namespace fsq_format_cuda_test {

FsqModelCodec Codec(const PageGeometry& g, int rotary_dims, int latent = 9,
                    kernels::RopePairing pairing = kernels::RopePairing::kInterleaved) {
  FsqCodecShape s;
  s.num_layers = g.num_layers;
  s.residual_width = 32;
  s.latent_width = latent;
  s.num_kv_heads = g.num_kv_heads;
  s.head_dim = g.head_dim;
  FsqModelCodec m;
  m.codec = FsqCodec::Synthetic(s, 3);
  m.rope.rotary_dims = rotary_dims;
  m.rope.pairing = pairing;
  return m;
}

void ExpectRefused(const absl::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(needle), std::string::npos) << s;
}

TEST(FsqCudaFormatTest, ServedGeometries) {
  for (int d : {64, 128, 256}) {
    for (int ps : {16, 64}) {
      const PageGeometry g{2, 2, d, ps};
      EXPECT_TRUE(CheckFsqCudaGeometry(g, Codec(g, d)).ok()) << d << " " << ps;
      EXPECT_TRUE(CheckFsqCudaGeometry(g, Codec(g, 0)).ok()) << "no RoPE";
    }
  }
}

TEST(FsqCudaFormatTest, RefusesWhatTheKernelsCannotRun) {
  const PageGeometry tiny{2, 2, 16, 16};
  ExpectRefused(CheckFsqCudaGeometry(tiny, Codec(tiny, 16)),
                "head_dim is 16, expected 64, 128 or 256");
  const PageGeometry page8{2, 2, 128, 8};
  ExpectRefused(CheckFsqCudaGeometry(page8, Codec(page8, 128)),
                "page_size is 8, expected a multiple of 16");
  const PageGeometry ok{2, 2, 128, 64};
  ExpectRefused(CheckFsqCudaGeometry(ok, Codec(ok, 33)), "rotary_dims is 33, expected an even");
  ExpectRefused(CheckFsqCudaGeometry(ok, Codec(ok, 130)), "rotary_dims is 130");
  EXPECT_TRUE(CheckFsqCudaGeometry(ok, Codec(ok, 40)).ok());  // interleaved: any even count
  ExpectRefused(CheckFsqCudaGeometry(ok, Codec(ok, 40, 9, kernels::RopePairing::kHalf)),
                "expected a multiple of 16 with the half pairing");
  EXPECT_TRUE(CheckFsqCudaGeometry(ok, Codec(ok, 64, 9, kernels::RopePairing::kHalf)).ok());
  EXPECT_TRUE(CheckFsqCudaGeometry(ok, Codec(ok, 64, 256)).ok());
  ExpectRefused(CheckFsqCudaGeometry(ok, Codec(ok, 64, 257)),
                "fsq_latent_width is 257, expected at most 256");
}

TEST(FsqCudaFormatTest, RefusesACodecOfAnotherShape) {
  const PageGeometry g{2, 2, 128, 64};
  const PageGeometry other{3, 2, 128, 64};
  ExpectRefused(CheckFsqCudaGeometry(g, Codec(other, 128)),
                "the FSQ codec is for 3 layers x 2 KV heads x 128, expected the profile's 2 x 2 "
                "x 128");
  const PageGeometry heads{2, 4, 128, 64};
  ExpectRefused(CheckFsqCudaGeometry(g, Codec(heads, 128)), "4 KV heads");
}

// KVCD_FSQ_ENCODER: the FP16 tensor-core encoder unless another is asked for by name
// ("exact": the float64 one); an unknown value falls back to the default (with a warning).
TEST(FsqCudaFormatTest, EncoderFromTheEnvironment) {
  const char* before = std::getenv("KVCD_FSQ_ENCODER");
  const std::string saved = before != nullptr ? before : "";
  unsetenv("KVCD_FSQ_ENCODER");
  EXPECT_EQ(FsqDeviceEncoderFromEnv(), FsqDeviceEncoder::kTcFp16);
  const std::pair<const char*, FsqDeviceEncoder> cases[] = {
      {"exact", FsqDeviceEncoder::kExact},    {"tc", FsqDeviceEncoder::kTcBf16},
      {"tc-fp16", FsqDeviceEncoder::kTcFp16}, {"tc-split", FsqDeviceEncoder::kTcSplit},
      {"TC", FsqDeviceEncoder::kTcFp16},      {"tc-int8", FsqDeviceEncoder::kTcFp16},
      {"", FsqDeviceEncoder::kTcFp16}};
  for (const auto& [value, want] : cases) {
    setenv("KVCD_FSQ_ENCODER", value, 1);
    EXPECT_EQ(FsqDeviceEncoderFromEnv(), want) << "KVCD_FSQ_ENCODER=" << value;
  }
  if (before != nullptr) {
    setenv("KVCD_FSQ_ENCODER", saved.c_str(), 1);
  } else {
    unsetenv("KVCD_FSQ_ENCODER");
  }
}

}  // namespace fsq_format_cuda_test
}  // namespace kvcd
