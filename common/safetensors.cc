#include "safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checked_math.h"
#include "common/quote.h"
#include "kvcd/kernels/bf16.h"
#include "kvcd/kernels/fp16.h"
#include "nlohmann/json.hpp"

namespace kvcd {
namespace {

// Counts the header's entries and values without building a tree, and stops at the first
// bound passed (or at a syntax error, left to the real parse to report).
class HeaderCounter final : public nlohmann::json::json_sax_t {
 public:
  int64_t entries = 0, values = 0;
  bool over = false;

  bool null() override { return Value(); }
  bool boolean(bool) override { return Value(); }
  bool number_integer(number_integer_t) override { return Value(); }
  bool number_unsigned(number_unsigned_t) override { return Value(); }
  bool number_float(number_float_t, const string_t&) override { return Value(); }
  bool string(string_t&) override { return Value(); }
  bool binary(binary_t&) override { return Value(); }
  bool start_object(std::size_t) override {
    ++depth_;
    return Value();
  }
  bool key(string_t& k) override {
    // Depth 1: a tensor or __metadata__; depth 2 under __metadata__: a metadata entry.
    if (depth_ == 1) {
      in_metadata_ = k == "__metadata__";
      if (!in_metadata_) ++entries;
    } else if (depth_ == 2 && in_metadata_) {
      ++entries;
    }
    return Check();
  }
  bool end_object() override {
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override {
    ++depth_;
    return Value();
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception&) override {
    return false;
  }

 private:
  bool Value() {
    ++values;
    return Check();
  }
  bool Check() {
    over =
        entries > SafetensorsFile::kMaxHeaderEntries || values > SafetensorsFile::kMaxHeaderValues;
    return !over;
  }
  int depth_ = 0;
  bool in_metadata_ = false;
};

}  // namespace

int SafetensorsDtypeSize(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "U8" || dtype == "I8" || dtype == "BOOL") return 1;
  return 0;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open safetensors file '", path, "'"));
  // Read at its size in one go where the size is known (a model's weights are hundreds of MB:
  // a growing stream and its copy cost three times the bytes in copies and page faults).
  std::string bytes;
  std::error_code error;
  const bool regular = std::filesystem::is_regular_file(path, error);
  std::streamoff size = -1;
  if (regular) {
    in.seekg(0, std::ios::end);
    size = in.tellg();
    in.seekg(0, std::ios::beg);
  }
  if (size > 0 && in) {
    bytes.resize(static_cast<size_t>(size));
    in.read(bytes.data(), size);
    bytes.resize(static_cast<size_t>(in.gcount()));  // what was read: a short file stays short
  } else {
    in.clear();
    std::stringstream ss;
    ss << in.rdbuf();
    bytes = ss.str();
  }
  auto parsed = Parse(std::move(bytes));
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(),
                        absl::StrCat(path, ": ", parsed.status().message()));
  }
  return parsed;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::string bytes) {
  SafetensorsFile f;
  f.bytes_ = std::move(bytes);
  const int64_t total = static_cast<int64_t>(f.bytes_.size());
  if (total < 8) return absl::InvalidArgumentError("safetensors: file shorter than 8 bytes");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(f.bytes_[i]);
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: header length ", header_len,
                                                   " exceeds the limit of ", kMaxHeaderBytes,
                                                   " bytes (kMaxHeaderBytes)"));
  }
  if (header_len > static_cast<uint64_t>(total - 8)) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: header length ", header_len, " exceeds the file size ", total));
  }
  f.data_start_ = 8 + static_cast<int64_t>(header_len);
  const int64_t data_len = total - f.data_start_;
  {
    HeaderCounter counter;
    nlohmann::json::sax_parse(f.bytes_.begin() + 8, f.bytes_.begin() + f.data_start_, &counter,
                              nlohmann::json::input_format_t::json, /*strict=*/true);
    if (counter.over) {
      return absl::InvalidArgumentError(
          counter.entries > kMaxHeaderEntries
              ? absl::StrCat("safetensors: the header has more than ", kMaxHeaderEntries,
                             " entries (tensors and __metadata__ keys; kMaxHeaderEntries)")
              : absl::StrCat("safetensors: the header has more than ", kMaxHeaderValues,
                             " JSON values (kMaxHeaderValues)"));
    }
  }
  nlohmann::json header =
      nlohmann::json::parse(f.bytes_.begin() + 8, f.bytes_.begin() + f.data_start_, nullptr,
                            /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::InvalidArgumentError("safetensors: header is not a JSON object");
  }
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) {
        return absl::InvalidArgumentError("safetensors: __metadata__ must be an object");
      }
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat("safetensors: metadata ", Quote(m.key()), " must be a string"));
        }
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const auto& t = it.value();
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
        !t.contains("data_offsets") || !t["dtype"].is_string() || !t["shape"].is_array() ||
        !t["data_offsets"].is_array() || t["data_offsets"].size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor ", Quote(it.key()),
                       " needs dtype, shape and data_offsets [begin, end]"));
    }
    Entry e;
    e.dtype = t["dtype"].get<std::string>();
    const int esize = SafetensorsDtypeSize(e.dtype);
    if (esize == 0) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", Quote(it.key()),
                                                     " has unknown dtype ", Quote(e.dtype)));
    }
    int64_t elems = 1;
    for (const auto& dim : t["shape"]) {
      if (!dim.is_number_integer() || dim.get<int64_t>() < 0) {
        return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", Quote(it.key()),
                                                       " has a negative or non-integer dim"));
      }
      e.shape.push_back(dim.get<int64_t>());
      auto next = CheckedMul(elems, e.shape.back());
      if (!next) return absl::InvalidArgumentError("safetensors: shape overflows int64");
      elems = *next;
    }
    const auto& off = t["data_offsets"];
    if (!off[0].is_number_integer() || !off[1].is_number_integer()) {
      return absl::InvalidArgumentError("safetensors: data_offsets must be integers");
    }
    e.begin = off[0].get<int64_t>();
    e.end = off[1].get<int64_t>();
    auto bytes_needed = CheckedMul(elems, esize);
    if (e.begin < 0 || e.end < e.begin || e.end > data_len || !bytes_needed ||
        e.end - e.begin != *bytes_needed) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", Quote(it.key()),
                                                     " data_offsets [", e.begin, ", ", e.end,
                                                     ") do not match its shape (", elems, " x ",
                                                     esize, " bytes) or the data size ", data_len));
    }
    f.tensors_[it.key()] = std::move(e);
  }
  return f;
}

absl::StatusOr<SafetensorView> SafetensorsFile::Get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("safetensors: no tensor named ", Quote(name)));
  }
  SafetensorView v;
  v.dtype = it->second.dtype;
  v.shape = it->second.shape;
  v.data = reinterpret_cast<const uint8_t*>(bytes_.data()) + data_start_ + it->second.begin;
  v.size_bytes = it->second.end - it->second.begin;
  return v;
}

std::vector<std::string> SafetensorsFile::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, e] : tensors_) names.push_back(name);
  return names;
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadFloats(
    const std::string& name, const std::vector<int64_t>& expected_shape) const {
  auto view = Get(name);
  if (!view.ok()) return view.status();
  if (!expected_shape.empty() && view->shape != expected_shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors: tensor ", Quote(name), " has shape [", absl::StrJoin(view->shape, ", "),
        "], expected [", absl::StrJoin(expected_shape, ", "), "]"));
  }
  const int esize = SafetensorsDtypeSize(view->dtype);
  const int64_t n = view->size_bytes / esize;
  std::vector<float> out(static_cast<size_t>(n));
  if (view->dtype == "F32") {
    std::memcpy(out.data(), view->data, static_cast<size_t>(view->size_bytes));
  } else if (view->dtype == "BF16" || view->dtype == "F16") {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, view->data + 2 * i, 2);
      out[i] = view->dtype == "BF16" ? kernels::Bf16ToFloat(b) : kernels::HalfToFloat(b);
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", Quote(name),
                                                   " has dtype ", Quote(view->dtype),
                                                   ", expected F32, F16 or BF16"));
  }
  return out;
}

void SafetensorsWriter::Add(const std::string& name, const std::string& dtype,
                            std::vector<int64_t> shape, const void* data, int64_t size_bytes) {
  tensors_.push_back(
      Pending{name, dtype, std::move(shape),
              std::string(static_cast<const char*>(data), static_cast<size_t>(size_bytes))});
}

void SafetensorsWriter::AddF32(const std::string& name, std::vector<int64_t> shape,
                               const std::vector<float>& v) {
  Add(name, "F32", std::move(shape), v.data(), static_cast<int64_t>(v.size() * sizeof(float)));
}

std::string SafetensorsWriter::Serialize() const {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  int64_t offset = 0;
  for (const auto& t : tensors_) {
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + static_cast<int64_t>(t.data.size())}}};
    offset += static_cast<int64_t>(t.data.size());
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  std::string out(8, '\0');
  uint64_t len = h.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  out += h;
  for (const auto& t : tensors_) out += t.data;
  return out;
}

absl::Status SafetensorsWriter::WriteFile(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::NotFoundError(absl::StrCat("cannot write '", path, "'"));
  const std::string bytes = Serialize();
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) return absl::InternalError(absl::StrCat("short write to '", path, "'"));
  return absl::OkStatus();
}

}  // namespace kvcd
