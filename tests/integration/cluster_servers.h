// The servers a cluster test needs besides kvcd: a real etcd and a real redis-server, each
// on loopback ports chosen free at run time, with its data in a temporary directory, killed
// and removed with the object (also when the test fails). Readiness is waited on (the
// server answers), never slept on. Shared by the cluster tests of the daemon, the client and
// the topology (header-only, test code).
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "daemon_process.h"

namespace kvcd::testing_util {

// A loopback TCP port that was free a moment ago (bound to port 0, then closed).
inline int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

// True when something accepts TCP connections on 127.0.0.1:port.
inline bool LoopbackPortOpen(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// A child process with its own temporary directory (stdout and stderr go to log.txt there).
class ServerProcess {
 public:
  ServerProcess() = default;
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;
  ~ServerProcess() {
    Kill();
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }

  // SIGKILL and reap (no-op when not running).
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  bool running() const { return pid_ > 0; }
  const std::string& dir() const { return dir_; }
  std::string Log() const { return ReadFile(dir_ + "/log.txt"); }

 protected:
  bool MakeDir(const char* tag) {
    if (!dir_.empty()) return true;
    std::string tmpl = std::string("/tmp/kvcd-") + tag + "-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) return false;
    dir_ = tmpl;
    return true;
  }
  bool Spawn(const std::vector<std::string>& argv) {
    pid_ = fork();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      const std::string log = dir_ + "/log.txt";
      if (freopen(log.c_str(), "a", stdout) == nullptr) _exit(126);
      dup2(STDOUT_FILENO, STDERR_FILENO);
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execvp(args[0], args.data());
      _exit(127);
    }
    return true;
  }
  // Waits until `port` accepts connections or the process exits (false) or `timeout` passes.
  bool WaitListening(int port, std::chrono::milliseconds timeout) {
    return WaitFor(
               [&] {
                 int status = 0;
                 if (pid_ > 0 && waitpid(pid_, &status, WNOHANG) == pid_) {
                   pid_ = -1;
                   return true;  // exited: stop waiting, fail below
                 }
                 return LoopbackPortOpen(port);
               },
               timeout) &&
           pid_ > 0;
  }

  pid_t pid_ = -1;
  std::string dir_;
};

// A one-member etcd v3 cluster on 127.0.0.1 (client and peer ports free at run time).
// Restart() keeps the data directory and the ports (what etcd restarting looks like).
class EtcdServer : public ServerProcess {
 public:
  bool Start() {
    if (!MakeDir("etcd")) return false;
    if (client_port_ == 0) {
      client_port_ = FreeLoopbackPort();
      peer_port_ = FreeLoopbackPort();
    }
    const std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
    if (!Spawn({"etcd", "--name", "t", "--data-dir", dir_ + "/data", "--listen-client-urls", client,
                "--advertise-client-urls", client, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", "t=" + peer,
                "--log-level", "warn"})) {
      return false;
    }
    return WaitListening(client_port_, std::chrono::seconds(20));
  }
  bool Restart() {
    Kill();
    return Start();
  }
  // host:port of the gRPC client API.
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }

 private:
  int client_port_ = 0, peer_port_ = 0;
};

// A redis-server on 127.0.0.1 without persistence. Restart() comes back empty on the same
// port (what a Redis restart without persistence looks like).
class RedisServer : public ServerProcess {
 public:
  bool Start() {
    if (!MakeDir("redis")) return false;
    if (port_ == 0) port_ = FreeLoopbackPort();
    if (!Spawn({"redis-server", "--port", std::to_string(port_), "--bind", "127.0.0.1", "--save",
                "", "--appendonly", "no", "--dir", dir_, "--protected-mode", "yes"})) {
      return false;
    }
    return WaitListening(port_, std::chrono::seconds(20));
  }
  bool Restart() {
    Kill();
    return Start();
  }
  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }

 private:
  int port_ = 0;
};

// The daemon config's `cluster:` section for a test member: etcd membership with a 2 s lease
// (so a killed member's key goes within seconds) and, when `redis` is given, the block index
// with a 100 ms load interval.
inline std::string ClusterSection(const std::string& name, const std::string& member,
                                  const std::string& etcd, const std::string& redis = "") {
  std::string s = "cluster:\n  name: " + name + "\n  member_id: " + member +
                  "\n  membership: etcd\n  etcd_endpoints: [" + etcd + "]\n  lease_ttl_s: 2\n";
  if (!redis.empty()) s += "  redis_url: " + redis + "\n  load_interval_ms: 100\n";
  return s;
}

}  // namespace kvcd::testing_util
