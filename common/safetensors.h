// Reading and writing safetensors files (https://huggingface.co/docs/safetensors):
// an 8-byte little-endian header length, a JSON header mapping tensor names to
// {dtype, shape, data_offsets}, then the raw little-endian data.
//
// Thread safety: a SafetensorsFile is immutable after Parse and may be shared.
// Errors: INVALID_ARGUMENT for malformed content (message says what and where),
// NOT_FOUND for a missing tensor or file.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvcd {

struct SafetensorView {
  std::string dtype;  // "BF16", "F32", "F16", "U8", "I32", ...
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  int64_t size_bytes = 0;
};

class SafetensorsFile {
 public:
  // Bounds on the JSON header, checked before it is parsed into a tree (a hostile header
  // of 100 MB and millions of entries took over 1 GB to parse): its length, its entries
  // (tensors plus __metadata__ keys) and its JSON values in all. Real codec files have a
  // few thousand entries and headers of a few hundred KB. INVALID_ARGUMENT names the bound.
  static constexpr uint64_t kMaxHeaderBytes = 16u << 20;
  static constexpr int64_t kMaxHeaderEntries = 65536;
  static constexpr int64_t kMaxHeaderValues = 1 << 20;

  // Parses an in-memory file; the bytes are copied and owned.
  static absl::StatusOr<SafetensorsFile> Parse(std::string bytes);
  static absl::StatusOr<SafetensorsFile> Load(const std::string& path);

  bool Has(const std::string& name) const { return tensors_.count(name) != 0; }
  absl::StatusOr<SafetensorView> Get(const std::string& name) const;
  std::vector<std::string> Names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Reads a tensor of dtype BF16/F16/F32 as floats, checking the expected shape
  // (an empty expected shape accepts any).
  absl::StatusOr<std::vector<float>> ReadFloats(const std::string& name,
                                                const std::vector<int64_t>& expected_shape) const;

 private:
  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;
  };
  std::string bytes_;
  int64_t data_start_ = 0;
  std::map<std::string, Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Builds a safetensors file in memory.
class SafetensorsWriter {
 public:
  void Add(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
           const void* data, int64_t size_bytes);
  void AddF32(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v);
  void SetMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  std::string Serialize() const;
  absl::Status WriteFile(const std::string& path) const;

 private:
  struct Pending {
    std::string name, dtype;
    std::vector<int64_t> shape;
    std::string data;
  };
  std::vector<Pending> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Bytes per element of a safetensors dtype name, or 0 if unknown.
int SafetensorsDtypeSize(const std::string& dtype);

}  // namespace kvcd
