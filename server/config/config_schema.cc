#include "server/config/config_schema.h"

#include <cmath>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace kvcd {

// Generated at build time from kvcd-config.schema.json (server/config/embed_schema.cmake).
extern const char kConfigSchemaJson[];

namespace {

using nlohmann::json;

// Keywords ValidateJson checks, and annotations it ignores.
const std::set<std::string>& Implemented() {
  static const std::set<std::string> k = {"type",
                                          "properties",
                                          "additionalProperties",
                                          "required",
                                          "items",
                                          "enum",
                                          "minimum",
                                          "maximum",
                                          "exclusiveMinimum",
                                          "exclusiveMaximum",
                                          "minLength",
                                          "maxLength",
                                          "minItems",
                                          "pattern",
                                          "$ref",
                                          "definitions",
                                          "$schema",
                                          "$id",
                                          "$comment",
                                          "title",
                                          "description",
                                          "default",
                                          "examples",
                                          "x-kvcd-status"};
  return k;
}

// Keywords whose value is a map of subschemas, or one subschema.
bool IsSchemaMap(const std::string& k) { return k == "properties" || k == "definitions"; }
bool IsSubschema(const std::string& k) { return k == "items"; }

constexpr size_t kMaxPatternInput = 256;  // std::regex recurses per character

std::string Child(const std::string& path, const std::string& key) {
  return path.empty() ? key : absl::StrCat(path, ".", key);
}

std::string Show(const json& v) {
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    return absl::StrCat("'", s.size() > 64 ? s.substr(0, 64) + "..." : s, "'");
  }
  if (v.is_number_float()) return absl::StrCat(v.get<double>());
  // A config's strings are not known to be UTF-8 (yaml-cpp does not check): replace what is
  // not, rather than let dump() throw.
  std::string d = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return d.size() > 64 ? d.substr(0, 64) + "..." : d;
}

std::string TypeWords(const json& type) {
  std::vector<std::string> names;
  for (const json& t : type.is_array() ? type : json::array({type})) {
    const std::string n = t.get<std::string>();
    names.push_back(n == "integer"   ? "an integer"
                    : n == "number"  ? "a number"
                    : n == "string"  ? "a string"
                    : n == "boolean" ? "true or false"
                    : n == "object"  ? "a mapping"
                    : n == "array"   ? "a list"
                                     : n);
  }
  return absl::StrJoin(names, " or ");
}

bool HasType(const json& v, const std::string& t) {
  if (t == "integer") return v.is_number_integer();
  if (t == "number") return v.is_number();
  if (t == "string") return v.is_string();
  if (t == "boolean") return v.is_boolean();
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  if (t == "null") return v.is_null();
  return false;
}

std::string Bound(const json& b) {
  return b.is_number_float() ? absl::StrCat(b.get<double>()) : b.dump();
}

// "expected 1..86400", "expected >= 10", "expected a number in (0, 1]".
std::string RangeWords(const json& s, bool integer) {
  const json* lo = s.contains("minimum")            ? &s["minimum"]
                   : s.contains("exclusiveMinimum") ? &s["exclusiveMinimum"]
                                                    : nullptr;
  const json* hi = s.contains("maximum")            ? &s["maximum"]
                   : s.contains("exclusiveMaximum") ? &s["exclusiveMaximum"]
                                                    : nullptr;
  const bool lo_open = s.contains("exclusiveMinimum"), hi_open = s.contains("exclusiveMaximum");
  if (lo && hi) {
    if (integer && !lo_open && !hi_open) return absl::StrCat(Bound(*lo), "..", Bound(*hi));
    return absl::StrCat("a number in ", lo_open ? "(" : "[", Bound(*lo), ", ", Bound(*hi),
                        hi_open ? ")" : "]");
  }
  if (lo) return absl::StrCat(lo_open ? "> " : ">= ", Bound(*lo));
  return absl::StrCat(hi_open ? "< " : "<= ", Bound(*hi));
}

class Validator {
 public:
  explicit Validator(const json& root) : root_(root) {}

  absl::Status Check(const json& v, const json& s, const std::string& path) {
    if (!s.is_object())
      return absl::InternalError(absl::StrCat("schema at ", path, " is not an object"));
    const json* target = nullptr;  // $ref's siblings apply too (as from draft 2019-09 on)
    if (s.contains("$ref")) {
      KVCD_ASSIGN_OR_RETURN(target, Resolve(s["$ref"]));
      KVCD_RETURN_IF_ERROR(Check(v, *target, path));
    }
    for (const auto& [k, unused] : s.items()) {
      if (!Implemented().count(k)) {
        return absl::InternalError(absl::StrCat("config schema keyword '", k, "' at ", path,
                                                " is not implemented by kvcd's validator"));
      }
    }
    const std::string where = path.empty() ? "the config" : path;
    if (s.contains("type")) {
      bool ok = false;
      const json& type = s["type"];
      for (const json& t : type.is_array() ? type : json::array({type}))
        ok |= HasType(v, t.get<std::string>());
      if (!ok) {
        if (type == "object") return Invalid(where, " must be a mapping");
        if (type == "array") return Invalid(where, " must be a list");
        return Invalid(where, " has value ", Show(v), " of the wrong type; expected ",
                       TypeWords(type), v.is_number() && type == "string" ? " (quote it)" : "");
      }
    }
    if (s.contains("enum")) {
      bool found = false;
      std::vector<std::string> shown;
      for (const json& e : s["enum"]) {
        found |= e == v;
        shown.push_back(Show(e));
      }
      if (!found)
        return Invalid(where, " is ", Show(v), ", expected one of ", absl::StrJoin(shown, ", "));
    }
    if (v.is_number()) {
      const double x = v.get<double>();
      const auto num = [&](const char* k) { return s[k].get<double>(); };
      // Written so that NaN fails every bound.
      if ((s.contains("minimum") && !(x >= num("minimum"))) ||
          (s.contains("maximum") && !(x <= num("maximum"))) ||
          (s.contains("exclusiveMinimum") && !(x > num("exclusiveMinimum"))) ||
          (s.contains("exclusiveMaximum") && !(x < num("exclusiveMaximum")))) {
        return Invalid(where, " is ", Show(v), ", expected ", RangeWords(s, v.is_number_integer()));
      }
    }
    if (v.is_string()) {
      const std::string& str = v.get_ref<const std::string&>();
      if (s.contains("minLength") && str.size() < s["minLength"].get<size_t>()) {
        return Invalid(where, s["minLength"] == 1
                                  ? " must not be empty"
                                  : absl::StrCat(" must have at least ", s["minLength"].dump(),
                                                 " characters"));
      }
      if (s.contains("maxLength") && str.size() > s["maxLength"].get<size_t>()) {
        return Invalid(where, " is longer than ", s["maxLength"].dump(), " characters");
      }
      if (s.contains("pattern")) {
        bool match = false;
        if (str.size() <= kMaxPatternInput) {
          const std::regex re(s["pattern"].get<std::string>(), std::regex::ECMAScript);
          match = std::regex_search(str, re);
        }
        if (!match) {
          return Invalid(where, " is ", Show(v), ", expected ",
                         s.contains("description")
                             ? s["description"].get<std::string>()
                             : absl::StrCat("a match of ", s["pattern"].dump()));
        }
      }
    }
    if (v.is_array()) {
      if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) {
        return Invalid(where, " needs at least ", s["minItems"].dump(), " entries");
      }
      if (s.contains("items")) {
        for (size_t i = 0; i < v.size(); ++i) {
          KVCD_RETURN_IF_ERROR(Check(v[i], s["items"], absl::StrCat(path, "[", i, "]")));
        }
      }
    }
    if (v.is_object()) {
      static const json kEmpty = json::object();
      const json& props = s.contains("properties") ? s["properties"]
                          : target != nullptr && target->contains("properties")
                              ? (*target)["properties"]
                              : kEmpty;
      if (s.contains("additionalProperties") && s["additionalProperties"] == false) {
        for (const auto& [k, unused] : v.items()) {
          if (props.contains(k)) continue;
          std::vector<std::string> keys;
          for (const auto& [p, unused2] : props.items()) keys.push_back(p);
          return absl::InvalidArgumentError(absl::StrCat(
              "unknown key '", Child(path, k), "'; expected one of: ", absl::StrJoin(keys, ", ")));
        }
      }
      if (s.contains("required")) {
        for (const json& r : s["required"]) {
          const std::string k = r.get<std::string>();
          if (v.contains(k)) continue;
          std::string what;
          if (props.contains(k) && props[k].contains("description")) {
            what = absl::StrCat(" (", props[k]["description"].get<std::string>(), ")");
          }
          return absl::InvalidArgumentError(absl::StrCat(Child(path, k), " is missing", what));
        }
      }
      for (const auto& [k, sub] : props.items()) {
        if (v.contains(k)) KVCD_RETURN_IF_ERROR(Check(v[k], sub, Child(path, k)));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<const json*> Resolve(const json& ref) const {
    static const std::string kPrefix = "#/definitions/";
    const std::string r = ref.is_string() ? ref.get<std::string>() : "";
    if (r.rfind(kPrefix, 0) != 0 || !root_.contains("definitions") ||
        !root_["definitions"].contains(r.substr(kPrefix.size()))) {
      return absl::InternalError(
          absl::StrCat("config schema $ref ", ref.dump(), " does not name one of #/definitions"));
    }
    return &root_["definitions"][r.substr(kPrefix.size())];
  }

 private:
  template <class... A>
  static absl::Status Invalid(const std::string& where, const A&... a) {
    return absl::InvalidArgumentError(absl::StrCat(where, a...));
  }

  const json& root_;
};

absl::Status CheckKeywords(const Validator& v, const json& s, const std::string& at) {
  if (!s.is_object())
    return absl::InternalError(absl::StrCat("config schema at ", at, " is not an object"));
  for (const auto& [k, sub] : s.items()) {
    if (!Implemented().count(k)) {
      return absl::InternalError(absl::StrCat("config schema keyword '", k, "' at ", at,
                                              " is not implemented by kvcd's validator"));
    }
    if (k == "$ref") KVCD_RETURN_IF_ERROR(v.Resolve(sub).status());
    if (IsSchemaMap(k)) {
      for (const auto& [name, child] : sub.items()) {
        KVCD_RETURN_IF_ERROR(CheckKeywords(v, child, absl::StrCat(at, "/", k, "/", name)));
      }
    } else if (IsSubschema(k)) {
      KVCD_RETURN_IF_ERROR(CheckKeywords(v, sub, absl::StrCat(at, "/", k)));
    } else if (k == "pattern") {
      try {
        std::regex re(sub.get<std::string>(), std::regex::ECMAScript);
      } catch (const std::exception& e) {
        return absl::InternalError(absl::StrCat("config schema pattern at ", at, ": ", e.what()));
      }
    }
  }
  if (s.contains("additionalProperties") && s["additionalProperties"] != false) {
    return absl::InternalError(
        absl::StrCat("config schema at ", at, ": additionalProperties may only be false"));
  }
  return absl::OkStatus();
}

}  // namespace

const nlohmann::json& ConfigSchema() {
  static const json* schema = new json(json::parse(kConfigSchemaJson));
  return *schema;
}

absl::Status CheckSchemaKeywords(const nlohmann::json& schema) {
  return CheckKeywords(Validator(schema), schema, "#");
}

absl::Status ValidateJson(const nlohmann::json& doc, const nlohmann::json& schema) {
  return Validator(schema).Check(doc, schema, "");
}

}  // namespace kvcd
