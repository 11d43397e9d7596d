#include "tokenizer/chat_template/template_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace moat::chat_template_detail {

Value Value::make_dict(Dict d, Kind kind) {
  Value v = make(kind);
  v.dict = std::make_shared<Dict>(std::move(d));
  return v;
}

Value Value::callable(std::string name, std::function<Value(Args&, Kwargs&)> f) {
  Value v = make(Kind::kCallable);
  v.fn = std::make_shared<const Callable>(Callable{std::move(name), std::move(f)});
  return v;
}

const Value* Dict::find(const std::string& key) const {
  for (const auto& [k, v] : entries) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::set(const std::string& key, Value value) {
  for (auto& [k, v] : entries) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(key, std::move(value));
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kList: return "list";
    case Kind::kTuple: return "tuple";
    case Kind::kDict: return "dict";
    case Kind::kNamespace: return "Namespace";
    case Kind::kCallable: return "function";
  }
  return "?";
}

void fail_undefined(const Value& v) {
  if (v.s.empty()) throw TemplateError("value is undefined");
  throw TemplateError(v.s);
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool: return v.b;
    case Kind::kInt: return v.i != 0;
    case Kind::kFloat: return v.f != 0;
    case Kind::kString: return !v.s.empty();
    case Kind::kList:
    case Kind::kTuple: return !v.list->empty();
    case Kind::kDict: return !v.dict->entries.empty();
    case Kind::kNamespace:
    case Kind::kCallable: return true;
  }
  return false;
}

std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  // Shortest round-trip digits from to_chars, laid out the way Python's repr does: positional
  // for decimal exponents in [-4, 16), scientific ("1e+16", "1.5e-05") outside.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  int exp = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mant) {
    if (c != '.') digits += c;
  }
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      if (static_cast<int>(digits.size()) <= exp + 1) {
        out = digits + std::string(exp + 1 - digits.size(), '0') + ".0";
      } else {
        out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
      }
    } else {
      out = "0." + std::string(-exp - 1, '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return negative ? "-" + out : out;
}

namespace {

// Decodes one UTF-8 code point at s[i]; returns its byte length (1 for invalid bytes).
size_t decode_utf8(const std::string& s, size_t i, uint32_t* cp) {
  unsigned char c = s[i];
  size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + len > s.size()) len = 1;
  if (len == 1) {
    *cp = c;
    return 1;
  }
  uint32_t v = c & (0xFF >> (len + 1));
  for (size_t k = 1; k < len; ++k) v = (v << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  *cp = v;
  return len;
}

std::string repr_string(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    size_t len = decode_utf8(s, i, &cp);
    char buf[16];
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == static_cast<uint32_t>(quote)) {
      out += '\\';
      out += quote;
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) {
      // Python's str.isprintable() is false for these, so repr escapes them.
      std::snprintf(buf, sizeof(buf), "\\x%02x", cp);
      out += buf;
    } else if (cp == 0x2028 || cp == 0x2029) {
      std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
      out += buf;
    } else {
      out.append(s, i, len);
    }
    i += len;
  }
  out += quote;
  return out;
}

// Values nest (messages in lists in dicts), and a namespace can hold itself (`set ns.me = ns`):
// the recursive walks below (repr, tojson, comparison, from_json) stop at kMaxNesting levels with
// an error instead of overflowing the stack. Python stops at its recursion limit (1000) or with
// json's "Circular reference detected".
constexpr int kMaxNesting = 256;
thread_local int g_nesting = 0;
struct Nested {
  Nested() {
    if (++g_nesting > kMaxNesting) {
      --g_nesting;
      throw TemplateError("value nested deeper than " + std::to_string(kMaxNesting) +
                          " levels (or containing itself)");
    }
  }
  ~Nested() { --g_nesting; }
  Nested(const Nested&) = delete;
  Nested& operator=(const Nested&) = delete;
};

std::string join_repr(const List& items) {
  std::string out;
  for (size_t k = 0; k < items.size(); ++k) {
    if (k) out += ", ";
    out += to_repr(items[k]);
  }
  return out;
}

std::string dict_repr(const Dict& d) {
  std::string out = "{";
  for (size_t k = 0; k < d.entries.size(); ++k) {
    if (k) out += ", ";
    out += repr_string(d.entries[k].first) + ": " + to_repr(d.entries[k].second);
  }
  return out + "}";
}

}  // namespace

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return "";
    case Kind::kString: return v.s;
    default: return to_repr(v);
  }
}

std::string to_repr(const Value& v) {
  Nested nested;
  switch (v.kind) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "None";
    case Kind::kBool: return v.b ? "True" : "False";
    case Kind::kInt: return std::to_string(v.i);
    case Kind::kFloat: return float_repr(v.f);
    case Kind::kString: return repr_string(v.s);
    case Kind::kList: return "[" + join_repr(*v.list) + "]";
    case Kind::kTuple:
      return v.list->size() == 1 ? "(" + to_repr((*v.list)[0]) + ",)"
                                 : "(" + join_repr(*v.list) + ")";
    case Kind::kDict: return dict_repr(*v.dict);
    case Kind::kNamespace: return "<Namespace " + dict_repr(*v.dict) + ">";
    case Kind::kCallable: return "<function " + v.fn->name + ">";
  }
  return "";
}

namespace {
double as_double(const Value& v) {
  return v.kind == Kind::kFloat ? v.f : v.kind == Kind::kInt ? static_cast<double>(v.i) : v.b ? 1 : 0;
}
bool both_ints(const Value& a, const Value& b) {
  return (a.kind == Kind::kInt || a.kind == Kind::kBool) && (b.kind == Kind::kInt || b.kind == Kind::kBool);
}
int64_t as_int(const Value& v) { return v.kind == Kind::kInt ? v.i : v.b ? 1 : 0; }
}  // namespace

bool equals(const Value& a, const Value& b) {
  Nested nested;
  if (a.is_number() && b.is_number()) {
    if (both_ints(a, b)) return as_int(a) == as_int(b);
    return as_double(a) == as_double(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone: return true;
    case Kind::kString: return a.s == b.s;
    case Kind::kList:
    case Kind::kTuple: {
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k) {
        if (!equals((*a.list)[k], (*b.list)[k])) return false;
      }
      return true;
    }
    case Kind::kDict: {
      if (a.dict->entries.size() != b.dict->entries.size()) return false;
      for (const auto& [k, v] : a.dict->entries) {
        const Value* other = b.dict->find(k);
        if (!other || !equals(v, *other)) return false;
      }
      return true;
    }
    case Kind::kNamespace: return a.dict == b.dict;
    case Kind::kCallable: return a.fn == b.fn;
    default: return false;
  }
}

bool less_than(const Value& a, const Value& b) {
  Nested nested;
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    if (both_ints(a, b)) return as_int(a) < as_int(b);
    return as_double(a) < as_double(b);
  }
  if (a.is_string() && b.is_string()) return a.s < b.s;  // UTF-8 byte order = code point order
  if (a.kind == b.kind && a.is_sequence()) {
    const List& x = *a.list;
    const List& y = *b.list;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      if (!equals(x[k], y[k])) return less_than(x[k], y[k]);
    }
    return x.size() < y.size();
  }
  throw TemplateError("'<' not supported between instances of '" + type_name(a) + "' and '" +
                      type_name(b) + "'");
}

Value from_json(const nlohmann::ordered_json& j) {
  Nested nested;
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::integer(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(from_json(x));
      return Value::make_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      d.entries.reserve(j.size());
      for (const auto& [k, x] : j.items()) d.entries.emplace_back(k, from_json(x));
      return Value::make_dict(std::move(d));
    }
    default: return Value::none();
  }
}

namespace {

void json_string(const std::string& s, bool ensure_ascii, std::string* out) {
  *out += '"';
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    size_t len = decode_utf8(s, i, &cp);
    char buf[16];
    switch (cp) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      case '\b': *out += "\\b"; break;
      case '\f': *out += "\\f"; break;
      default:
        if (cp < 0x20 || (ensure_ascii && cp >= 0x7F)) {
          if (cp >= 0x10000) {
            uint32_t v = cp - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
          }
          *out += buf;
        } else {
          out->append(s, i, len);
        }
    }
    i += len;
  }
  *out += '"';
}

void json_value(const Value& v, const JsonOptions& o, int level, std::string* out) {
  Nested nested;
  auto newline = [&](int lvl) {
    if (o.indent >= 0) *out += "\n" + std::string(static_cast<size_t>(o.indent * lvl), ' ');
  };
  switch (v.kind) {
    case Kind::kNone: *out += "null"; return;
    case Kind::kBool: *out += v.b ? "true" : "false"; return;
    case Kind::kInt: *out += std::to_string(v.i); return;
    case Kind::kFloat:
      if (std::isnan(v.f)) *out += "NaN";
      else if (std::isinf(v.f)) *out += v.f < 0 ? "-Infinity" : "Infinity";
      else *out += float_repr(v.f);
      return;
    case Kind::kString: json_string(v.s, o.ensure_ascii, out); return;
    case Kind::kList:
    case Kind::kTuple: {
      if (v.list->empty()) {
        *out += "[]";
        return;
      }
      *out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) *out += o.item_separator;
        newline(level + 1);
        json_value((*v.list)[k], o, level + 1, out);
      }
      newline(level);
      *out += ']';
      return;
    }
    case Kind::kDict: {
      if (v.dict->entries.empty()) {
        *out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.dict->entries) entries.push_back(&e);
      if (o.sort_keys) {
        std::stable_sort(entries.begin(), entries.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      }
      *out += '{';
      for (size_t k = 0; k < entries.size(); ++k) {
        if (k) *out += o.item_separator;
        newline(level + 1);
        json_string(entries[k]->first, o.ensure_ascii, out);
        *out += o.key_separator;
        json_value(entries[k]->second, o, level + 1, out);
      }
      newline(level);
      *out += '}';
      return;
    }
    default:
      throw TemplateError("Object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  json_value(v, options, 0, &out);
  return out;
}

std::vector<std::string> split_code_points(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    size_t len = decode_utf8(s, i, &cp);
    out.push_back(s.substr(i, len));
    i += len;
  }
  return out;
}

size_t code_point_count(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace moat::chat_template_detail
