#include "common/codec_profile.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/finite_floats.h"
#include "common/quote.h"
#include "common/rotation.h"
#include "kvcd/kernels/int2_codec.h"

namespace kvcd {

CodecProfile CodecProfile::Uniform(int num_layers, int head_dim, const std::vector<float>& r,
                                   std::string description) {
  CodecProfile c;
  c.head_dim_ = head_dim;
  c.layers_.assign(static_cast<size_t>(num_layers),
                   Layer{r, r, kernels::kDefaultRhoK, kernels::kDefaultRhoV, {}, {}});
  c.description_ = std::move(description);
  c.ComputeTransposes();
  return c;
}

CodecProfile CodecProfile::Identity(int num_layers, int head_dim) {
  return Uniform(num_layers, head_dim, IdentityMatrix(head_dim), "identity (naive INT2)");
}

CodecProfile CodecProfile::Hadamard(int num_layers, int head_dim) {
  return Uniform(num_layers, head_dim, HadamardMatrix(head_dim), "hadamard");
}

absl::StatusOr<CodecProfile> CodecProfile::FromSafetensors(const SafetensorsFile& file,
                                                           int num_layers, int head_dim,
                                                           const std::string& description) {
  CodecProfile c;
  c.head_dim_ = head_dim;
  c.description_ = description;
  const std::vector<int64_t> mat = {head_dim, head_dim};
  if (auto v = file.metadata().find("kvcd.codec_version");
      v != file.metadata().end() && v->second != "1") {
    return absl::InvalidArgumentError(
        absl::StrCat("codec file version ", Quote(v->second),
                     v->second == "2"   ? " (one rotation per KV head)"
                     : v->second == "3" ? " (transform-coded keys, common/key_transform_profile.h)"
                                        : "",
                     " is not supported here: expected version 1 (one rotation per layer)"));
  }
  if (file.Has(absl::StrCat("layers.", num_layers, ".r_k"))) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec file has more layers than the model's ", num_layers, " (layers.",
                     num_layers, ".r_k exists): it was calibrated for another model"));
  }
  for (int l = 0; l < num_layers; ++l) {
    Layer layer{{}, {}, kernels::kDefaultRhoK, kernels::kDefaultRhoV, {}, {}};
    for (const char* which : {"r_k", "r_v"}) {
      const std::string name = absl::StrCat("layers.", l, ".", which);
      auto v = file.ReadFloats(name, mat);
      if (!v.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("codec file: ", v.status().message(),
                                                       " (every layer needs r_k and r_v of [",
                                                       head_dim, ", ", head_dim, "])"));
      }
      if (absl::Status f = CheckFinite(name, *v); !f.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("codec file: ", f.message()));
      }
      const double err = OrthogonalityError(*v, head_dim);
      if (!(err <= 1e-3)) {
        return absl::InvalidArgumentError(
            absl::StrCat("codec file: ", name, " is not orthogonal (max |R R^T - I| = ", err,
                         ", expected <= 1e-3)"));
      }
      (std::string(which) == "r_k" ? layer.r_k : layer.r_v) = std::move(*v);
    }
    for (const char* which : {"rho_k", "rho_v"}) {
      const std::string name = absl::StrCat("layers.", l, ".", which);
      if (!file.Has(name)) continue;
      auto v = file.ReadFloats(name, {});
      if (!v.ok())
        return absl::InvalidArgumentError(absl::StrCat("codec file: ", v.status().message()));
      if (v->size() != 1 || !((*v)[0] > 0.0f && (*v)[0] <= 1.0f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("codec file: ", name, " must be one value in (0, 1]"));
      }
      (std::string(which) == "rho_k" ? layer.rho_k : layer.rho_v) = (*v)[0];
    }
    c.layers_.push_back(std::move(layer));
  }
  c.ComputeTransposes();
  return c;
}

void CodecProfile::ComputeTransposes() {
  const int d = head_dim_;
  for (Layer& l : layers_) {
    l.kind_k = kernels::ClassifyRotation(l.r_k.data(), d);
    l.kind_v = kernels::ClassifyRotation(l.r_v.data(), d);
    l.r_k_t.resize(l.r_k.size());
    l.r_v_t.resize(l.r_v.size());
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j) {
        l.r_k_t[j * d + i] = l.r_k[i * d + j];
        l.r_v_t[j * d + i] = l.r_v[i * d + j];
      }
    }
  }
}

SafetensorsWriter CodecProfile::ToSafetensors() const {
  SafetensorsWriter w;
  const std::vector<int64_t> mat = {head_dim_, head_dim_};
  for (int l = 0; l < num_layers(); ++l) {
    w.AddF32(absl::StrCat("layers.", l, ".r_k"), mat, layers_[l].r_k);
    w.AddF32(absl::StrCat("layers.", l, ".r_v"), mat, layers_[l].r_v);
    w.AddF32(absl::StrCat("layers.", l, ".rho_k"), {1}, {layers_[l].rho_k});
    w.AddF32(absl::StrCat("layers.", l, ".rho_v"), {1}, {layers_[l].rho_v});
  }
  w.SetMetadata("kvcd.codec", "int2-oscar");
  w.SetMetadata("kvcd.description", description_);
  return w;
}

}  // namespace kvcd
