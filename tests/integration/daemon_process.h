// Starts the real kvcd binary on loopback ports for integration tests and stops it
// with SIGTERM. Readiness is the daemon's "kvcd ready ..." stdout line (no sleeps).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace kvcd::testing_util {

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

  ~DaemonProcess() {
    if (pid_ > 0) Stop();
    if (!config_path_.empty()) std::remove(config_path_.c_str());
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
  std::string stderr_path_;
};

}  // namespace kvcd::testing_util
