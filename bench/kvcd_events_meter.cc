// kvcd-events-meter: what the daemons' KV events cost on the wire (docs/cluster.md "Events"). A
// ZeroMQ subscriber of every given publisher counts, until SIGTERM or SIGINT (then it reads on
// until the publishers are quiet for --drain-ms), the messages, their frames' bytes with and
// without ZMTP 3 framing, and the events in the batches (msgpack, vLLM's KVEventBatch):
// blocks stored, blocks removed, clears. It prints "subscribed" on stdout once every connection's
// handshake is done, and the figures as JSON at the end.
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <msgpack.hpp>
#include <string>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, endpoints, "", "comma-separated tcp://HOST:PORT of the publishers");
ABSL_FLAG(int64_t, drain_ms, 1000, "after SIGTERM: stop once no message came for this long");
ABSL_FLAG(int64_t, subscribe_timeout_ms, 10000, "give up when the handshakes take longer");

namespace {

volatile std::sig_atomic_t stop_requested = 0;
void OnSignal(int) { stop_requested = 1; }

const kvcd::cli::Program& Cli() {
  static const kvcd::cli::Program program = {
      .name = "kvcd-events-meter",
      .summary = "counts the bytes and events of kvcd daemons' ZeroMQ KV events",
      .files = {__FILE__},
      .synopsis = "--endpoints tcp://HOST:PORT[,...] [--drain-ms MS]",
      .notes = R"(Prints "subscribed" once connected; stop it with SIGTERM to get the JSON figures
(bench/run-replay-cluster-failures.sh divides the bytes by the blocks stored).)"};
  return program;
}

// ZMTP 3.x: a flags byte, then the size in 1 byte (up to 255) or 8 bytes.
int64_t ZmtpBytes(size_t payload) {
  return static_cast<int64_t>(payload) + (payload > 255 ? 9 : 2);
}

}  // namespace

int main(int argc, char** argv) {
  kvcd::cli::Parse(Cli(), argc, argv);
  const std::vector<std::string> endpoints =
      absl::StrSplit(absl::GetFlag(FLAGS_endpoints), ',', absl::SkipEmpty());
  if (endpoints.empty()) return kvcd::cli::UsageError(Cli(), nullptr, "--endpoints is required");
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  zmq::context_t ctx(1);
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::subscribe, "");
  sub.set(zmq::sockopt::rcvtimeo, 100);
  if (zmq_socket_monitor(sub.handle(), "inproc://meter-monitor", ZMQ_EVENT_HANDSHAKE_SUCCEEDED) !=
      0) {
    std::fprintf(stderr, "kvcd-events-meter: cannot monitor the socket\n");
    return 1;
  }
  zmq::socket_t monitor(ctx, zmq::socket_type::pair);
  monitor.set(zmq::sockopt::rcvtimeo, static_cast<int>(absl::GetFlag(FLAGS_subscribe_timeout_ms)));
  monitor.connect("inproc://meter-monitor");
  for (const std::string& e : endpoints) sub.connect(e);
  for (size_t done = 0; done < endpoints.size(); ++done) {
    std::vector<zmq::message_t> event;
    if (!zmq::recv_multipart(monitor, std::back_inserter(event))) {
      std::fprintf(stderr, "kvcd-events-meter: %zu of %zu publishers connected in %lld ms\n", done,
                   endpoints.size(),
                   static_cast<long long>(absl::GetFlag(FLAGS_subscribe_timeout_ms)));
      return 1;
    }
  }
  std::printf("subscribed\n");
  std::fflush(stdout);

  int64_t messages = 0, frames = 0, payload_bytes = 0, zmtp_bytes = 0, batch_bytes = 0;
  int64_t stored_events = 0, blocks_stored = 0, blocks_removed = 0, cleared = 0, undecodable = 0;
  int64_t bytes_stored_only = 0;  // batches holding nothing but BlockStored events
  int64_t blocks_in_stored_only = 0;
  auto last_message = std::chrono::steady_clock::now();
  while (true) {
    if (stop_requested) {
      const auto idle = std::chrono::steady_clock::now() - last_message;
      if (idle > std::chrono::milliseconds(absl::GetFlag(FLAGS_drain_ms))) break;
    }
    std::vector<zmq::message_t> parts;
    try {
      if (!zmq::recv_multipart(sub, std::back_inserter(parts))) continue;
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;  // the signal that ends the run
      throw;
    }
    last_message = std::chrono::steady_clock::now();
    ++messages;
    int64_t msg_bytes = 0;
    for (const zmq::message_t& p : parts) {
      ++frames;
      payload_bytes += static_cast<int64_t>(p.size());
      msg_bytes += ZmtpBytes(p.size());
    }
    zmtp_bytes += msg_bytes;
    if (parts.size() != 3) {
      ++undecodable;
      continue;
    }
    batch_bytes += static_cast<int64_t>(parts[2].size());
    try {
      msgpack::object_handle h =
          msgpack::unpack(static_cast<const char*>(parts[2].data()), parts[2].size());
      const msgpack::object& o = h.get();
      if (o.type != msgpack::type::ARRAY || o.via.array.size != 3 ||
          o.via.array.ptr[1].type != msgpack::type::ARRAY) {
        ++undecodable;
        continue;
      }
      bool only_stored = true;
      int64_t stored_here = 0;
      const msgpack::object& events = o.via.array.ptr[1];
      for (uint32_t i = 0; i < events.via.array.size; ++i) {
        const msgpack::object& e = events.via.array.ptr[i];
        if (e.type != msgpack::type::ARRAY || e.via.array.size == 0) {
          ++undecodable;
          continue;
        }
        const std::string tag = e.via.array.ptr[0].as<std::string>();
        if (tag == "BlockStored" && e.via.array.size >= 2) {
          ++stored_events;
          stored_here += e.via.array.ptr[1].via.array.size;
        } else if (tag == "BlockRemoved" && e.via.array.size >= 2) {
          blocks_removed += e.via.array.ptr[1].via.array.size;
          only_stored = false;
        } else if (tag == "AllBlocksCleared") {
          ++cleared;
          only_stored = false;
        } else {
          ++undecodable;
        }
      }
      blocks_stored += stored_here;
      if (only_stored && stored_here > 0) {
        bytes_stored_only += msg_bytes;
        blocks_in_stored_only += stored_here;
      }
    } catch (const std::exception&) {
      ++undecodable;
    }
  }
  nlohmann::json out = {
      {"publishers", endpoints.size()},
      {"messages", messages},
      {"frames", frames},
      {"payload_bytes", payload_bytes},
      {"zmtp_bytes", zmtp_bytes},
      {"batch_bytes", batch_bytes},
      {"stored_events", stored_events},
      {"blocks_stored", blocks_stored},
      {"blocks_removed", blocks_removed},
      {"all_cleared", cleared},
      {"undecodable", undecodable},
      {"stored_only_zmtp_bytes", bytes_stored_only},
      {"stored_only_blocks", blocks_in_stored_only},
      {"zmtp_bytes_per_block_stored",
       blocks_stored > 0 ? static_cast<double>(zmtp_bytes) / static_cast<double>(blocks_stored)
                         : 0.0},
  };
  std::printf("%s\n", out.dump(1).c_str());
  return 0;
}
