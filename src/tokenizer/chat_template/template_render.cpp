// Tree-walking evaluator for parsed chat templates, with jinja2's semantics where chat templates
// can observe them:
//   - scopes: a for-loop iteration and a macro call each get a fresh scope, so `set` inside them
//     does not leak out (templates use namespace() for that); `if` opens no scope;
//   - default Undefined: prints as "", is falsy, iterates as empty, compares equal only to
//     Undefined; any other use (attribute, item, call, arithmetic) is an error naming the variable;
//   - attribute access tries Python attributes (dict.get, str.split...) before keys, subscripts
//     try keys first, as jinja2's Environment.getattr/getitem do;
//   - the immutable sandbox: list.append, dict.update and other mutators yield an "unsafe"
//     Undefined whose use fails with transformers' message.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <unordered_map>
#include <unordered_set>

#include "tokenizer/chat_template/chat_template.h"
#include "tokenizer/chat_template/template_ast.h"

namespace moat::chat_template_detail {
namespace {

[[noreturn]] void type_error(const std::string& message) { throw TemplateError(message); }

// Limits that jinja2 does not have but a renderer fed templates from downloaded checkpoints
// needs, so that a hostile template ends in an error rather than a hang or an OOM kill. Real
// chat templates stay orders of magnitude below them (a 1000-message conversation through the
// largest template in shared/testdata takes ~10^5 steps and ~10^5 bytes).
constexpr int64_t kMaxSteps = 2'000'000;  // statements and loop iterations per render
// Stack a render may use. The parse limits (blocks 100 deep, expressions 500) and the macro depth
// (256) multiply at run time: a macro calling itself from inside nested blocks overflowed the
// stack (found by fuzz_chat_template). Real templates use a few KiB; threads have 8 MiB.
constexpr uintptr_t kMaxStackBytes = 2 << 20;
constexpr size_t kMaxStringBytes = 64 << 20;  // any string the template builds, the output included

void check_string_size(size_t bytes) {
  if (bytes > kMaxStringBytes)
    type_error("the template builds a string of " + std::to_string(bytes) + " bytes; the limit is " +
               std::to_string(kMaxStringBytes));
}

// Python ints are unbounded; template integers are int64, and an overflow is an error. Call it
// after the __builtin_*_overflow that sets the result, not in the same expression.
int64_t checked(bool overflowed, int64_t value, const char* op) {
  if (overflowed) type_error(std::string("integer overflow in '") + op + "' (template integers are 64-bit)");
  return value;
}

// A float to int64 as Python's int() would, where it fits.
int64_t float_to_int(double f) {
  if (!std::isfinite(f) || f >= 9223372036854775808.0 || f < -9223372036854775808.0)
    type_error("cannot convert float " + std::to_string(f) + " to a 64-bit integer");
  return static_cast<int64_t>(f);
}

// ----------------------------------------------------------------------------------------------
// String helpers (Python str methods on UTF-8).

bool py_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' ||
         (c >= '\x1c' && c <= '\x1f');
}

// Simple case mapping for ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic: the scripts chat
// text commonly has. Special cases Python also handles (ß -> SS, final sigma, Turkish i) are not.
uint32_t map_case(uint32_t c, bool upper) {
  if (upper) {
    if (c >= 'a' && c <= 'z') return c - 32;
    if ((c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 32;
    if (c == 0xFF) return 0x178;
    if (c >= 0x100 && c <= 0x17F && c != 0x130 && c != 0x131 && c != 0x138 && c != 0x149 && c != 0x17F) {
      bool odd_is_lower = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
      if ((c % 2 == 1) == odd_is_lower) return c;
      return c - 1;
    }
    if (c >= 0x3B1 && c <= 0x3C9 && c != 0x3C2) return c - 32;
    if (c >= 0x430 && c <= 0x44F) return c - 32;
    if (c >= 0x450 && c <= 0x45F) return c - 80;
    return c;
  }
  if (c >= 'A' && c <= 'Z') return c + 32;
  if ((c >= 0xC0 && c <= 0xDE && c != 0xD7)) return c + 32;
  if (c == 0x178) return 0xFF;
  if (c >= 0x100 && c <= 0x17F && c != 0x130 && c != 0x131 && c != 0x138 && c != 0x149 && c != 0x17F) {
    bool odd_is_lower = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
    if ((c % 2 == 1) == odd_is_lower) return c + 1;
    return c;
  }
  if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 32;
  if (c >= 0x410 && c <= 0x42F) return c + 32;
  if (c >= 0x400 && c <= 0x40F) return c + 80;
  return c;
}

std::string change_case(const std::string& s, bool upper) {
  std::string out;
  for (const std::string& cp : split_code_points(s)) {
    unsigned char b0 = cp[0];
    uint32_t c = b0;
    if (cp.size() == 2) c = ((b0 & 0x1F) << 6) | (static_cast<unsigned char>(cp[1]) & 0x3F);
    if (cp.size() > 2 || (cp.size() == 1 && b0 >= 0x80)) {
      out += cp;
      continue;
    }
    uint32_t m = map_case(c, upper);
    if (m < 0x80) {
      out += static_cast<char>(m);
    } else {
      out += static_cast<char>(0xC0 | (m >> 6));
      out += static_cast<char>(0x80 | (m & 0x3F));
    }
  }
  return out;
}

std::string to_lower(const std::string& s) { return change_case(s, false); }
std::string to_upper(const std::string& s) { return change_case(s, true); }

std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
  auto strip_it = [&](char c) {
    if (chars.is_none() || chars.is_undefined()) return py_space(c);
    return chars.s.find(c) != std::string::npos;
  };
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e && strip_it(s[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(s[e - 1])) --e;
  }
  return s.substr(b, e - b);
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string out;
  if (from.empty()) {
    // Python inserts `to` between every character (and at both ends).
    auto cps = split_code_points(s);
    int64_t done = 0;
    for (const auto& cp : cps) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      out += cp;
    }
    if (count < 0 || done < count) out += to;
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t f = s.find(from, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += to;
    pos = f + from.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

Value str_list(const std::vector<std::string>& parts) {
  List items;
  for (const auto& p : parts) items.push_back(Value::string(p));
  return Value::make_list(std::move(items));
}

std::vector<std::string> py_split(const std::string& s, const Value& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep.is_none() || sep.is_undefined()) {
    size_t i = 0, n = s.size();
    while (true) {
      while (i < n && py_space(s[i])) ++i;
      if (i >= n) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
        out.push_back(s.substr(i));
        break;
      }
      size_t j = i;
      while (j < n && !py_space(s[j])) ++j;
      out.push_back(s.substr(i, j - i));
      i = j;
    }
    return out;
  }
  if (!sep.is_string()) type_error("must be str or None, not " + type_name(sep));
  if (sep.s.empty()) type_error("empty separator");
  size_t pos = 0;
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    size_t f = s.find(sep.s, pos);
    if (f == std::string::npos) break;
    out.push_back(s.substr(pos, f - pos));
    pos = f + sep.s.size();
  }
  out.push_back(s.substr(pos));
  return out;
}

std::vector<std::string> py_rsplit(const std::string& s, const Value& sep, int64_t maxsplit) {
  if (maxsplit < 0) return py_split(s, sep, maxsplit);
  std::vector<std::string> out;
  if (sep.is_none() || sep.is_undefined()) {
    int64_t j = static_cast<int64_t>(s.size());
    while (true) {
      while (j > 0 && py_space(s[j - 1])) --j;
      if (j <= 0) break;
      if (static_cast<int64_t>(out.size()) >= maxsplit) {
        out.push_back(s.substr(0, j));
        break;
      }
      int64_t i = j;
      while (i > 0 && !py_space(s[i - 1])) --i;
      out.push_back(s.substr(i, j - i));
      j = i;
    }
    std::reverse(out.begin(), out.end());
    return out;
  }
  if (!sep.is_string()) type_error("must be str or None, not " + type_name(sep));
  if (sep.s.empty()) type_error("empty separator");
  size_t end = s.size();
  while (static_cast<int64_t>(out.size()) < maxsplit) {
    if (end < sep.s.size()) break;
    size_t f = s.rfind(sep.s, end - sep.s.size());
    if (f == std::string::npos) break;
    out.push_back(s.substr(f + sep.s.size(), end - f - sep.s.size()));
    end = f;
  }
  out.push_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

std::string capitalize(const std::string& s) {
  auto cps = split_code_points(s);
  std::string out;
  for (size_t k = 0; k < cps.size(); ++k) out += change_case(cps[k], k == 0);
  return out;
}

// Python str.title(): a cased character after an uncased one is upper-cased, the rest lowered.
std::string title_case(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (const std::string& cp : split_code_points(s)) {
    std::string up = change_case(cp, true), low = change_case(cp, false);
    bool cased = up != low || std::isalpha(static_cast<unsigned char>(cp[0]));
    out += cased ? (prev_cased ? low : up) : cp;
    prev_cased = cased;
  }
  return out;
}

// ----------------------------------------------------------------------------------------------
// Argument binding for builtins: positional index or keyword name, like a Python signature.

class Params {
 public:
  Params(const char* fn, Args& args, Kwargs& kwargs, std::vector<const char*> names)
      : fn_(fn), args_(args), kwargs_(kwargs), names_(std::move(names)) {
    if (args_.size() > names_.size()) {
      type_error(std::string(fn_) + "() takes at most " + std::to_string(names_.size()) + " arguments (" +
                 std::to_string(args_.size()) + " given)");
    }
    for (const auto& kv : kwargs_) {
      const auto& k = kv.first;  // a plain reference: clang < 16 cannot capture structured bindings
      if (std::find_if(names_.begin(), names_.end(), [&](const char* n) { return k == n; }) == names_.end()) {
        type_error(std::string(fn_) + "() got an unexpected keyword argument '" + k + "'");
      }
    }
  }
  bool has(size_t index) const {
    if (index < args_.size()) return true;
    for (const auto& [k, v] : kwargs_) {
      if (k == names_[index]) return true;
    }
    return false;
  }
  Value get(size_t index, Value fallback = Value::none()) const {
    if (index < args_.size()) return args_[index];
    for (const auto& [k, v] : kwargs_) {
      if (k == names_[index]) return v;
    }
    return fallback;
  }
  Value required(size_t index) const {
    if (!has(index)) type_error(std::string(fn_) + "() missing required argument '" + names_[index] + "'");
    return get(index);
  }

 private:
  const char* fn_;
  Args& args_;
  Kwargs& kwargs_;
  std::vector<const char*> names_;
};

int64_t to_int_arg(const Value& v, const char* what) {
  if (v.kind == Kind::kInt) return v.i;
  if (v.kind == Kind::kBool) return v.b;
  if (v.is_undefined()) fail_undefined(v);
  type_error(std::string(what) + " must be an integer, not " + type_name(v));
}

const std::string& str_arg(const Value& v, const char* what) {
  if (v.is_undefined()) fail_undefined(v);
  if (!v.is_string()) type_error(std::string(what) + " must be str, not " + type_name(v));
  return v.s;
}

List iterate(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return {};
    case Kind::kList:
    case Kind::kTuple: return *v.list;
    case Kind::kDict: {
      List keys;
      for (const auto& [k, x] : v.dict->entries) keys.push_back(Value::string(k));
      return keys;
    }
    case Kind::kString: {
      List chars;
      for (auto& c : split_code_points(v.s)) chars.push_back(Value::string(std::move(c)));
      return chars;
    }
    default: type_error("'" + type_name(v) + "' object is not iterable");
  }
}

int64_t length_of(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return 0;
    case Kind::kString: return static_cast<int64_t>(code_point_count(v.s));
    case Kind::kList:
    case Kind::kTuple: return static_cast<int64_t>(v.list->size());
    case Kind::kDict:
    case Kind::kNamespace: return static_cast<int64_t>(v.dict->entries.size());
    default: type_error("object of type '" + type_name(v) + "' has no len()");
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Kind::kUndefined: return false;
    case Kind::kString:
      if (!item.is_string()) {
        type_error("'in <string>' requires string as left operand, not " + type_name(item));
      }
      return container.s.find(item.s) != std::string::npos;
    case Kind::kList:
    case Kind::kTuple:
      return std::any_of(container.list->begin(), container.list->end(),
                         [&](const Value& x) { return equals(x, item); });
    case Kind::kDict: return item.is_string() && container.dict->find(item.s) != nullptr;
    default: type_error("argument of type '" + type_name(container) + "' is not iterable");
  }
}

// jinja2's object_type_repr, for "'dict object' has no attribute 'x'".
std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  return type_name(v) + " object";
}

Value missing_attribute(const Value& obj, const std::string& name) {
  return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + name + "'");
}

Value unsafe_attribute(const Value& obj, const std::string& name) {
  Value v = Value::undefined("access to attribute '" + name + "' of '" + type_name(obj) + "' object is unsafe.");
  v.unsafe = true;
  return v;
}

Value make_tuple(Value a, Value b) { return Value::make_list({std::move(a), std::move(b)}, Kind::kTuple); }

// Python slice semantics (negative bounds, negative steps) over n elements.
std::vector<int64_t> slice_indices(int64_t n, const Value& start_v, const Value& stop_v, const Value& step_v) {
  int64_t step = step_v.is_none() ? 1 : to_int_arg(step_v, "slice step");
  if (step == 0) type_error("slice step cannot be zero");
  int64_t start, stop;
  auto clamp = [&](const Value& v, int64_t def) {
    if (v.is_none()) return def;
    int64_t x = to_int_arg(v, "slice index");
    if (x < 0) x += n;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  start = clamp(start_v, step > 0 ? 0 : n - 1);
  stop = clamp(stop_v, step > 0 ? n : -1);
  std::vector<int64_t> out;
  if (step > 0) {
    for (int64_t k = start; k < stop; k += step) out.push_back(k);
  } else {
    for (int64_t k = start; k > stop; k += step) out.push_back(k);
  }
  return out;
}

// Python's %-formatting, for the `format` filter and `str % args`: %s %r %d %i %f %x %%.
std::string percent_format(const std::string& fmt, const List& args) {
  std::string out;
  size_t next = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    size_t j = i + 1;
    std::string spec;
    while (j < fmt.size() && std::strchr("-+ #0123456789.", fmt[j])) spec += fmt[j++];
    if (j >= fmt.size()) type_error("incomplete format");
    char conv = fmt[j];
    i = j;
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (next >= args.size()) type_error("not enough arguments for format string");
    const Value& a = args[next++];
    char buf[128];
    switch (conv) {
      case 's': out += to_str(a); break;
      case 'r': out += to_repr(a); break;
      case 'd':
      case 'i': {
        if (!a.is_number()) type_error("%d format: a real number is required, not " + type_name(a));
        int64_t x = a.kind == Kind::kFloat ? float_to_int(a.f) : a.kind == Kind::kBool ? a.b : a.i;
        std::snprintf(buf, sizeof(buf), ("%" + spec + "lld").c_str(), static_cast<long long>(x));
        out += buf;
        break;
      }
      case 'f':
      case 'e':
      case 'g': {
        if (!a.is_number()) type_error("must be real number, not " + type_name(a));
        double x = a.kind == Kind::kFloat ? a.f : a.kind == Kind::kBool ? a.b : static_cast<double>(a.i);
        std::snprintf(buf, sizeof(buf), ("%" + spec + conv).c_str(), x);
        out += buf;
        break;
      }
      case 'x': {
        std::snprintf(buf, sizeof(buf), ("%" + spec + "llx").c_str(), static_cast<long long>(to_int_arg(a, "%x")));
        out += buf;
        break;
      }
      default: type_error(std::string("unsupported format character '") + conv + "'");
    }
  }
  if (next < args.size()) type_error("not all arguments converted during string formatting");
  return out;
}

// Python str.format with auto/explicit positional and keyword fields (no format specs).
std::string brace_format(const std::string& fmt, Args& args, Kwargs& kwargs) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '{' && i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
    } else if (c == '}' && i + 1 < fmt.size() && fmt[i + 1] == '}') {
      out += '}';
      ++i;
    } else if (c == '{') {
      size_t end = fmt.find('}', i);
      if (end == std::string::npos) type_error("Single '{' encountered in format string");
      std::string field = fmt.substr(i + 1, end - i - 1);
      if (field.find(':') != std::string::npos || field.find('!') != std::string::npos) {
        type_error("format specs in str.format are not supported");
      }
      const Value* v = nullptr;
      if (field.empty()) {
        if (auto_index >= args.size()) type_error("Replacement index out of range");
        v = &args[auto_index++];
      } else if (std::all_of(field.begin(), field.end(), ::isdigit)) {
        if (field.size() > 9) type_error("Replacement index out of range");
        size_t k = std::stoul(field);
        if (k >= args.size()) type_error("Replacement index out of range");
        v = &args[k];
      } else {
        for (const auto& [name, x] : kwargs) {
          if (name == field) v = &x;
        }
        if (!v) type_error("KeyError: '" + field + "'");
      }
      out += to_str(*v);
      i = end;
    } else if (c == '}') {
      type_error("Single '}' encountered in format string");
    } else {
      out += c;
    }
  }
  return out;
}

Value call_string_method(const std::string& s, const std::string& name, Args& args, Kwargs& kw) {
  if (name == "startswith" || name == "endswith") {
    Params p(name.c_str(), args, kw, {"prefix", "start", "end"});
    Value prefix = p.required(0);
    List options = prefix.kind == Kind::kTuple ? *prefix.list : List{prefix};
    for (const auto& o : options) {
      const std::string& x = str_arg(o, name.c_str());
      bool hit = name == "startswith" ? s.compare(0, x.size(), x) == 0
                                      : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
      if (hit) return Value::boolean(true);
    }
    return Value::boolean(false);
  }
  if (name == "split" || name == "rsplit") {
    Params p(name.c_str(), args, kw, {"sep", "maxsplit"});
    int64_t maxsplit = to_int_arg(p.get(1, Value::integer(-1)), "maxsplit");
    return str_list(name == "split" ? py_split(s, p.get(0), maxsplit) : py_rsplit(s, p.get(0), maxsplit));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    Params p(name.c_str(), args, kw, {"chars"});
    return Value::string(strip_chars(s, p.get(0), name != "rstrip", name != "lstrip"));
  }
  if (name == "replace") {
    Params p("replace", args, kw, {"old", "new", "count"});
    return Value::string(replace_all(s, str_arg(p.required(0), "old"), str_arg(p.required(1), "new"),
                                     to_int_arg(p.get(2, Value::integer(-1)), "count")));
  }
  if (name == "upper") return Value::string(to_upper(s));
  if (name == "lower" || name == "casefold") return Value::string(to_lower(s));
  if (name == "capitalize") return Value::string(capitalize(s));
  if (name == "title") return Value::string(title_case(s));
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    Params p(name.c_str(), args, kw, {"sub"});
    const Value sub_value = p.required(0);  // str_arg returns a reference into its argument
    const std::string& sub = str_arg(sub_value, "sub");
    if (name == "count") {
      if (sub.empty()) return Value::integer(static_cast<int64_t>(code_point_count(s)) + 1);
      int64_t n = 0;
      for (size_t pos = s.find(sub); pos != std::string::npos; pos = s.find(sub, pos + sub.size())) ++n;
      return Value::integer(n);
    }
    size_t f = (name == "find" || name == "index") ? s.find(sub) : s.rfind(sub);
    if (f == std::string::npos) {
      if (name == "index" || name == "rindex") type_error("substring not found");
      return Value::integer(-1);
    }
    return Value::integer(static_cast<int64_t>(code_point_count(s.substr(0, f))));
  }
  if (name == "join") {
    Params p("join", args, kw, {"iterable"});
    std::string out;
    List items = iterate(p.required(0));
    for (size_t k = 0; k < items.size(); ++k) {
      if (k) out += s;
      out += str_arg(items[k], "sequence item");
    }
    return Value::string(out);
  }
  if (name == "format") return Value::string(brace_format(s, args, kw));
  if (name == "splitlines") {
    std::vector<std::string> lines;
    size_t start = 0;
    for (size_t k = 0; k < s.size(); ++k) {
      if (s[k] == '\n' || s[k] == '\r') {
        lines.push_back(s.substr(start, k - start));
        if (s[k] == '\r' && k + 1 < s.size() && s[k + 1] == '\n') ++k;
        start = k + 1;
      }
    }
    if (start < s.size()) lines.push_back(s.substr(start));
    return str_list(lines);
  }
  auto all_of = [&](auto pred) {
    return Value::boolean(!s.empty() && std::all_of(s.begin(), s.end(), [&](char c) { return pred(static_cast<unsigned char>(c)); }));
  };
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric") return all_of(::isdigit);
  if (name == "isalpha") return all_of(::isalpha);
  if (name == "isalnum") return all_of(::isalnum);
  if (name == "isspace") return all_of([](unsigned char c) { return py_space(static_cast<char>(c)); });
  if (name == "islower") return Value::boolean(s != to_upper(s) && s == to_lower(s));
  if (name == "isupper") return Value::boolean(s != to_lower(s) && s == to_upper(s));
  type_error("'str' object has no attribute '" + name + "'");
}

const std::unordered_set<std::string>& string_methods() {
  static const std::unordered_set<std::string> names = {
      "startswith", "endswith", "split", "rsplit", "strip", "lstrip", "rstrip", "replace", "upper",
      "lower", "casefold", "capitalize", "title", "find", "rfind", "index", "rindex", "count", "join",
      "format", "splitlines", "isdigit", "isdecimal", "isnumeric", "isalpha", "isalnum", "isspace",
      "islower", "isupper"};
  return names;
}

// ----------------------------------------------------------------------------------------------

const std::unordered_set<std::string>& filter_names() {
  static const std::unordered_set<std::string> names = {
      "abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e", "escape", "first",
      "float", "forceescape", "format", "from_json", "indent", "int", "items", "join", "last",
      "length", "list", "lower", "map", "max", "min", "pprint", "reject", "rejectattr", "replace",
      "reverse", "round", "safe", "select", "selectattr", "sort", "string", "sum", "title",
      "tojson", "trim", "unique", "upper", "wordcount"};
  return names;
}

const std::unordered_set<std::string>& test_names() {
  static const std::unordered_set<std::string> names = {
      "boolean", "callable", "defined", "divisibleby", "eq", "==", "equalto", "escaped", "even",
      "false", "filter", "float", "ge", ">=", "gt", ">", "greaterthan", "in", "integer", "iterable",
      "le", "<=", "lower", "lt", "<", "lessthan", "mapping", "ne", "!=", "none", "number", "odd",
      "sameas", "sequence", "string", "test", "true", "undefined", "upper"};
  return names;
}

enum class Flow { kNormal, kBreak, kContinue };

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
};

class Renderer {
 public:
  explicit Renderer(const Value& context) {
    root_ = std::make_shared<Scope>();
    for (const auto& [k, v] : context.dict->entries) root_->vars[k] = v;
    scope_ = root_;
    install_globals();
  }
  // Macros close over their defining scope, which holds them, and a namespace can hold itself
  // (`set ns.me = ns`): reference cycles that would leak every render. Emptying the scopes and
  // namespaces breaks them; no value outlives the renderer (render returns text).
  ~Renderer() {
    for (const auto& scope : closures_) scope->vars.clear();
    for (const auto& ns : namespaces_) ns->entries.clear();
    root_->vars.clear();
  }
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;

  std::string run(const Template& t) {
    std::string out;
    out_ = &out;
    stack_base_ = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
    exec(t.body);
    return out;
  }

 private:
  // ---------------------------------------------------------------- statements
  Flow exec(const Body& body) {
    for (const auto& s : body) {
      Flow f = exec(*s);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  // exec and eval are the recursion every nesting goes through: each checks the stack used.
  void check_stack() const {
    const uintptr_t here = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
    if (stack_base_ > here && stack_base_ - here > kMaxStackBytes)
      type_error("the template nests too deeply (over " + std::to_string(kMaxStackBytes >> 20) +
                 " MiB of stack: recursive macros?)");
  }

  Flow exec(const Stmt& s) {
    check_stack();
    if (++steps_ > kMaxSteps)
      type_error("the template ran more than " + std::to_string(kMaxSteps) + " steps (a loop that does not end?)");
    try {
      return exec_inner(s);
    } catch (TemplateError& e) {
      if (e.line == 0) e.line = s.line;
      throw;
    }
  }

  Flow exec_inner(const Stmt& s) {
    switch (s.kind) {
      case StmtKind::kText:
        *out_ += s.text;
        check_string_size(out_->size());
        return Flow::kNormal;
      case StmtKind::kOutput:
        *out_ += to_str(eval(*s.expr));
        check_string_size(out_->size());
        return Flow::kNormal;
      case StmtKind::kIf:
        for (size_t k = 0; k < s.conds.size(); ++k) {
          if (truthy(eval(*s.conds[k]))) return exec(s.bodies[k]);
        }
        if (s.bodies.size() > s.conds.size()) return exec(s.bodies.back());
        return Flow::kNormal;
      case StmtKind::kFor: exec_for(s); return Flow::kNormal;
      case StmtKind::kSet: {
        Value v = eval(*s.expr);
        if (s.attr_target) {
          Value ns = eval(*s.attr_target->items[0]);
          if (ns.kind != Kind::kNamespace) type_error("cannot assign attribute on non-namespace object");
          ns.dict->set(s.attr_target->name, std::move(v));
        } else {
          assign(s.targets, s.tuple_target, v, scope_.get());
        }
        return Flow::kNormal;
      }
      case StmtKind::kSetBlock: {
        Value v = Value::string(capture(s.bodies[0]));
        if (s.expr) v = eval_filter(*s.expr, &v);
        scope_->vars[s.text] = std::move(v);
        return Flow::kNormal;
      }
      case StmtKind::kMacro: scope_->vars[s.text] = make_macro(s, s.text); return Flow::kNormal;
      case StmtKind::kCallBlock: {
        Value caller = make_macro(s, "caller");
        const Expr& call = *s.expr;
        Value fn = eval(*call.items[0]);
        Args args;
        Kwargs kwargs;
        eval_args(call, &args, &kwargs);
        kwargs.emplace_back("caller", caller);
        *out_ += to_str(invoke(fn, args, kwargs));
        return Flow::kNormal;
      }
      case StmtKind::kFilterBlock: {
        Value v = Value::string(capture(s.bodies[0]));
        *out_ += to_str(eval_filter(*s.expr, &v));
        return Flow::kNormal;
      }
      case StmtKind::kBreak: return Flow::kBreak;
      case StmtKind::kContinue: return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  std::string capture(const Body& body) {
    std::string buf;
    std::string* saved = out_;
    out_ = &buf;
    exec(body);
    out_ = saved;
    return buf;
  }

  void assign(const std::vector<std::string>& targets, bool unpack, const Value& v, Scope* scope) {
    if (!unpack) {
      scope->vars[targets[0]] = v;
      return;
    }
    List items = iterate(v);
    if (items.size() != targets.size()) {
      type_error(items.size() > targets.size()
                     ? "too many values to unpack (expected " + std::to_string(targets.size()) + ")"
                     : "not enough values to unpack (expected " + std::to_string(targets.size()) + ", got " +
                           std::to_string(items.size()) + ")");
    }
    for (size_t k = 0; k < targets.size(); ++k) scope->vars[targets[k]] = items[k];
  }

  void exec_for(const Stmt& s) {
    List items = iterate(eval(*s.expr));
    std::shared_ptr<Scope> outer = scope_;
    if (s.cond) {
      // `for x in xs if cond`: the loop (and loop.length) sees only the items that pass.
      List kept;
      for (const auto& item : items) {
        scope_ = std::make_shared<Scope>(Scope{{}, outer});
        assign(s.targets, s.tuple_target, item, scope_.get());
        if (truthy(eval(*s.cond))) kept.push_back(item);
      }
      scope_ = outer;
      items = std::move(kept);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      if (++steps_ > kMaxSteps)
        type_error("the template ran more than " + std::to_string(kMaxSteps) + " steps (a loop that does not end?)");
      scope_ = std::make_shared<Scope>(Scope{{}, outer});
      assign(s.targets, s.tuple_target, items[k], scope_.get());
      scope_->vars["loop"] = make_loop(items, k);
      Flow f = exec(s.bodies[0]);
      if (f == Flow::kBreak) break;
    }
    scope_ = outer;
    if (n == 0 && s.bodies.size() > 1) exec(s.bodies[1]);
  }

  Value make_loop(const List& items, int64_t k) {
    const int64_t n = static_cast<int64_t>(items.size());
    Dict d;
    d.entries = {
        {"index", Value::integer(k + 1)},
        {"index0", Value::integer(k)},
        {"revindex", Value::integer(n - k)},
        {"revindex0", Value::integer(n - k - 1)},
        {"first", Value::boolean(k == 0)},
        {"last", Value::boolean(k == n - 1)},
        {"length", Value::integer(n)},
        {"depth", Value::integer(1)},
        {"depth0", Value::integer(0)},
        {"previtem", k > 0 ? items[k - 1] : Value::undefined("there is no previous item")},
        {"nextitem", k + 1 < n ? items[k + 1] : Value::undefined("there is no next item")},
    };
    d.entries.emplace_back("cycle", Value::callable("loop.cycle", [k](Args& args, Kwargs&) {
                             if (args.empty()) type_error("no items for cycling given");
                             return args[k % args.size()];
                           }));
    return Value::make_dict(std::move(d));
  }

  // A macro (or a call block's `caller`) is a callable closing over the scope it was defined in.
  Value make_macro(const Stmt& s, const std::string& name) {
    std::shared_ptr<Scope> closure = scope_;
    if (closures_.empty() || closures_.back() != closure) closures_.push_back(closure);
    const Stmt* def = &s;
    return Value::callable(name, [this, def, closure, name](Args& args, Kwargs& kwargs) {
      if (++depth_ > 256) type_error("macro recursion too deep in '" + name + "'");
      const auto& params = def->targets;
      if (args.size() > params.size()) {
        type_error("macro '" + name + "' takes not more than " + std::to_string(params.size()) + " argument(s)");
      }
      auto local = std::make_shared<Scope>(Scope{{}, closure});
      std::shared_ptr<Scope> saved_scope = scope_;
      scope_ = local;
      for (const auto& [k, v] : kwargs) {
        if (k == "caller") {
          local->vars["caller"] = v;
        } else if (std::find(params.begin(), params.end(), k) == params.end()) {
          type_error("macro '" + name + "' takes no keyword argument '" + k + "'");
        }
      }
      for (size_t p = 0; p < params.size(); ++p) {
        const Value* kw = nullptr;
        for (const auto& [k, v] : kwargs) {
          if (k == params[p]) kw = &v;
        }
        if (p < args.size()) {
          if (kw) type_error("macro '" + name + "' got multiple values for argument '" + params[p] + "'");
          local->vars[params[p]] = args[p];
        } else if (kw) {
          local->vars[params[p]] = *kw;
        } else if (def->kind == StmtKind::kMacro && def->defaults[p]) {
          local->vars[params[p]] = eval(*def->defaults[p]);
        } else if (def->kind == StmtKind::kCallBlock && p < def->defaults.size() && def->defaults[p]) {
          local->vars[params[p]] = eval(*def->defaults[p]);
        } else {
          local->vars[params[p]] = Value::undefined("parameter '" + params[p] + "' was not provided");
        }
      }
      std::string body = capture(def->bodies[0]);
      scope_ = saved_scope;
      --depth_;
      return Value::string(std::move(body));
    });
  }

  // ---------------------------------------------------------------- expressions
  Value lookup(const std::string& name) const {
    for (const Scope* s = scope_.get(); s; s = s->parent.get()) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return it->second;
    }
    auto it = globals_.find(name);
    if (it != globals_.end()) return it->second;
    return Value::undefined("'" + name + "' is undefined");
  }

  Value eval(const Expr& e) {
    check_stack();
    try {
      return eval_inner(e);
    } catch (TemplateError& err) {
      if (err.line == 0) err.line = e.line;
      throw;
    }
  }

  void eval_args(const Expr& e, Args* args, Kwargs* kwargs) {
    for (size_t k = 1; k <= e.num_args; ++k) args->push_back(eval(*e.items[k]));
    for (const auto& [name, x] : e.kwargs) kwargs->emplace_back(name, eval(*x));
  }

  Value invoke(const Value& fn, Args& args, Kwargs& kwargs) {
    if (fn.is_undefined()) fail_undefined(fn);
    if (fn.kind != Kind::kCallable) type_error("'" + type_name(fn) + "' object is not callable");
    return fn.fn->call(args, kwargs);
  }

  Value eval_inner(const Expr& e) {
    switch (e.kind) {
      case ExprKind::kLiteral: return e.value;
      case ExprKind::kName: return lookup(e.name);
      case ExprKind::kList:
      case ExprKind::kTuple: {
        List items;
        for (const auto& x : e.items) items.push_back(eval(*x));
        return Value::make_list(std::move(items), e.kind == ExprKind::kList ? Kind::kList : Kind::kTuple);
      }
      case ExprKind::kDict: {
        Dict d;
        for (size_t k = 0; k + 1 < e.items.size(); k += 2) {
          Value key = eval(*e.items[k]);
          if (!key.is_string()) type_error("dict literal keys must be strings here, not " + type_name(key));
          d.set(key.s, eval(*e.items[k + 1]));
        }
        return Value::make_dict(std::move(d));
      }
      case ExprKind::kAttr: return get_attr(eval(*e.items[0]), e.name);
      case ExprKind::kItem: return get_item(eval(*e.items[0]), eval(*e.items[1]));
      case ExprKind::kSlice: {
        Value obj = eval(*e.items[0]);
        Value parts[3];
        for (int k = 0; k < 3; ++k) parts[k] = e.items[k + 1] ? eval(*e.items[k + 1]) : Value::none();
        return slice(obj, parts[0], parts[1], parts[2]);
      }
      case ExprKind::kCall: {
        Value fn = eval(*e.items[0]);
        Args args;
        Kwargs kwargs;
        eval_args(e, &args, &kwargs);
        return invoke(fn, args, kwargs);
      }
      case ExprKind::kFilter: return eval_filter(e, nullptr);
      case ExprKind::kTest: {
        if (!e.known) type_error("no test named '" + e.name + "'");
        Value v = eval(*e.items[0]);
        Args args;
        Kwargs kwargs;
        eval_args(e, &args, &kwargs);
        return Value::boolean(apply_test(e.name, v, args, kwargs));
      }
      case ExprKind::kUnary: {
        Value v = eval(*e.items[0]);
        if (e.name == "not") return Value::boolean(!truthy(v));
        if (v.is_undefined()) fail_undefined(v);
        if (!v.is_number()) type_error("bad operand type for unary " + e.name + ": '" + type_name(v) + "'");
        if (e.name == "+") return v.kind == Kind::kBool ? Value::integer(v.b) : v;
        if (v.kind == Kind::kFloat) return Value::real(-v.f);
        const int64_t x = v.kind == Kind::kBool ? int64_t{v.b} : v.i;
        if (x == INT64_MIN) checked(true, 0, "-");
        return Value::integer(-x);
      }
      case ExprKind::kBinary: {
        if (e.name == "and") {
          Value a = eval(*e.items[0]);
          return truthy(a) ? eval(*e.items[1]) : a;
        }
        if (e.name == "or") {
          Value a = eval(*e.items[0]);
          return truthy(a) ? a : eval(*e.items[1]);
        }
        Value a = eval(*e.items[0]);
        Value b = eval(*e.items[1]);
        return binary(e.name, a, b);
      }
      case ExprKind::kCompare: {
        Value left = eval(*e.items[0]);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.items[k + 1]);
          if (!compare(e.ops[k], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case ExprKind::kCondExpr:
        if (truthy(eval(*e.items[0]))) return eval(*e.items[1]);
        if (e.items[2]) return eval(*e.items[2]);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
    }
    return Value::undefined();
  }

  static bool compare(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equals(a, b);
    if (op == "!=") return !equals(a, b);
    if (op == "<") return less_than(a, b);
    if (op == ">") return less_than(b, a);
    if (op == "<=") return less_than(a, b) || equals(a, b);
    if (op == ">=") return less_than(b, a) || equals(a, b);
    if (op == "in") return contains(b, a);
    if (op == "not in") return !contains(b, a);
    type_error("unknown comparison " + op);
  }

  static Value binary(const std::string& op, const Value& a, const Value& b) {
    if (op == "~") return Value::string(to_str(a) + to_str(b));
    if (a.is_undefined()) fail_undefined(a);
    if (b.is_undefined()) fail_undefined(b);
    auto unsupported = [&]() -> Value {
      if (op == "+" && a.is_string()) {
        type_error("can only concatenate str (not \"" + type_name(b) + "\") to str");
      }
      type_error("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
    };
    if (a.is_number() && b.is_number()) {
      bool ints = a.kind != Kind::kFloat && b.kind != Kind::kFloat;
      int64_t x = a.kind == Kind::kBool ? a.b : a.i, y = b.kind == Kind::kBool ? b.b : b.i;
      double fx = a.kind == Kind::kFloat ? a.f : static_cast<double>(x);
      double fy = b.kind == Kind::kFloat ? b.f : static_cast<double>(y);
      int64_t r = 0;
      if (op == "+") {
        if (!ints) return Value::real(fx + fy);
        checked(__builtin_add_overflow(x, y, &r), 0, "+");
        return Value::integer(r);
      }
      if (op == "-") {
        if (!ints) return Value::real(fx - fy);
        checked(__builtin_sub_overflow(x, y, &r), 0, "-");
        return Value::integer(r);
      }
      if (op == "*") {
        if (!ints) return Value::real(fx * fy);
        checked(__builtin_mul_overflow(x, y, &r), 0, "*");
        return Value::integer(r);
      }
      if (op == "/") {
        if (fy == 0) type_error("division by zero");
        return Value::real(fx / fy);
      }
      if (op == "//" || op == "%") {
        if (ints) {
          if (y == 0) type_error("integer division or modulo by zero");
          if (x == INT64_MIN && y == -1) checked(true, 0, op.c_str());
          int64_t q = x / y;
          r = x % y;
          if (r != 0 && ((r < 0) != (y < 0))) {
            --q;
            r += y;
          }
          return Value::integer(op == "//" ? q : r);
        }
        if (fy == 0) type_error("float division by zero");
        double q = std::floor(fx / fy);
        return Value::real(op == "//" ? q : fx - q * fy);
      }
      if (op == "**") {
        if (ints && y >= 0) {  // by squaring: y can be 10**18
          int64_t result = 1, base = x;
          for (int64_t e = y; e > 0; e >>= 1) {
            if (e & 1) checked(__builtin_mul_overflow(result, base, &result), 0, "**");
            if (e > 1) checked(__builtin_mul_overflow(base, base, &base), 0, "**");
          }
          return Value::integer(result);
        }
        return Value::real(std::pow(fx, fy));
      }
      return unsupported();
    }
    if (op == "+") {
      if (a.is_string() && b.is_string()) return Value::string(a.s + b.s);
      if (a.kind == b.kind && a.is_sequence()) {
        List items = *a.list;
        items.insert(items.end(), b.list->begin(), b.list->end());
        return Value::make_list(std::move(items), a.kind);
      }
      return unsupported();
    }
    if (op == "*") {
      const Value& seq = a.is_number() ? b : a;
      const Value& count = a.is_number() ? a : b;
      if (count.kind == Kind::kInt || count.kind == Kind::kBool) {
        int64_t n = std::max<int64_t>(0, count.kind == Kind::kBool ? count.b : count.i);
        const size_t unit = seq.is_string() ? seq.s.size() : seq.is_sequence() ? seq.list->size() * sizeof(Value) : 0;
        if (unit > 0 && static_cast<uint64_t>(n) > kMaxStringBytes / unit)
          type_error("repeating " + std::to_string(unit) + " bytes " + std::to_string(n) + " times passes the " +
                     std::to_string(kMaxStringBytes) + "-byte limit on template strings");
        if (seq.is_string()) {
          std::string out;
          for (int64_t k = 0; k < n; ++k) out += seq.s;
          return Value::string(out);
        }
        if (seq.is_sequence()) {
          List items;
          for (int64_t k = 0; k < n; ++k) items.insert(items.end(), seq.list->begin(), seq.list->end());
          return Value::make_list(std::move(items), seq.kind);
        }
      }
      return unsupported();
    }
    if (op == "%" && a.is_string()) {
      return Value::string(percent_format(a.s, b.kind == Kind::kTuple ? *b.list : List{b}));
    }
    return unsupported();
  }

  Value bound(const Value& self, const std::string& name) {
    return Value::callable(name, [this, self, name](Args& args, Kwargs& kwargs) {
      return call_method(self, name, args, kwargs);
    });
  }

  Value get_attr(const Value& obj, const std::string& name) {
    switch (obj.kind) {
      case Kind::kUndefined: fail_undefined(obj);
      case Kind::kDict: {
        static const std::unordered_set<std::string> methods = {"get", "items", "keys", "values", "copy"};
        static const std::unordered_set<std::string> mutators = {"pop", "popitem", "setdefault", "update", "clear"};
        if (methods.count(name)) return bound(obj, name);
        if (mutators.count(name)) return unsafe_attribute(obj, name);
        if (const Value* v = obj.dict->find(name)) return *v;
        return missing_attribute(obj, name);
      }
      case Kind::kNamespace: {
        if (const Value* v = obj.dict->find(name)) return *v;
        return missing_attribute(obj, name);
      }
      case Kind::kString:
        if (string_methods().count(name)) return bound(obj, name);
        return missing_attribute(obj, name);
      case Kind::kList:
      case Kind::kTuple: {
        static const std::unordered_set<std::string> mutators = {"append", "extend", "insert", "pop",
                                                                "remove", "reverse", "sort", "clear"};
        if (name == "index" || name == "count") return bound(obj, name);
        if (obj.kind == Kind::kList && mutators.count(name)) return unsafe_attribute(obj, name);
        return missing_attribute(obj, name);
      }
      default: return missing_attribute(obj, name);
    }
  }

  Value get_item(const Value& obj, const Value& key) {
    switch (obj.kind) {
      case Kind::kUndefined: fail_undefined(obj);
      case Kind::kDict:
      case Kind::kNamespace:
        if (key.is_string()) {
          if (obj.kind == Kind::kDict) {
            if (const Value* v = obj.dict->find(key.s)) return *v;
          }
          return get_attr(obj, key.s);
        }
        break;
      case Kind::kList:
      case Kind::kTuple:
      case Kind::kString: {
        if (key.is_string()) return get_attr(obj, key.s);
        if (key.kind != Kind::kInt && key.kind != Kind::kBool) break;
        int64_t idx = key.kind == Kind::kBool ? key.b : key.i;
        if (obj.is_string()) {
          auto cps = split_code_points(obj.s);
          int64_t n = static_cast<int64_t>(cps.size());
          if (idx < 0) idx += n;
          if (idx < 0 || idx >= n) return Value::undefined("string index out of range");
          return Value::string(cps[idx]);
        }
        int64_t n = static_cast<int64_t>(obj.list->size());
        if (idx < 0) idx += n;
        if (idx < 0 || idx >= n) {
          return Value::undefined("'" + object_type_repr(obj) + "' has no element " + std::to_string(key.i));
        }
        return (*obj.list)[idx];
      }
      default: break;
    }
    if (key.is_string()) return get_attr(obj, key.s);
    return Value::undefined("'" + object_type_repr(obj) + "' has no element " + to_repr(key));
  }

  static Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
    if (obj.is_undefined()) fail_undefined(obj);
    if (obj.is_string()) {
      auto cps = split_code_points(obj.s);
      std::string out;
      for (int64_t k : slice_indices(static_cast<int64_t>(cps.size()), start, stop, step)) out += cps[k];
      return Value::string(out);
    }
    if (!obj.is_sequence()) type_error("'" + type_name(obj) + "' object is not subscriptable");
    List out;
    for (int64_t k : slice_indices(static_cast<int64_t>(obj.list->size()), start, stop, step)) {
      out.push_back((*obj.list)[k]);
    }
    return Value::make_list(std::move(out), obj.kind);
  }

  Value call_method(const Value& self, const std::string& name, Args& args, Kwargs& kwargs) {
    if (self.is_string()) return call_string_method(self.s, name, args, kwargs);
    if (self.is_sequence()) {
      Params p(name.c_str(), args, kwargs, {"value"});
      Value x = p.required(0);
      int64_t count = 0;
      for (size_t k = 0; k < self.list->size(); ++k) {
        if (equals((*self.list)[k], x)) {
          if (name == "index") return Value::integer(static_cast<int64_t>(k));
          ++count;
        }
      }
      if (name == "index") type_error(to_repr(x) + " is not in list");
      return Value::integer(count);
    }
    // dict
    const Dict& d = *self.dict;
    if (name == "get") {
      Params p("get", args, kwargs, {"key", "default"});
      Value key = p.required(0);
      if (key.is_string()) {
        if (const Value* v = d.find(key.s)) return *v;
      }
      return p.get(1);
    }
    if (name == "items") {
      List items;
      for (const auto& [k, v] : d.entries) items.push_back(make_tuple(Value::string(k), v));
      return Value::make_list(std::move(items));
    }
    if (name == "keys") return Value::make_list(iterate(self));
    if (name == "values") {
      List items;
      for (const auto& [k, v] : d.entries) items.push_back(v);
      return Value::make_list(std::move(items));
    }
    if (name == "copy") return Value::make_dict(d);
    type_error("'dict' object has no attribute '" + name + "'");
  }

  // ---------------------------------------------------------------- filters
  // `input` replaces the innermost filtered value (null items[0]) in {% filter %} / block set.
  Value eval_filter(const Expr& e, const Value* input) {
    Value v = e.items[0] ? (e.items[0]->kind == ExprKind::kFilter && input ? eval_filter(*e.items[0], input)
                                                                           : eval(*e.items[0]))
                         : *input;
    if (!e.known) type_error("no filter named '" + e.name + "'");
    Args args;
    Kwargs kwargs;
    eval_args(e, &args, &kwargs);
    try {
      return apply_filter(e.name, v, args, kwargs);
    } catch (TemplateError& err) {
      if (err.line == 0) err.line = e.line;
      throw;
    }
  }

  // Follows a dotted attribute path ("a.b", "items.0"), as jinja2's make_attrgetter does.
  Value attr_path(const Value& v, const Value& path) {
    if (path.kind == Kind::kInt) return get_item(v, path);
    const std::string& p = str_arg(path, "attribute");
    Value cur = v;
    size_t start = 0;
    while (true) {
      size_t dot = p.find('.', start);
      std::string part = p.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
      // a digit run too long for int64 indexes nothing, as a string key would
      cur = digits && part.size() <= 18 ? get_item(cur, Value::integer(std::stoll(part))) : get_item(cur, Value::string(part));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    return cur;
  }

  static Value sort_key(const Value& v, bool case_sensitive) {
    if (!case_sensitive && v.is_string()) return Value::string(to_lower(v.s));
    return v;
  }

  Value apply_filter(const std::string& name, const Value& v, Args& args, Kwargs& kw) {
    if (name == "tojson") {
      Params p("tojson", args, kw, {"ensure_ascii", "indent", "separators", "sort_keys"});
      JsonOptions o;
      o.ensure_ascii = truthy(p.get(0, Value::boolean(false)));
      Value indent = p.get(1);
      if (!indent.is_none()) {
        const int64_t n = to_int_arg(indent, "indent");
        if (n > 4096 || n < -4096) type_error("tojson indent " + std::to_string(n) + " is outside [-4096, 4096]");
        o.indent = static_cast<int>(n);
        o.item_separator = ",";
      }
      Value sep = p.get(2);
      if (!sep.is_none()) {
        if (!sep.is_sequence() || sep.list->size() != 2) type_error("separators must be a (item, key) pair");
        o.item_separator = str_arg((*sep.list)[0], "separators");
        o.key_separator = str_arg((*sep.list)[1], "separators");
      }
      o.sort_keys = truthy(p.get(3, Value::boolean(false)));
      return Value::string(to_json(v, o));
    }
    if (name == "from_json") {
      // Not a jinja2 filter: DeepSeek V3.2's template calls it on string tool arguments (as
      // llama.cpp's renderer provides); transformers would fail there instead.
      const std::string& s = str_arg(v, "from_json input");
      auto j = nlohmann::ordered_json::parse(s, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) type_error("from_json: input is not valid JSON");
      return from_json(j);
    }
    if (name == "string") return Value::string(to_str(v));
    if (name == "trim") {
      Params p("trim", args, kw, {"chars"});
      return Value::string(strip_chars(to_str(v), p.get(0), true, true));
    }
    if (name == "length" || name == "count") return Value::integer(length_of(v));
    if (name == "lower") return Value::string(to_lower(to_str(v)));
    if (name == "upper") return Value::string(to_upper(to_str(v)));
    if (name == "capitalize") return Value::string(capitalize(to_str(v)));
    if (name == "title") return Value::string(title_case(to_str(v)));
    if (name == "safe") return v;
    if (name == "e" || name == "escape" || name == "forceescape") {
      std::string out;
      for (char c : to_str(v)) {
        switch (c) {
          case '&': out += "&amp;"; break;
          case '<': out += "&lt;"; break;
          case '>': out += "&gt;"; break;
          case '"': out += "&#34;"; break;
          case '\'': out += "&#39;"; break;
          default: out += c;
        }
      }
      return Value::string(out);
    }
    if (name == "replace") {
      Params p("replace", args, kw, {"old", "new", "count"});
      Value count = p.get(2);
      return Value::string(replace_all(to_str(v), to_str(p.required(0)), to_str(p.required(1)),
                                       count.is_none() ? -1 : to_int_arg(count, "count")));
    }
    if (name == "default" || name == "d") {
      Params p("default", args, kw, {"default_value", "boolean"});
      bool boolean = truthy(p.get(1, Value::boolean(false)));
      if (v.is_undefined() || (boolean && !truthy(v))) return p.get(0, Value::string(""));
      return v;
    }
    if (name == "first") {
      List items = iterate(v);
      return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
    }
    if (name == "last") {
      List items = iterate(v);
      return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
    }
    if (name == "list") return Value::make_list(iterate(v));
    if (name == "items") {
      if (v.is_undefined()) return Value::make_list({});
      if (!v.is_mapping()) type_error("items filter needs a mapping, got " + type_name(v));
      Args none;
      Kwargs nokw;
      return call_method(v, "items", none, nokw);
    }
    if (name == "join") {
      Params p("join", args, kw, {"d", "attribute"});
      std::string sep = to_str(p.get(0, Value::string("")));
      Value attribute = p.get(1);
      std::string out;
      List items = iterate(v);
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += sep;
        out += to_str(attribute.is_none() ? items[k] : attr_path(items[k], attribute));
      }
      return Value::string(out);
    }
    if (name == "reverse") {
      if (v.is_string()) return slice(v, Value::none(), Value::none(), Value::integer(-1));
      List items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::make_list(std::move(items));
    }
    if (name == "dictsort") {
      Params p("dictsort", args, kw, {"case_sensitive", "by", "reverse"});
      if (!v.is_mapping()) type_error("dictsort needs a mapping, got " + type_name(v));
      bool cs = truthy(p.get(0, Value::boolean(false)));
      std::string by = to_str(p.get(1, Value::string("key")));
      if (by != "key" && by != "value") type_error("You can only sort by either 'key' or 'value'");
      bool rev = truthy(p.get(2, Value::boolean(false)));
      std::vector<std::pair<std::string, Value>> entries = v.dict->entries;
      std::stable_sort(entries.begin(), entries.end(), [&](const auto& a, const auto& b) {
        Value ka = by == "key" ? Value::string(a.first) : a.second;
        Value kb = by == "key" ? Value::string(b.first) : b.second;
        return rev ? less_than(sort_key(kb, cs), sort_key(ka, cs)) : less_than(sort_key(ka, cs), sort_key(kb, cs));
      });
      List items;
      for (auto& [k, x] : entries) items.push_back(make_tuple(Value::string(k), x));
      return Value::make_list(std::move(items));
    }
    if (name == "sort") {
      Params p("sort", args, kw, {"reverse", "case_sensitive", "attribute"});
      bool rev = truthy(p.get(0, Value::boolean(false)));
      bool cs = truthy(p.get(1, Value::boolean(false)));
      Value attribute = p.get(2);
      List items = iterate(v);
      auto key = [&](const Value& x) { return sort_key(attribute.is_none() ? x : attr_path(x, attribute), cs); };
      std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
        return rev ? less_than(key(b), key(a)) : less_than(key(a), key(b));
      });
      return Value::make_list(std::move(items));
    }
    if (name == "unique") {
      Params p("unique", args, kw, {"case_sensitive", "attribute"});
      bool cs = truthy(p.get(0, Value::boolean(false)));
      Value attribute = p.get(1);
      List out, seen;
      for (const auto& x : iterate(v)) {
        Value k = sort_key(attribute.is_none() ? x : attr_path(x, attribute), cs);
        if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, k); })) {
          seen.push_back(k);
          out.push_back(x);
        }
      }
      return Value::make_list(std::move(out));
    }
    if (name == "min" || name == "max") {
      Params p(name.c_str(), args, kw, {"case_sensitive", "attribute"});
      bool cs = truthy(p.get(0, Value::boolean(false)));
      Value attribute = p.get(1);
      List items = iterate(v);
      if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
      auto key = [&](const Value& x) { return sort_key(attribute.is_none() ? x : attr_path(x, attribute), cs); };
      Value best = items[0];
      for (size_t k = 1; k < items.size(); ++k) {
        bool better = name == "min" ? less_than(key(items[k]), key(best)) : less_than(key(best), key(items[k]));
        if (better) best = items[k];
      }
      return best;
    }
    if (name == "sum") {
      Params p("sum", args, kw, {"attribute", "start"});
      Value attribute = p.get(0);
      Value total = p.get(1, Value::integer(0));
      for (const auto& x : iterate(v)) total = binary("+", total, attribute.is_none() ? x : attr_path(x, attribute));
      return total;
    }
    if (name == "abs") {
      if (v.kind == Kind::kFloat) return Value::real(std::fabs(v.f));
      if (v.kind == Kind::kInt) {
        if (v.i == INT64_MIN) checked(true, 0, "abs");
        return Value::integer(v.i < 0 ? -v.i : v.i);
      }
      if (v.kind == Kind::kBool) return Value::integer(v.b);
      type_error("bad operand type for abs(): '" + type_name(v) + "'");
    }
    if (name == "int") {
      Params p("int", args, kw, {"default", "base"});
      Value def = p.get(0, Value::integer(0));
      int base = static_cast<int>(to_int_arg(p.get(1, Value::integer(10)), "base"));
      if (v.is_undefined()) fail_undefined(v);
      if (v.kind == Kind::kInt) return v;
      if (v.kind == Kind::kBool) return Value::integer(v.b);
      if (v.kind == Kind::kFloat) return std::isfinite(v.f) ? Value::integer(float_to_int(v.f)) : def;
      if (v.is_string()) {
        std::string s = strip_chars(v.s, Value::none(), true, true);
        try {
          size_t used = 0;
          int64_t x = std::stoll(s, &used, base);
          if (used == s.size()) return Value::integer(x);
        } catch (...) {
        }
        try {
          size_t used = 0;
          double x = std::stod(s, &used);
          if (used == s.size() && std::isfinite(x)) return Value::integer(float_to_int(x));
        } catch (...) {
        }
      }
      return def;
    }
    if (name == "float") {
      Params p("float", args, kw, {"default"});
      Value def = p.get(0, Value::real(0.0));
      if (v.is_undefined()) fail_undefined(v);
      if (v.kind == Kind::kFloat) return v;
      if (v.kind == Kind::kInt) return Value::real(static_cast<double>(v.i));
      if (v.kind == Kind::kBool) return Value::real(v.b);
      if (v.is_string()) {
        std::string s = strip_chars(v.s, Value::none(), true, true);
        try {
          size_t used = 0;
          double x = std::stod(s, &used);
          if (used == s.size()) return Value::real(x);
        } catch (...) {
        }
      }
      return def;
    }
    if (name == "round") {
      Params p("round", args, kw, {"precision", "method"});
      int64_t precision = to_int_arg(p.get(0, Value::integer(0)), "precision");
      std::string method = to_str(p.get(1, Value::string("common")));
      double x = v.kind == Kind::kFloat ? v.f : v.kind == Kind::kInt ? static_cast<double>(v.i) : v.b;
      double scale = std::pow(10.0, static_cast<double>(precision));
      double y = x * scale;
      if (method == "common") y = std::nearbyint(y);  // Python round(): half to even
      else if (method == "ceil") y = std::ceil(y);
      else if (method == "floor") y = std::floor(y);
      else type_error("method must be 'common', 'ceil' or 'floor'");
      return Value::real(y / scale);
    }
    if (name == "format") {
      List items(args.begin(), args.end());
      return Value::string(percent_format(to_str(v), items));
    }
    if (name == "indent") {
      Params p("indent", args, kw, {"width", "first", "blank"});
      Value width = p.get(0, Value::integer(4));
      const int64_t columns = width.is_string() ? 0 : to_int_arg(width, "width");
      check_string_size(static_cast<size_t>(std::max<int64_t>(columns, 0)));
      std::string pad = width.is_string() ? width.s : std::string(static_cast<size_t>(std::max<int64_t>(columns, 0)), ' ');
      bool first = truthy(p.get(1, Value::boolean(false)));
      bool blank = truthy(p.get(2, Value::boolean(false)));
      Args none;
      Kwargs nokw;
      Value lines_v = call_string_method(to_str(v) + "\n", "splitlines", none, nokw);
      const List& lines = *lines_v.list;
      std::string out;
      for (size_t k = 0; k < lines.size(); ++k) {
        if (k) {
          out += "\n";
          if (blank || !lines[k].s.empty()) out += pad;
        }
        out += lines[k].s;
      }
      if (first) out = pad + out;
      return Value::string(out);
    }
    if (name == "wordcount") return Value::integer(static_cast<int64_t>(py_split(to_str(v), Value::none(), -1).size()));
    if (name == "pprint") return Value::string(to_repr(v));
    if (name == "attr") {
      Params p("attr", args, kw, {"name"});
      return get_attr(v, str_arg(p.required(0), "attr name"));
    }
    if (name == "map") {
      List out;
      Value attribute;
      for (const auto& [k, x] : kw) {
        if (k == "attribute") attribute = x;
      }
      if (!attribute.is_undefined()) {
        Value def = Value::undefined();
        for (const auto& [k, x] : kw) {
          if (k == "default") def = x;
        }
        for (const auto& x : iterate(v)) {
          Value y = attr_path(x, attribute);
          out.push_back(y.is_undefined() && !def.is_undefined() ? def : y);
        }
        return Value::make_list(std::move(out));
      }
      if (args.empty()) type_error("map requires a filter name or attribute=");
      std::string filter = str_arg(args[0], "map filter name");
      if (!is_known_filter(filter)) type_error("no filter named '" + filter + "'");
      Args rest(args.begin() + 1, args.end());
      for (const auto& x : iterate(v)) {
        Args a = rest;
        Kwargs k = kw;
        out.push_back(apply_filter(filter, x, a, k));
      }
      return Value::make_list(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      bool by_attr = name == "selectattr" || name == "rejectattr";
      bool keep_if = name == "select" || name == "selectattr";
      size_t at = 0;
      Value attribute;
      if (by_attr) {
        if (args.empty()) type_error(name + " requires an attribute name");
        attribute = args[at++];
      }
      std::string test;
      if (at < args.size()) test = str_arg(args[at++], "test name");
      if (!test.empty() && !is_known_test(test)) type_error("no test named '" + test + "'");
      Args rest(args.begin() + static_cast<std::ptrdiff_t>(at), args.end());
      List out;
      for (const auto& x : iterate(v)) {
        Value subject = by_attr ? attr_path(x, attribute) : x;
        Args a = rest;
        Kwargs k = kw;
        bool pass = test.empty() ? truthy(subject) : apply_test(test, subject, a, k);
        if (pass == keep_if) out.push_back(x);
      }
      return Value::make_list(std::move(out));
    }
    type_error("no filter named '" + name + "'");
  }

  // ---------------------------------------------------------------- tests
  bool apply_test(const std::string& name, const Value& v, Args& args, Kwargs& kw) {
    auto arg = [&]() -> Value {
      if (!args.empty()) return args[0];
      if (!kw.empty()) return kw[0].second;
      type_error("test '" + name + "' needs an argument");
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.kind == Kind::kBool;
    if (name == "false") return v.kind == Kind::kBool && !v.b;
    if (name == "true") return v.kind == Kind::kBool && v.b;
    if (name == "integer") return v.kind == Kind::kInt;
    if (name == "float") return v.kind == Kind::kFloat;
    if (name == "number") return v.is_number();  // Python: bool is a Number
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_mapping();
    if (name == "sequence") return v.is_string() || v.is_sequence() || v.is_mapping();
    if (name == "iterable") return v.is_string() || v.is_sequence() || v.is_mapping() || v.is_undefined();
    if (name == "callable") return v.kind == Kind::kCallable;
    if (name == "escaped") return false;
    if (name == "lower") return v.is_string() && to_lower(v.s) == v.s;
    if (name == "upper") return v.is_string() && to_upper(v.s) == v.s;
    if (name == "filter") return v.is_string() && is_known_filter(v.s);
    if (name == "test") return v.is_string() && is_known_test(v.s);
    if (name == "even" || name == "odd") {
      // Python: value % 2 == 0 (even) or == 1 (odd), floats included.
      if (v.kind == Kind::kFloat) {
        double r = v.f - 2 * std::floor(v.f / 2);
        return name == "even" ? r == 0 : r == 1;
      }
      int64_t x = to_int_arg(v, name.c_str());
      return (x % 2 == 0) == (name == "even");
    }
    if (name == "divisibleby") {
      int64_t d = to_int_arg(arg(), "divisibleby");
      if (d == 0) type_error("integer division or modulo by zero");
      return to_int_arg(v, "divisibleby") % d == 0;
    }
    if (name == "eq" || name == "==" || name == "equalto") return equals(v, arg());
    if (name == "ne" || name == "!=") return !equals(v, arg());
    if (name == "lt" || name == "<" || name == "lessthan") return less_than(v, arg());
    if (name == "gt" || name == ">" || name == "greaterthan") return less_than(arg(), v);
    if (name == "le" || name == "<=") return !less_than(arg(), v);
    if (name == "ge" || name == ">=") return !less_than(v, arg());
    if (name == "in") return contains(arg(), v);
    if (name == "sameas") {
      Value o = arg();
      if (v.kind != o.kind) return false;
      switch (v.kind) {
        case Kind::kNone:
        case Kind::kUndefined: return true;
        case Kind::kBool: return v.b == o.b;
        case Kind::kList:
        case Kind::kTuple: return v.list == o.list;
        case Kind::kDict:
        case Kind::kNamespace: return v.dict == o.dict;
        case Kind::kCallable: return v.fn == o.fn;
        default: return equals(v, o);
      }
    }
    type_error("no test named '" + name + "'");
  }

  // ---------------------------------------------------------------- globals
  void install_globals() {
    globals_["raise_exception"] = Value::callable("raise_exception", [](Args& args, Kwargs&) -> Value {
      throw TemplateError("raise_exception: " + (args.empty() ? std::string() : to_str(args[0])));
    });
    globals_["strftime_now"] = Value::callable("strftime_now", [](Args& args, Kwargs& kw) {
      Params p("strftime_now", args, kw, {"format"});
      std::string fmt = str_arg(p.required(0), "format");
      std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
      return Value::string(std::string(buf, n));
    });
    globals_["namespace"] = Value::callable("namespace", [this](Args& args, Kwargs& kw) {
      Dict d;
      for (const auto& a : args) {
        if (!a.is_mapping()) type_error("namespace() positional arguments must be mappings");
        for (const auto& [k, v] : a.dict->entries) d.set(k, v);
      }
      for (const auto& [k, v] : kw) d.set(k, v);
      Value ns = Value::make_dict(std::move(d), Kind::kNamespace);
      namespaces_.push_back(ns.dict);
      return ns;
    });
    globals_["dict"] = Value::callable("dict", [](Args& args, Kwargs& kw) {
      Dict d;
      for (const auto& a : args) {
        if (!a.is_mapping()) type_error("dict() positional arguments must be mappings");
        for (const auto& [k, v] : a.dict->entries) d.set(k, v);
      }
      for (const auto& [k, v] : kw) d.set(k, v);
      return Value::make_dict(std::move(d));
    });
    globals_["range"] = Value::callable("range", [](Args& args, Kwargs& kw) {
      if (!kw.empty()) type_error("range() takes no keyword arguments");
      if (args.empty() || args.size() > 3) type_error("range expected 1 to 3 arguments");
      int64_t start = 0, stop, step = 1;
      if (args.size() == 1) {
        stop = to_int_arg(args[0], "range stop");
      } else {
        start = to_int_arg(args[0], "range start");
        stop = to_int_arg(args[1], "range stop");
        if (args.size() == 3) step = to_int_arg(args[2], "range step");
      }
      if (step == 0) type_error("range() arg 3 must not be zero");
      List out;
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
        // The sandbox's MAX_RANGE.
        if (out.size() >= 100000) type_error("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        out.push_back(Value::integer(k));
      }
      return Value::make_list(std::move(out));
    });
  }

  std::shared_ptr<Scope> root_;
  std::shared_ptr<Scope> scope_;
  std::unordered_map<std::string, Value> globals_;
  std::string* out_ = nullptr;
  int depth_ = 0;
  uintptr_t stack_base_ = 0;  // frame address at run(): check_stack measures from it
  int64_t steps_ = 0;  // exec() calls and loop iterations, against kMaxSteps
  std::vector<std::shared_ptr<Scope>> closures_;  // scopes macros close over (~Renderer)
  std::vector<std::shared_ptr<Dict>> namespaces_;  // every namespace() made (~Renderer)
};

}  // namespace

bool is_known_filter(const std::string& name) { return filter_names().count(name) > 0; }
bool is_known_test(const std::string& name) { return test_names().count(name) > 0; }

}  // namespace moat::chat_template_detail

namespace moat {

Result<ChatTemplate> ChatTemplate::parse(std::string_view source) {
  MOAT_ASSIGN_OR_RETURN(auto t, chat_template_detail::parse_template(source));
  ChatTemplate out;
  out.template_ = std::move(t);
  return out;
}

Result<std::string> ChatTemplate::render(const nlohmann::ordered_json& context) const {
  using namespace chat_template_detail;
  if (!context.is_object()) return make_error("chat template context must be a JSON object");
  try {
    Value ctx = from_json(context);
    Renderer renderer(ctx);
    return renderer.run(*template_);
  } catch (const TemplateError& e) {
    if (e.line > 0) return make_error("chat template error, line {}: {}", e.line, e.what());
    return make_error("chat template error: {}", e.what());
  } catch (const std::exception& e) {  // a library error (std::out_of_range, ...) is still a value
    return make_error("chat template error: {}", e.what());
  }
}

}  // namespace moat
