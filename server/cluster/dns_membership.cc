#include "server/cluster/dns_membership.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "kvcd/v1/kvcache.grpc.pb.h"

namespace kvcd {
namespace {

// The addresses `name` resolves to, as host:port gRPC targets (IPv6 in brackets).
std::vector<std::string> Resolve(const std::string& name, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  std::vector<std::string> out;
  if (getaddrinfo(name.c_str(), nullptr, &hints, &found) != 0) return out;
  std::set<std::string> seen;
  for (const addrinfo* a = found; a != nullptr && seen.size() < DnsMembership::kMaxMembers;
       a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr, text,
                sizeof(text));
      seen.insert(absl::StrCat(text, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                sizeof(text));
      seen.insert(absl::StrCat("[", text, "]:", port));
    }
  }
  freeaddrinfo(found);
  out.assign(seen.begin(), seen.end());
  return out;
}

}  // namespace

DnsMembership::DnsMembership(const ClusterConfig& config, MemberInfo self, int port,
                             std::shared_ptr<grpc::ChannelCredentials> creds)
    : config_(config), self_(std::move(self)), port_(port), creds_(std::move(creds)) {}

DnsMembership::~DnsMembership() { Stop(); }

void DnsMembership::Start(Listener listener) {
  listener_ = std::move(listener);
  thread_ = std::thread([this] { Loop(); });
}

void DnsMembership::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

MembershipState DnsMembership::state() const {
  return rounds_ok_.load() > 0 ? MembershipState::kAdvertised : MembershipState::kJoining;
}

std::vector<MemberInfo> DnsMembership::Members() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<MemberInfo> out;
  for (const auto& [id, m] : members_) out.push_back(m);
  return out;
}

std::optional<MemberInfo> DnsMembership::Find(const std::string& member_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = members_.find(member_id);
  if (it == members_.end()) return std::nullopt;
  return it->second;
}

void DnsMembership::Loop() {
  while (true) {
    Round();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(std::max<int64_t>(1000, config_.load_interval_ms)),
                 [this] { return stopping_; });
    if (stopping_) return;
  }
}

// The bearer token of cluster.peer_token_file (surrounding white space removed); the
// previous one when the file cannot be read or is empty (a secret being rotated).
std::string DnsMembership::PeerToken() {
  if (config_.peer_token_file.empty()) return "";
  std::ifstream in(config_.peer_token_file);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string token(absl::StripAsciiWhitespace(ss.str()));
  if (!in || token.empty()) {
    KVCD_LOG(WARNING) << "cluster: cannot read a token from cluster.peer_token_file '"
                      << config_.peer_token_file << "'"
                      << (token_.empty() ? "" : "; keeping the previous one");
    return token_;
  }
  token_ = token;
  return token_;
}

void DnsMembership::Round() {
  std::map<std::string, MemberInfo> now;
  const std::string token = PeerToken();
  for (const std::string& address : Resolve(config_.dns_name, port_)) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(4 << 20);  // a Stats answer; bounded
    auto stub = v1::KvCache::NewStub(grpc::CreateCustomChannel(address, creds_, args));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    v1::StatsResponse stats;
    if (!stub->Stats(&ctx, v1::StatsRequest(), &stats).ok()) continue;
    // Checked as an etcd value would be (member_info.h).
    MemberInfo m;
    m.member_id = stats.member_id();
    m.address = address;
    m.backend = stats.backend();
    m.capacity_pages = stats.pages_capacity();
    m.incarnation = stats.incarnation();
    m.version = stats.version();
    absl::StatusOr<MemberInfo> checked = DecodeMemberInfo(EncodeMemberInfo(m), m.member_id);
    if (!checked.ok()) {
      KVCD_LOG(WARNING) << "cluster: ignoring " << address << " (from " << config_.dns_name
                        << "): " << checked.status();
      continue;
    }
    now.emplace(checked->member_id, std::move(*checked));
  }
  rounds_ok_.fetch_add(1);
  if (rounds_ok_.load() == 1 && listener_.advertised) listener_.advertised(1);
  std::vector<MemberInfo> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, m] : members_) {
      const auto it = now.find(id);
      if (it == now.end() || it->second.incarnation != m.incarnation) gone.push_back(m);
    }
    members_ = std::move(now);
  }
  for (const MemberInfo& m : gone) {
    if (m.member_id == self_.member_id && m.incarnation == self_.incarnation) continue;
    KVCD_LOG(INFO) << "cluster: member " << m.member_id << " (incarnation " << m.incarnation
                   << ") left " << config_.dns_name;
    if (listener_.member_gone) listener_.member_gone(m);
  }
}

}  // namespace kvcd
