#include "server/backends/fault_injector.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvcd {
namespace {

const char* KindName(FaultInjector::Kind k) {
  switch (k) {
    case FaultInjector::Kind::kAlloc:
      return "allocation";
    case FaultInjector::Kind::kCopy:
      return "page copy";
    case FaultInjector::Kind::kAttend:
      return "attention launch";
  }
  return "?";
}

class FaultInjectingBackend final : public Backend {
 public:
  FaultInjectingBackend(std::unique_ptr<Backend> inner, std::shared_ptr<FaultInjector> injector)
      : inner_(std::move(inner)), injector_(std::move(injector)) {}

  const char* name() const override { return inner_->name(); }
  bool Healthy() const override { return injector_->healthy() && inner_->Healthy(); }

  absl::StatusOr<uint8_t*> AllocatePoolMemory(uint64_t bytes) override {
    if (absl::Status s = injector_->Check(FaultInjector::Kind::kAlloc); !s.ok()) return s;
    return inner_->AllocatePoolMemory(bytes);
  }
  void FreePoolMemory(uint8_t* p, uint64_t bytes) override { inner_->FreePoolMemory(p, bytes); }
  BackendKind kind() const override { return inner_->kind(); }
  absl::Status WritePages(const PagePool& pool, absl::Span<const int32_t> ids, const uint8_t* run,
                          bool run_on_device) override {
    if (absl::Status s = injector_->Check(FaultInjector::Kind::kCopy); !s.ok()) return s;
    return inner_->WritePages(pool, ids, run, run_on_device);
  }
  absl::Status ReadPages(const PagePool& pool, absl::Span<const int32_t> ids, uint8_t* run,
                         bool run_on_device) override {
    if (absl::Status s = injector_->Check(FaultInjector::Kind::kCopy); !s.ok()) return s;
    return inner_->ReadPages(pool, ids, run, run_on_device);
  }
  absl::Status Attend(const AttentionBatch& batch) override {
    if (absl::Status s = injector_->Check(FaultInjector::Kind::kAttend); !s.ok()) return s;
    return inner_->Attend(batch);
  }
  DeviceRuntime* device() override { return inner_->device(); }

 private:
  std::unique_ptr<Backend> inner_;
  std::shared_ptr<FaultInjector> injector_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<FaultInjector>> FaultInjector::Parse(const std::string& spec) {
  auto injector = std::make_unique<FaultInjector>();
  for (absl::string_view entry : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> parts = absl::StrSplit(entry, ':');
    Fault f{Kind::kAlloc, 0, false};
    if (parts.size() == 3 && parts[0] == "sticky") {
      f.sticky = true;
      parts.erase(parts.begin());
    }
    const auto bad = [&] {
      return absl::InvalidArgumentError(absl::StrCat(
          "fault-inject entry '", entry.substr(0, 64),
          "' is not KIND:N or sticky:KIND:N with KIND alloc, copy or attend and N >= 1"));
    };
    if (parts.size() != 2) return bad();
    if (parts[0] == "alloc") {
      f.kind = Kind::kAlloc;
    } else if (parts[0] == "copy") {
      f.kind = Kind::kCopy;
    } else if (parts[0] == "attend") {
      f.kind = Kind::kAttend;
    } else {
      return bad();
    }
    if (!absl::SimpleAtoi(parts[1], &f.nth) || f.nth < 1) return bad();
    injector->faults_.push_back(f);
  }
  if (injector->faults_.empty()) {
    return absl::InvalidArgumentError("fault-inject spec is empty; expected e.g. alloc:3");
  }
  return injector;
}

absl::Status FaultInjector::Check(Kind kind) {
  if (sticky_fired_.load()) {
    return absl::InternalError(absl::StrCat("injected fault: the backend failed earlier (sticky); ",
                                            KindName(kind), " refused"));
  }
  const int64_t n = calls_[static_cast<int>(kind)].fetch_add(1) + 1;
  for (const Fault& f : faults_) {
    if (f.kind != kind || f.nth != n) continue;
    fired_.fetch_add(1);
    if (f.sticky) sticky_fired_.store(true);
    const std::string what =
        absl::StrCat("injected fault: ", KindName(kind), " #", n, f.sticky ? " (sticky)" : "");
    return kind == Kind::kAlloc ? absl::ResourceExhaustedError(what) : absl::InternalError(what);
  }
  return absl::OkStatus();
}

std::unique_ptr<Backend> WithFaultInjection(std::unique_ptr<Backend> backend,
                                            std::shared_ptr<FaultInjector> injector) {
  return std::make_unique<FaultInjectingBackend>(std::move(backend), std::move(injector));
}

}  // namespace kvcd
