#include "activation_dump.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "safetensors.h"

namespace kvcd {
namespace {

absl::StatusOr<int64_t> MetaInt(const SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata().find(key);
  int64_t v = 0;
  if (it == f.metadata().end() || !absl::SimpleAtoi(it->second, &v) || v <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("activation dump: metadata '", key, "' must be a positive integer"));
  }
  return v;
}

}  // namespace

absl::StatusOr<ActivationDump> LoadActivationDump(const std::string& path) {
  auto f = SafetensorsFile::Load(path);
  if (!f.ok()) return f.status();
  auto marker = f->metadata().find("kvcd.dump");
  if (marker == f->metadata().end() || marker->second != "1") {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not an activation dump (metadata kvcd.dump != \"1\")"));
  }
  ActivationDump d;
  int64_t v = 0;
  for (auto [key, field] : {std::pair<const char*, int*>{"num_layers", &d.num_layers},
                            {"num_q_heads", &d.num_q_heads},
                            {"num_kv_heads", &d.num_kv_heads},
                            {"head_dim", &d.head_dim}}) {
    auto r = MetaInt(*f, key);
    if (!r.ok()) return r.status();
    *field = static_cast<int>(*r);
  }
  auto tokens = MetaInt(*f, "tokens");
  if (!tokens.ok()) return tokens.status();
  d.tokens = *tokens;
  (void)v;
  if (d.num_q_heads % d.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        "activation dump: num_q_heads must be a multiple of num_kv_heads");
  }
  if (f->metadata().count("residual_width")) {
    auto c = MetaInt(*f, "residual_width");
    if (!c.ok()) return c.status();
    d.residual_width = static_cast<int>(*c);
  } else if (f->Has("layers.0.x")) {
    return absl::InvalidArgumentError(
        "activation dump: layers.0.x present without metadata 'residual_width'");
  }
  if (auto s = f->metadata().find("source"); s != f->metadata().end()) d.source = s->second;
  for (int l = 0; l < d.num_layers; ++l) {
    LayerActivations a;
    const std::string p = absl::StrCat("layers.", l, ".");
    auto q = f->ReadFloats(p + "q", {d.tokens, d.num_q_heads, d.head_dim});
    if (!q.ok()) return q.status();
    auto k = f->ReadFloats(p + "k", {d.tokens, d.num_kv_heads, d.head_dim});
    if (!k.ok()) return k.status();
    auto vv = f->ReadFloats(p + "v", {d.tokens, d.num_kv_heads, d.head_dim});
    if (!vv.ok()) return vv.status();
    a.q = std::move(*q);
    a.k = std::move(*k);
    a.v = std::move(*vv);
    d.layers.push_back(std::move(a));
    if (d.residual_width > 0) {
      auto x = f->ReadFloats(p + "x", {d.tokens, d.residual_width});
      if (!x.ok()) return x.status();
      d.x.push_back(std::move(*x));
    }
  }
  return d;
}

absl::Status WriteActivationDump(const ActivationDump& d, const std::string& path) {
  SafetensorsWriter w;
  for (int l = 0; l < d.num_layers; ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    w.AddF32(p + "q", {d.tokens, d.num_q_heads, d.head_dim}, d.layers[l].q);
    w.AddF32(p + "k", {d.tokens, d.num_kv_heads, d.head_dim}, d.layers[l].k);
    w.AddF32(p + "v", {d.tokens, d.num_kv_heads, d.head_dim}, d.layers[l].v);
    if (d.residual_width > 0) w.AddF32(p + "x", {d.tokens, d.residual_width}, d.x[l]);
  }
  if (d.residual_width > 0) w.SetMetadata("residual_width", absl::StrCat(d.residual_width));
  w.SetMetadata("kvcd.dump", "1");
  w.SetMetadata("num_layers", absl::StrCat(d.num_layers));
  w.SetMetadata("num_q_heads", absl::StrCat(d.num_q_heads));
  w.SetMetadata("num_kv_heads", absl::StrCat(d.num_kv_heads));
  w.SetMetadata("head_dim", absl::StrCat(d.head_dim));
  w.SetMetadata("tokens", absl::StrCat(d.tokens));
  if (!d.source.empty()) w.SetMetadata("source", d.source);
  return w.WriteFile(path);
}

}  // namespace kvcd
