// What the int2-transform CUDA benchmarks share: the head codecs of a version-3 key-transform
// profile ([layer][kv head]) built into one device image, as the CUDA format does.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/key_transform_profile.h"
#include "cuda_bench.cuh"
#include "kvcd/kernels/cuda_transform.h"

struct TransformDeviceCodec {
  const kvcd::kernels::cuda::TransformHeadCodec* heads = nullptr;
  int code_bytes = 0;
  void* memory = nullptr;
  TransformDeviceCodec(const std::vector<kvcd::KeyTransformProfile::Head>& hs, int d) {
    std::vector<kvcd::kernels::cuda::TransformHeadSource> src;
    for (const auto& h : hs) {
      kvcd::kernels::cuda::TransformHeadSource s;
      s.key.d = d;
      s.key.encode = h.k_encode.data();
      s.key.decode = h.k_decode.data();
      s.key.mean = h.k_mean.data();
      s.key.sigma = h.k_sigma.data();
      s.key.bits = h.k_bits.data();
      int bits = 0;
      for (int b : h.k_bits) bits += b;
      s.key.code_bytes = code_bytes = bits / 8;
      s.r_v = h.r_v.data();
      s.rho_v = h.rho_v;
      src.push_back(s);
    }
    const int n = static_cast<int>(src.size());
    std::vector<uint8_t> image(kvcd::kernels::cuda::TransformCodecBytes(n, d));
    CHECK(cudaMalloc(&memory, image.size()));
    heads = kvcd::kernels::cuda::BuildTransformCodecImage(src.data(), n, memory, image.data());
    CHECK(cudaMemcpy(memory, image.data(), image.size(), cudaMemcpyHostToDevice));
  }
  ~TransformDeviceCodec() { cudaFree(memory); }
  TransformDeviceCodec(const TransformDeviceCodec&) = delete;
  TransformDeviceCodec& operator=(const TransformDeviceCodec&) = delete;
};
