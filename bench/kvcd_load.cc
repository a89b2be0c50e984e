// kvcd_load: loopback load generator for a running kvcd (db_bench-style named
// workloads). For each workload and client count it runs N client threads, each with
// its own channel, for a fixed time, and reports throughput and latency percentiles.
//
//   put     Put of a fresh --put-tokens prompt (new pages; eviction churn when full)
//   match   Match of a cached --context-tokens prompt
//   attend  AttentionDecode (unary, batch 1) over an open --context-tokens sequence,
//           layers in turn
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/decode_channel.h"
#include "common/cli.h"
#include "proto/tensor_ref.h"
#include "testing/synthetic.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "daemon address HOST:PORT");
ABSL_FLAG(std::string, model, "qwen3-8b", "model of the workloads");
ABSL_FLAG(std::string, results, "", "also write the table to this Markdown file");
ABSL_FLAG(std::string, benchmarks, "put,match,attend",
          "workloads, comma-separated: put, match, attend, stream, channel");
ABSL_FLAG(std::string, clients, "1,8,64", "client thread counts, comma-separated");
ABSL_FLAG(double, seconds, 3, "seconds per workload and client count");
ABSL_FLAG(int64_t, put_tokens, 64, "tokens of each put prompt");
ABSL_FLAG(int64_t, context_tokens, 4096, "tokens of the shared match / attend context");

namespace {

struct Options {
  std::string target = "127.0.0.1:50051", model = "qwen3-8b", results;
  std::vector<std::string> benchmarks = {"put", "match", "attend"};
  std::vector<int> clients = {1, 8, 64};
  double seconds = 3;
  int64_t put_tokens = 64, context_tokens = 4096;
};

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd_load",
      .summary = "loopback load generator for kvcd",
      .files = {__FILE__},
      .synopsis =
          R"(--target HOST:PORT [--model NAME] [--benchmarks put,match,attend,stream,channel]
    [--clients 1,8,64] [--seconds S] [--put-tokens N] [--context-tokens N] [--results FILE.md])"};
  return program;
}

struct Result {
  std::string name;
  int clients = 0;
  int64_t ops = 0, errors = 0;
  double seconds = 0, p50 = 0, p90 = 0, p99 = 0, max = 0, mean_us = 0, kernel_us = 0;
  std::string first_error;
};

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<long>(i), v.end());
  return v[i];
}

// Put of tokens [0, end) carrying K/V only for [begin, end) (kv_first_token = begin).
kvcd::v1::PutRequest MakePut(const kvcd::v1::ModelProfile& p, uint64_t seed, int64_t end,
                             int64_t begin = 0) {
  kvcd::v1::PutRequest req;
  req.set_model(p.name());
  req.set_kv_first_token(begin);
  const auto t = kvcd::synthetic::Tokens(seed, 0, end);
  req.mutable_tokens()->Add(t.begin(), t.end());
  const int64_t n = end - begin;
  const std::vector<int64_t> shape = {p.num_layers(), n, p.num_kv_heads(), p.head_dim()};
  kvcd::SetBf16FromFloat(req.mutable_k(), shape, kvcd::synthetic::Kv(seed, p, begin, n, 0).data());
  kvcd::SetBf16FromFloat(req.mutable_v(), shape, kvcd::synthetic::Kv(seed, p, begin, n, 1).data());
  return req;
}

}  // namespace

int main(int argc, char** argv) {
  kvcd::cli::Parse(Cli(), argc, argv);
  Options o;
  o.target = absl::GetFlag(FLAGS_target);
  o.model = absl::GetFlag(FLAGS_model);
  o.results = absl::GetFlag(FLAGS_results);
  o.benchmarks = absl::StrSplit(absl::GetFlag(FLAGS_benchmarks), ',', absl::SkipEmpty());
  o.clients.clear();
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_clients), ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(c, &n) || n <= 0) {
      return kvcd::cli::UsageError(Cli(), nullptr,
                                   "bad value for --clients: " + absl::GetFlag(FLAGS_clients));
    }
    o.clients.push_back(n);
  }
  o.seconds = absl::GetFlag(FLAGS_seconds);
  o.put_tokens = absl::GetFlag(FLAGS_put_tokens);
  o.context_tokens = absl::GetFlag(FLAGS_context_tokens);
  if (!(o.seconds > 0)) return kvcd::cli::UsageError(Cli(), nullptr, "--seconds must be > 0");
  if (o.put_tokens <= 0) return kvcd::cli::UsageError(Cli(), nullptr, "--put-tokens must be > 0");
  if (o.context_tokens <= 0) {
    return kvcd::cli::UsageError(Cli(), nullptr, "--context-tokens must be > 0");
  }
  kvcd::ClientOptions co;
  co.target = o.target;
  co.deadline = std::chrono::milliseconds(60000);
  auto admin = kvcd::Client::Connect(co);
  if (!admin.ok()) {
    std::fprintf(stderr, "kvcd_load: %s\n", std::string(admin.status().message()).c_str());
    return 1;
  }
  auto model = (*admin)->GetModel(o.model);
  if (!model.ok()) {
    std::fprintf(stderr, "kvcd_load: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const kvcd::v1::ModelProfile p = model->profile();
  // The shared context for match/attend.
  const uint64_t kContextSeed = 424242;
  // Uploaded in chunks of 1024 tokens (kv_first_token), under the message size limit;
  // re-put before every run because the put workload may have evicted it.
  auto put_context = [&]() -> bool {
    for (int64_t begin = 0; begin < o.context_tokens; begin += 1024) {
      auto put =
          (*admin)->Put(MakePut(p, kContextSeed, std::min(o.context_tokens, begin + 1024), begin));
      if (!put.ok()) {
        std::fprintf(stderr, "kvcd_load: context Put: %s\n",
                     std::string(put.status().message()).c_str());
        return false;
      }
    }
    return true;
  };
  const auto context = kvcd::synthetic::Tokens(kContextSeed, 0, o.context_tokens);
  // Prebuilt Put requests (the synthesis is not what we measure).
  std::vector<kvcd::v1::PutRequest> puts;
  for (int i = 0; i < 64; ++i) puts.push_back(MakePut(p, 1000 + i, o.put_tokens));
  std::atomic<uint64_t> put_seed{100000};

  std::vector<Result> results;
  for (const std::string& bench : o.benchmarks) {
    if (bench != "put" && bench != "match" && bench != "attend" && bench != "stream" &&
        bench != "channel") {
      std::fprintf(stderr, "kvcd_load: unknown benchmark '%s'\n", bench.c_str());
      return 2;
    }
    for (int nc : o.clients) {
      if (!put_context()) return 1;
      std::vector<std::vector<double>> lat(nc);
      std::vector<int64_t> errors(nc, 0);
      std::vector<double> kernel(nc, 0.0);  // attend: time inside the kernels (daemon-side)
      std::vector<std::string> first_error(nc);
      std::atomic<bool> go{false};
      std::atomic<int> ready{0};
      std::vector<std::thread> threads;
      for (int c = 0; c < nc; ++c) {
        threads.emplace_back([&, c] {
          auto client = kvcd::Client::Connect(co);
          uint64_t seq = 0;
          kvcd::v1::AttentionDecodeRequest dec;
          const bool decode = bench == "attend" || bench == "stream" || bench == "channel";
          std::unique_ptr<kvcd::DecodeStream> stream;
          std::unique_ptr<kvcd::DecodeChannel> channel;
          if (client.ok() && bench == "stream") {
            auto st = (*client)->OpenDecodeStream();
            if (st.ok()) stream = std::move(*st);
          }
          if (client.ok() && bench == "channel") {
            auto ch = kvcd::DecodeChannel::Open(client->get());
            if (!ch.ok()) {
              std::fprintf(stderr, "kvcd_load: %s\n", ch.status().ToString().c_str());
              std::exit(1);
            }
            channel = std::move(*ch);
          }
          if (client.ok() && decode) {
            auto open = (*client)->OpenSequence(p.name(), "", context, 600000);
            if (open.ok() && open->matched_tokens() != o.context_tokens) {
              std::fprintf(stderr, "kvcd_load: only %lld of %lld context tokens cached\n",
                           static_cast<long long>(open->matched_tokens()),
                           static_cast<long long>(o.context_tokens));
              std::exit(1);
            }
            if (open.ok()) {
              seq = open->sequence_id();
              dec.add_sequence_ids(seq);
              kvcd::SetF32Tensor(dec.mutable_q(), {1, p.num_q_heads(), p.head_dim()},
                                 kvcd::synthetic::Row(c, p, 0, 0, 2).data());
            }
          }
          ready.fetch_add(1);
          while (!go.load()) std::this_thread::yield();
          if (!client.ok()) {
            ++errors[c];
            return;
          }
          const auto end =
              std::chrono::steady_clock::now() + std::chrono::duration<double>(o.seconds);
          int64_t i = 0;
          while (std::chrono::steady_clock::now() < end) {
            const auto t0 = std::chrono::steady_clock::now();
            absl::Status s;
            if (bench == "put") {
              kvcd::v1::PutRequest req = puts[static_cast<size_t>(i % 64)];
              // A fresh first token makes every prompt (and its pages) new.
              req.set_tokens(0, static_cast<int32_t>(put_seed.fetch_add(1)));
              s = (*client)->Put(req).status();
            } else if (bench == "match") {
              s = (*client)->Match(p.name(), "", context).status();
            } else {
              dec.set_layer(static_cast<int32_t>(i % p.num_layers()));
              auto r = channel  ? channel->Call(dec)
                       : stream ? stream->Call(dec)
                                : (*client)->AttentionDecode(dec);
              s = r.status();
              if (r.ok()) kernel[c] += r->kernel_seconds();
            }
            lat[c].push_back(
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            if (!s.ok()) {
              if (errors[c]++ == 0) first_error[c] = std::string(s.message());
            }
            ++i;
          }
          if (seq != 0) (void)(*client)->CloseSequence(seq);
        });
      }
      while (ready.load() < nc) std::this_thread::yield();
      const auto t0 = std::chrono::steady_clock::now();
      go.store(true);
      for (auto& t : threads) t.join();
      Result r;
      r.name = bench;
      r.clients = nc;
      r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::vector<double> all;
      for (int c = 0; c < nc; ++c) {
        all.insert(all.end(), lat[c].begin(), lat[c].end());
        r.errors += errors[c];
        if (r.first_error.empty()) r.first_error = first_error[c];
      }
      r.ops = static_cast<int64_t>(all.size());
      r.p50 = Percentile(all, 0.50) * 1e6;
      r.p90 = Percentile(all, 0.90) * 1e6;
      r.p99 = Percentile(all, 0.99) * 1e6;
      r.max = all.empty() ? 0 : *std::max_element(all.begin(), all.end()) * 1e6;
      double ksum = 0, lsum = 0;
      for (int c = 0; c < nc; ++c) ksum += kernel[c];
      for (double x : all) lsum += x;
      r.kernel_us = all.empty() ? 0 : ksum / all.size() * 1e6;
      r.mean_us = all.empty() ? 0 : lsum / all.size() * 1e6;
      std::printf(
          "%-7s clients %3d: %9.1f ops/s  p50 %9.1f us  p90 %9.1f us  p99 %9.1f us  errors "
          "%lld%s%s\n",
          bench.c_str(), nc, r.ops / r.seconds, r.p50, r.p90, r.p99,
          static_cast<long long>(r.errors),
          r.first_error.empty() ? "" : " first: ", r.first_error.c_str());
      if (bench == "attend" || bench == "stream" || bench == "channel") {
        std::printf("        mean %.1f us per call: kernel %.1f us, RPC and the rest %.1f us\n",
                    r.mean_us, r.kernel_us, r.mean_us - r.kernel_us);
      }
      std::fflush(stdout);
      results.push_back(r);
    }
  }
  if (!o.results.empty()) {
    std::ofstream out(o.results, std::ios::app);
    out << "\n| workload | clients | ops/s | p50 µs | p90 µs | p99 µs | max µs | errors |\n"
        << "|---|---:|---:|---:|---:|---:|---:|---:|\n";
    char line[256];
    for (const auto& r : results) {
      std::snprintf(line, sizeof(line), "| %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %lld |\n",
                    r.name.c_str(), r.clients, r.ops / r.seconds, r.p50, r.p90, r.p99, r.max,
                    static_cast<long long>(r.errors));
      out << line;
    }
  }
  return 0;
}
