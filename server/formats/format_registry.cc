#include "server/formats/format_registry.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "server/formats/bf16/bf16_factory.h"
#include "server/formats/fsq/fsq_factory.h"
#include "server/formats/int2_oscar/int2_oscar_factory.h"
#include "server/formats/int2_transform/int2_transform_factory.h"

namespace kvcd {
namespace {

// The registry. A format selected by its codec file comes before its name's default.
const std::vector<FormatEntry>& Formats() {
  static const auto* kFormats = new std::vector<FormatEntry>{
      // id, page name, API id and name, config name, factory
      {FormatId::kBf16, "bf16", 1, "HISTORY_FORMAT_BF16", "bf16", Bf16Factory()},
      {FormatId::kInt2Transform, "int2-transform", 2, "HISTORY_FORMAT_INT2_OSCAR", "int2-oscar",
       Int2TransformFactory()},
      {FormatId::kInt2Oscar, "int2-oscar", 2, "HISTORY_FORMAT_INT2_OSCAR", "int2-oscar",
       Int2OscarFactory()},
      {FormatId::kFsq, "fsq", 3, "HISTORY_FORMAT_FSQ", "fsq", FsqFactory()},
      {FormatId::kFsqWindow, "bf16+fsq", 0, "", "", FormatFactory{}},
  };
  return *kFormats;
}

// The entry a config name or proto id selects without a codec file.
bool IsDefault(const FormatEntry& e) { return e.factory.load != nullptr && !e.factory.claims; }

const FormatEntry* EntryOf(FormatId id) {
  for (const FormatEntry& e : Formats()) {
    if (e.id == id) return &e;
  }
  return nullptr;
}

}  // namespace

const std::vector<FormatEntry>& FormatRegistry() { return Formats(); }

const char* FormatName(FormatId id) {
  const FormatEntry* e = EntryOf(id);
  return e != nullptr ? e->name : "unknown";
}

absl::Status ParseFormatName(const std::string& name, const char* field, FormatId* out) {
  std::string accepted;
  std::vector<const FormatEntry*> names;
  for (const FormatEntry& e : Formats()) {
    if (IsDefault(e)) names.push_back(&e);
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (name == names[i]->config_name) {
      *out = names[i]->id;
      return absl::OkStatus();
    }
    absl::StrAppend(&accepted, i == 0 ? "" : (i + 1 == names.size() ? " or " : ", "), "'",
                    names[i]->config_name, "'");
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " is '", name.substr(0, 64), "', expected ", accepted));
}

absl::StatusOr<FormatId> HistoryFormatOfProto(int proto_id) {
  if (proto_id == 0) return FormatId::kBf16;  // HISTORY_FORMAT_UNSPECIFIED
  std::string accepted;
  std::vector<const FormatEntry*> names;
  for (const FormatEntry& e : Formats()) {
    if (IsDefault(e)) names.push_back(&e);
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i]->proto_id == proto_id) return names[i]->id;
    absl::StrAppend(&accepted, i == 0 ? "" : (i + 1 == names.size() ? " or " : ", "),
                    names[i]->proto_name, " (", names[i]->proto_id, ")");
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "profile.history_format is ", proto_id, ", not a known HistoryFormat; expected ", accepted));
}

int ProtoOfHistoryFormat(FormatId id) {
  const FormatEntry* e = EntryOf(id);
  return e != nullptr ? e->proto_id : 0;
}

CodecSource::CodecSource(const ModelSpec& spec, const std::string& codec_blob)
    : model_(spec.name),
      blob_(codec_blob),
      path_(spec.codec_file),
      what_(codec_blob.empty() ? absl::StrCat("codec_file ", Quote(spec.codec_file))
                               : std::string("codec_blob")) {}

absl::StatusOr<const SafetensorsFile*> CodecSource::Open() const {
  if (file_ == nullptr) {
    auto file = blob_.empty() ? SafetensorsFile::Load(path_) : SafetensorsFile::Parse(blob_);
    if (!file.ok()) return Error(file.status().message());
    file_ = std::make_unique<SafetensorsFile>(std::move(*file));
  }
  return file_.get();
}

absl::Status CodecSource::Error(absl::string_view message) const {
  return absl::InvalidArgumentError(
      absl::StrCat("model ", Quote(model_), ": ", what_, ": ", message));
}

absl::StatusOr<std::unique_ptr<const ModelCodec>> LoadModelCodec(const ModelSpec& spec,
                                                                 const std::string& codec_blob) {
  const CodecSource codec(spec, codec_blob);
  const char* name = EntryOf(spec.history_format)->config_name;
  for (const FormatEntry& e : Formats()) {
    if (e.factory.load == nullptr || std::strcmp(e.config_name, name) != 0) continue;
    if (e.factory.claims != nullptr) {
      if (!codec.given()) continue;
      auto file = codec.Open();
      if (!file.ok()) return file.status();
      if (!e.factory.claims(**file)) continue;
    }
    return e.factory.load(spec, codec);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("model ", Quote(spec.name), ": history_format ", name, " has no factory"));
}

}  // namespace kvcd
