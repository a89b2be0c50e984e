// The format registry: one line per history format (format_registry.cc) — its API id
// (v1::HistoryFormat), its config name and its factory. Everything else about a format
// lives in its folder (server/formats/<format>/): the factory parses the format's own codec
// file, checks it against the model's profile and builds the model's formats for the
// backend that runs them (CPU or CUDA). The cache core, the API mapping and
// `kvcd check-config` reach formats only through here.
//
// Adding a format: its folder, one FormatId (format_id.h), one line in the table of
// format_registry.cc, its sources in server/formats/CMakeLists.txt, and its kernels.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "server/formats/format_id.h"
#include "server/formats/model_spec.h"
#include "server/formats/page_format.h"

namespace kvcd {

// Where a model's formats run: what a format factory needs to know of the backend.
enum class BackendKind { kCpu, kCuda };

// The codec file a model comes with: the bytes of RegisterModel's codec_blob, else the
// config's codec_file, else none. Opened once, when a factory asks for it.
class CodecSource {
 public:
  // Refers to spec and codec_blob: lives only while a factory loads the codec.
  CodecSource(const ModelSpec& spec, const std::string& codec_blob);
  bool given() const { return !blob_.empty() || !path_.empty(); }
  bool from_blob() const { return !blob_.empty(); }
  // Where the codec came from, for messages: "codec_blob" or "codec_file '<path>'".
  const std::string& what() const { return what_; }
  // The parsed file; INVALID_ARGUMENT "model '<name>': <what>: <why>" when it cannot be read
  // or parsed. REQUIRES: given().
  absl::StatusOr<const SafetensorsFile*> Open() const;
  // INVALID_ARGUMENT "model '<name>': <what>: <message>" (a codec that does not fit).
  absl::Status Error(absl::string_view message) const;

 private:
  const std::string& model_;
  const std::string& blob_;
  const std::string& path_;
  std::string what_;
  mutable std::unique_ptr<SafetensorsFile> file_;
};

// A model's codec as its history format's factory parsed and checked it: what the model's
// formats are built from.
class ModelCodec {
 public:
  virtual ~ModelCodec() = default;
  // The format of the model's history pages (spec.history_format, or the format the codec
  // file selected: int2-transform for a version-3 int2-oscar file).
  virtual FormatId history() const = 0;
  // What ModelSnapshot::codec reports.
  virtual std::string description() const = 0;
  // The model's formats on a backend of `kind`: [0] the window format, [1] the history
  // format when the history is stored differently. UNIMPLEMENTED for a backend that cannot
  // run them, INVALID_ARGUMENT for a geometry its kernels do not serve.
  virtual absl::StatusOr<std::vector<std::unique_ptr<PageFormat>>> CreateFormats(
      const PageGeometry& geometry, BackendKind kind) const = 0;
};

struct FormatFactory {
  // Set for a format selected by its codec file among those of one config name: true when
  // the file is this format's (int2-transform: version-3 files). Null: the name's default.
  bool (*claims)(const SafetensorsFile& file) = nullptr;
  // Parses the model's codec (the codec file, or what the spec names) and checks it
  // against the spec: INVALID_ARGUMENT naming the model, where the codec came from
  // (CodecSource::what) and what is wrong.
  absl::StatusOr<std::unique_ptr<const ModelCodec>> (*load)(const ModelSpec& spec,
                                                            const CodecSource& codec) = nullptr;
};

struct FormatEntry {
  FormatId id;
  // The pages' name (PageFormat::name): in the API's page descriptions and metrics.
  const char* name;
  // The v1::HistoryFormat value and its name a client sends for this history (0: none;
  // formats selected by their codec file share the value of their config name).
  int proto_id;
  const char* proto_name;
  // The history_format a config names ("" for window formats).
  const char* config_name;
  // Null for window formats (built by their history format's factory).
  FormatFactory factory;
};

// Every format, in the order lookups try them.
const std::vector<FormatEntry>& FormatRegistry();

// The history format of a v1::HistoryFormat value (0, unspecified: bf16); INVALID_ARGUMENT
// naming profile.history_format and the accepted values for any other.
absl::StatusOr<FormatId> HistoryFormatOfProto(int proto_id);
// The v1::HistoryFormat value of a history format a spec names.
int ProtoOfHistoryFormat(FormatId id);

// Parses and checks a model's codec with its history format's factory: what `kvcd serve`
// does when it registers the model (ModelCache::Create) and `kvcd check-config` does to
// check a config. codec_blob: RegisterModel's (empty: the spec's codec_file or codec).
absl::StatusOr<std::unique_ptr<const ModelCodec>> LoadModelCodec(const ModelSpec& spec,
                                                                 const std::string& codec_blob);

}  // namespace kvcd
