// The dynamic values a chat template computes with, modelled on the Python objects jinja2 sees:
// None, bool, int, float, str, list, tuple, dict (insertion ordered), jinja2's Namespace and
// Undefined, and callables (macros, globals, bound methods). Printing follows Python's str() and
// repr(), so `{{ [1, 'a'] }}` gives "[1, 'a']" as in jinja2.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace moat::chat_template_detail {

// Thrown inside the evaluator only; ChatTemplate::render turns it into an Error. Exceptions keep
// the tree walker readable: nearly every operation can fail with a Python TypeError equivalent.
struct TemplateError : std::runtime_error {
  explicit TemplateError(const std::string& message, int line = 0)
      : std::runtime_error(message), line(line) {}
  int line;  // 0 until the innermost node that knows its line fills it in
};

enum class Kind : uint8_t {
  kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kTuple, kDict, kNamespace, kCallable
};

struct Value;
struct Dict;
struct Callable;
using List = std::vector<Value>;

struct Value {
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // kString: the text (UTF-8); kUndefined: why it is undefined, for errors
  std::shared_ptr<const List> list;  // kList, kTuple (immutable: the sandbox forbids mutation)
  std::shared_ptr<Dict> dict;        // kDict (never mutated), kNamespace (mutable by `set ns.x`)
  std::shared_ptr<const Callable> fn;
  bool unsafe = false;  // kUndefined produced by a sandbox-forbidden attribute (list.append)

  static Value undefined(std::string hint = {}) {
    Value v;
    v.s = std::move(hint);
    return v;
  }
  static Value none() { return make(Kind::kNone); }
  static Value boolean(bool x) {
    Value v = make(Kind::kBool);
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v = make(Kind::kInt);
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v = make(Kind::kFloat);
    v.f = x;
    return v;
  }
  static Value string(std::string x) {
    Value v = make(Kind::kString);
    v.s = std::move(x);
    return v;
  }
  static Value make_list(List items, Kind kind = Kind::kList) {
    Value v = make(kind);
    v.list = std::make_shared<const List>(std::move(items));
    return v;
  }
  static Value make_dict(Dict d, Kind kind = Kind::kDict);
  static Value callable(std::string name, std::function<Value(std::vector<Value>&,
                                                               std::vector<std::pair<std::string, Value>>&)> f);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  bool is_sequence() const { return kind == Kind::kList || kind == Kind::kTuple; }
  bool is_mapping() const { return kind == Kind::kDict; }

 private:
  static Value make(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }
};

// Python dict with str keys, in insertion order (tojson and dict iteration depend on it).
struct Dict {
  std::vector<std::pair<std::string, Value>> entries;
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value value);
};

using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;

struct Callable {
  std::string name;
  std::function<Value(Args&, Kwargs&)> call;
};

// Python type name, as error messages print it ("list", "dict", "NoneType"...).
std::string type_name(const Value& v);
// Raises jinja2's UndefinedError for an operation on an undefined value.
[[noreturn]] void fail_undefined(const Value& v);

bool truthy(const Value& v);
std::string to_str(const Value& v);   // Python str(); Undefined prints as ""
std::string to_repr(const Value& v);  // Python repr()
std::string float_repr(double x);     // Python repr(float): shortest round trip

bool equals(const Value& a, const Value& b);  // Python ==
// Python <: numbers, strings, sequences; anything else is a TypeError.
bool less_than(const Value& a, const Value& b);

Value from_json(const nlohmann::ordered_json& j);

struct JsonOptions {
  int indent = -1;  // -1: None (one line)
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;
};
// json.dumps with the given options.
std::string to_json(const Value& v, const JsonOptions& options);

// UTF-8 helpers: Python indexes strings by code point.
std::vector<std::string> split_code_points(const std::string& s);
size_t code_point_count(const std::string& s);

}  // namespace moat::chat_template_detail
