#include "server/cluster/etcd_client.h"

#include "absl/strings/str_cat.h"

namespace kvcd {

std::string EtcdPrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    unsigned char& last = reinterpret_cast<unsigned char&>(end.back());
    if (last < 0xff) {
      ++last;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key (etcd's "\0" range end)
}

EtcdClient::EtcdClient(std::vector<std::string> endpoints, std::chrono::milliseconds call_timeout)
    : endpoints_(std::move(endpoints)), call_timeout_(call_timeout) {
  for (const std::string& e : endpoints_) {
    grpc::ChannelArguments args;
    // Fail fast between reconnect attempts: membership retries on its own schedule.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 3000);
    args.SetMaxReceiveMessageSize(8 << 20);  // member lists are small; bound what etcd sends
    Stubs s;
    s.channel = grpc::CreateCustomChannel(e, grpc::InsecureChannelCredentials(), args);
    s.kv = etcdserverpb::KV::NewStub(s.channel);
    s.lease = etcdserverpb::Lease::NewStub(s.channel);
    s.watch = etcdserverpb::Watch::NewStub(s.channel);
    stubs_.push_back(std::move(s));
  }
}

EtcdClient::Stubs& EtcdClient::Current() { return stubs_[current_.load() % stubs_.size()]; }

void EtcdClient::SetDeadline(grpc::ClientContext* ctx) const {
  ctx->set_deadline(std::chrono::system_clock::now() + call_timeout_);
}

absl::Status EtcdClient::Note(const grpc::Status& s, const char* what) {
  if (s.ok()) return absl::OkStatus();
  const size_t at = current_.load() % stubs_.size();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
      s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    current_.fetch_add(1);
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("etcd ", endpoints_[at], ": ", what, ": ", s.error_message()));
}

absl::StatusOr<std::vector<EtcdKeyValue>> EtcdClient::RangePrefix(const std::string& prefix,
                                                                  int64_t limit,
                                                                  int64_t* revision) {
  etcdserverpb::RangeRequest req;
  req.set_key(prefix);
  req.set_range_end(EtcdPrefixEnd(prefix));
  req.set_limit(limit);
  etcdserverpb::RangeResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  if (absl::Status s = Note(Current().kv->Range(&ctx, req, &resp), "Range"); !s.ok()) return s;
  std::vector<EtcdKeyValue> out;
  out.reserve(resp.kvs_size());
  for (const auto& kv : resp.kvs()) {
    out.push_back({kv.key(), kv.value(), kv.mod_revision(), kv.lease()});
  }
  if (revision != nullptr) *revision = resp.header().revision();
  return out;
}

absl::StatusOr<std::vector<EtcdKeyValue>> EtcdClient::Get(const std::string& key) {
  etcdserverpb::RangeRequest req;
  req.set_key(key);
  etcdserverpb::RangeResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  if (absl::Status s = Note(Current().kv->Range(&ctx, req, &resp), "Range"); !s.ok()) return s;
  std::vector<EtcdKeyValue> out;
  for (const auto& kv : resp.kvs())
    out.push_back({kv.key(), kv.value(), kv.mod_revision(), kv.lease()});
  return out;
}

absl::Status EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease_id) {
  etcdserverpb::PutRequest req;
  req.set_key(key);
  req.set_value(value);
  req.set_lease(lease_id);
  etcdserverpb::PutResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  return Note(Current().kv->Put(&ctx, req, &resp), "Put");
}

absl::Status EtcdClient::Delete(const std::string& key) {
  etcdserverpb::DeleteRangeRequest req;
  req.set_key(key);
  etcdserverpb::DeleteRangeResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  return Note(Current().kv->DeleteRange(&ctx, req, &resp), "DeleteRange");
}

absl::StatusOr<int64_t> EtcdClient::LeaseGrant(int64_t ttl_s, int64_t* granted_ttl_s) {
  etcdserverpb::LeaseGrantRequest req;
  req.set_ttl(ttl_s);
  etcdserverpb::LeaseGrantResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  if (absl::Status s = Note(Current().lease->LeaseGrant(&ctx, req, &resp), "LeaseGrant"); !s.ok()) {
    return s;
  }
  if (!resp.error().empty() || resp.id() == 0) {
    return absl::UnavailableError(absl::StrCat("etcd refused a lease: '", resp.error(), "'"));
  }
  if (granted_ttl_s != nullptr) *granted_ttl_s = resp.ttl();
  return resp.id();
}

absl::StatusOr<int64_t> EtcdClient::LeaseKeepAliveOnce(int64_t lease_id) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  auto stream = Current().lease->LeaseKeepAlive(&ctx);
  etcdserverpb::LeaseKeepAliveRequest req;
  req.set_id(lease_id);
  etcdserverpb::LeaseKeepAliveResponse resp;
  const bool wrote = stream->Write(req);
  const bool read = wrote && stream->Read(&resp);
  stream->WritesDone();
  if (!read) ctx.TryCancel();
  const grpc::Status s = stream->Finish();
  if (!read) {
    absl::Status st = Note(s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream ended") : s,
                           "LeaseKeepAlive");
    return st;
  }
  return resp.ttl() > 0 ? resp.ttl() : 0;
}

absl::Status EtcdClient::LeaseRevoke(int64_t lease_id) {
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(lease_id);
  etcdserverpb::LeaseRevokeResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx);
  return Note(Current().lease->LeaseRevoke(&ctx, req, &resp), "LeaseRevoke");
}

EtcdClient::Watch::~Watch() {
  if (stream_) {
    ctx_.TryCancel();
    stream_->Finish();
  }
}

bool EtcdClient::Watch::Next(etcdserverpb::WatchResponse* out) { return stream_->Read(out); }

absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> EtcdClient::WatchPrefix(
    const std::string& prefix, int64_t start_revision) {
  auto w = std::make_unique<Watch>();
  w->stream_ = Current().watch->Watch(&w->ctx_);
  etcdserverpb::WatchRequest req;
  auto* create = req.mutable_create_request();
  create->set_key(prefix);
  create->set_range_end(EtcdPrefixEnd(prefix));
  create->set_start_revision(start_revision);
  create->set_prev_kv(true);
  etcdserverpb::WatchResponse created;
  if (!w->stream_->Write(req) || !w->stream_->Read(&created) || !created.created()) {
    w->ctx_.TryCancel();
    const grpc::Status s = w->stream_->Finish();
    w->stream_.reset();
    return Note(s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "watch not created") : s,
                "Watch");
  }
  return w;
}

}  // namespace kvcd
