// What the daemon tests of a format on the CUDA backend against the same model on the CPU
// backend share (fsq_data_plane_test.cc, transform_data_plane_test.cc): the two daemons'
// configuration, connecting a client, uploads into a worker's device buffer, and a
// sequence's stored pages for byte comparisons. Header-only, test code.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/tensor_ref.h"
#include "daemon_process.h"

namespace kvcd::testing_util {

inline int CudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// A daemon on loopback with `backend` (cuda or cpu), 512 MiB, short drain.
inline std::string BackendConfig(const std::string& backend) {
  return "listen: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\nbackend: " + backend +
         "\nmemory_budget: 512MiB\nlease: {default_ms: 60000, max_ms: 120000}\n"
         "drain_timeout_ms: 300\n";
}

inline std::unique_ptr<Client> ConnectTo(const DaemonProcess& d) {
  ClientOptions o;
  o.target = d.grpc();
  auto c = Client::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

template <typename T>
void ToDevice(uint8_t* dst, const T* src, size_t bytes) {
  ASSERT_EQ(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

inline uint64_t OpenOn(Client* c, const std::string& model, const std::vector<int32_t>& tokens,
                       const std::string& salt) {
  auto o = c->OpenSequence(model, salt, tokens, 60000);
  EXPECT_TRUE(o.ok()) << o.status();
  return o.ok() ? o->sequence_id() : 0;
}

// A sequence's full pages as stored (formats and bytes), inline. (The slots of a partial
// last page past the sequence's length hold whatever the page held before: a page freed
// by a demotion is reused, on each daemon in its own order.)
inline std::string StoredPages(Client* c, uint64_t seq, int32_t page_size) {
  v1::FetchPagesRequest f;
  f.set_sequence_id(seq);
  auto r = c->FetchPages(f);
  EXPECT_TRUE(r.ok()) << r.status();
  std::string all;
  if (!r.ok()) return all;
  for (const auto& pg : r->pages()) {
    if (pg.num_tokens() == page_size) all += pg.format() + ":" + pg.data();
  }
  return all;
}

// The CUDA backend's answer against the CPU backend's, query head by query head (hq heads of
// d values): every o finite, the largest |o_cuda - o_cpu| relative to max(1, the head's
// largest |o_cpu|) and |lse_cuda - lse_cpu| at most `bound`; *worst_o and *worst_lse keep the
// largest seen. Fatal failures name `where` and the head (callers: ASSERT_NO_FATAL_FAILURE).
inline void ExpectCloseToCpu(const v1::AttentionDecodeResponse& cu,
                             const v1::AttentionDecodeResponse& cpu, int hq, int d, double bound,
                             const std::string& where, double* worst_o, double* worst_lse) {
  for (int h = 0; h < hq; ++h) {
    double row_max = 1.0, err = 0;
    for (int i = h * d; i < (h + 1) * d; ++i)
      row_max = std::max(row_max, std::fabs(double{ElementAsFloat(cpu.o(), i)}));
    for (int i = h * d; i < (h + 1) * d; ++i) {
      const float got = ElementAsFloat(cu.o(), i);
      ASSERT_TRUE(std::isfinite(got)) << where << " i " << i;
      err = std::max(err, std::fabs(got - double{ElementAsFloat(cpu.o(), i)}));
    }
    const double lse_err =
        std::fabs(double{ElementAsFloat(cu.lse(), h)} - ElementAsFloat(cpu.lse(), h));
    *worst_o = std::max(*worst_o, err / row_max);
    *worst_lse = std::max(*worst_lse, lse_err);
    ASSERT_LE(err / row_max, bound) << where << " head " << h;
    ASSERT_LE(lse_err, bound) << where << " head " << h;
  }
}

}  // namespace kvcd::testing_util
