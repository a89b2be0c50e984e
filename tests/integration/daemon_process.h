// What every integration test of the real kvcd binary shares: the daemon process
// (started on loopback ports, stopped with SIGTERM; readiness is its "kvcd ready ..." stdout
// line), its captured stderr, its /metrics scrape, and waiting on a condition with a
// deadline (the tests wait on events, never on fixed sleeps). Header-only, test code.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kvcd::testing_util {

// A whole file ("" when it cannot be read).
inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Checks `done` until it holds or `timeout` passes (a short pause between checks); true if it
// held. What a test waits for is the condition, never a fixed time.
inline bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return done();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

class DaemonProcess {
 public:
  // Writes `yaml` to a temp file and starts `kvcd serve --config` on it.
  bool Start(const std::string& yaml) {
    char path[] = "/tmp/kvcd-test-XXXXXX.yaml";
    const int fd = mkstemps(path, 5);
    if (fd < 0) return false;
    config_path_ = path;
    if (write(fd, yaml.data(), yaml.size()) != static_cast<ssize_t>(yaml.size())) return false;
    close(fd);
    int out[2];
    if (pipe(out) != 0) return false;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      close(out[1]);
      if (!stderr_path_.empty()) {
        const int e = open(stderr_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (e >= 0) dup2(e, STDERR_FILENO);
      }
      // KVCD_BINARY in the environment overrides the build tree's binary (device runs).
      const char* bin = std::getenv("KVCD_BINARY") ? std::getenv("KVCD_BINARY") : KVCD_BINARY;
      std::vector<const char*> args = {bin, "serve", "--config", config_path_.c_str()};
      for (const std::string& a : extra_args_) args.push_back(a.c_str());
      args.push_back(nullptr);
      execv(bin, const_cast<char* const*>(args.data()));
      _exit(127);
    }
    close(out[1]);
    stdout_ = fdopen(out[0], "r");
    char line[1024];
    while (fgets(line, sizeof(line), stdout_) != nullptr) {
      const std::string l = line;
      if (l.rfind("kvcd ready", 0) != 0) continue;
      grpc_ = Field(l, "grpc=");
      metrics_ = Field(l, "metrics=");
      health_ = Field(l, "health=");
      return true;
    }
    return false;  // exited before it was ready
  }

  // Arguments after `serve --config FILE` (e.g. --insecure), and a file that receives
  // the daemon's stderr ("" = inherited). Set before Start().
  void set_extra_args(std::vector<std::string> args) { extra_args_ = std::move(args); }
  void set_stderr_path(std::string path) { stderr_path_ = std::move(path); }
  // Sends the daemon's stderr to a fresh temporary file, removed with this object; read it
  // with Stderr(). Call before Start().
  bool CaptureStderr() {
    char path[] = "/tmp/kvcd-test-stderr-XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) return false;
    close(fd);
    stderr_path_ = owned_stderr_ = path;
    return true;
  }
  pid_t pid() const { return pid_; }
  // What the daemon wrote to stderr so far (set_stderr_path or CaptureStderr).
  std::string Stderr() const { return stderr_path_.empty() ? "" : ReadFile(stderr_path_); }

  // After Start() returned false: waits for the daemon to exit and returns its status.
  int WaitExit() {
    if (pid_ <= 0) return -1;
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    if (stdout_) fclose(stdout_);
    stdout_ = nullptr;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // SIGTERM, then the exit status (or -1 if it died of a signal).
  int Stop() {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    if (stdout_) fclose(stdout_);
    stdout_ = nullptr;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // SIGKILL (no drain, nothing said to anyone), then reaps it.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
    if (stdout_) fclose(stdout_);
    stdout_ = nullptr;
  }

  ~DaemonProcess() {
    if (pid_ > 0) Stop();
    if (!config_path_.empty()) std::remove(config_path_.c_str());
    if (!owned_stderr_.empty()) std::remove(owned_stderr_.c_str());
  }

  const std::string& grpc() const { return grpc_; }
  const std::string& metrics() const { return metrics_; }
  const std::string& health() const { return health_; }

 private:
  static std::string Field(const std::string& line, const std::string& key) {
    const auto p = line.find(key);
    if (p == std::string::npos) return "";
    const auto b = p + key.size();
    const auto e = line.find_first_of(" \n", b);
    return line.substr(b, e == std::string::npos ? std::string::npos : e - b);
  }

  pid_t pid_ = -1;
  FILE* stdout_ = nullptr;
  std::string config_path_, grpc_, metrics_, health_;
  std::vector<std::string> extra_args_;
  std::string stderr_path_, owned_stderr_;
};

// The daemon's /metrics (plain HTTP/1.0 on loopback; "" when it cannot be reached).
inline std::string ScrapeMetrics(const DaemonProcess& daemon) {
  const std::string metrics = daemon.metrics();
  if (metrics.empty()) return "";
  const int port = std::stoi(metrics.substr(metrics.rfind(':') + 1));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string get = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  if (write(fd, get.data(), get.size()) != static_cast<ssize_t>(get.size())) {
    close(fd);
    return "";
  }
  std::string body;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) body.append(buf, static_cast<size_t>(n));
  close(fd);
  return body;
}

// The value of the sample line that starts with `sample` ("name" or "name{labels}") in a
// /metrics text, or -1 when there is none.
inline double MetricValue(const std::string& text, const std::string& sample) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.size() > sample.size() && line.compare(0, sample.size(), sample) == 0 &&
        line[sample.size()] == ' ')
      return std::strtod(line.c_str() + sample.size() + 1, nullptr);
  }
  return -1;
}

}  // namespace kvcd::testing_util
