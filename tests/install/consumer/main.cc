// Connects to the daemon at argv[1] and prints its version and backend (Stats).
#include <cstdio>

#include "client/client.h"

int main(int argc, char** argv) {
  kvcd::ClientOptions options;
  options.target = argc > 1 ? argv[1] : "127.0.0.1:50051";
  auto client = kvcd::Client::Connect(options);
  if (!client.ok()) return std::fprintf(stderr, "%s\n", client.status().ToString().c_str()), 1;
  auto stats = (*client)->Stats();
  if (!stats.ok()) return std::fprintf(stderr, "%s\n", stats.status().ToString().c_str()), 1;
  std::printf("kvcd %s, backend %s\n", stats->version().c_str(), stats->backend().c_str());
  return 0;
}
