// The parsed form of a template: expression and statement trees, built by template_parser.cpp and
// walked by template_render.cpp. One struct per tree with a kind tag keeps both walkers to a
// single switch each.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "tokenizer/chat_template/template_value.h"

namespace moat::chat_template_detail {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

enum class ExprKind {
  kLiteral,   // value
  kName,      // name
  kList,      // items
  kTuple,     // items
  kDict,      // keys (items[2k]) and values (items[2k+1])
  kAttr,      // items[0] . name
  kItem,      // items[0] [ items[1] ]
  kSlice,     // items[0] [ start : stop : step ] in items[1..3], null when omitted
  kCall,      // items[0] ( args, kwargs )
  kFilter,    // items[0] | name ( args, kwargs )
  kTest,      // items[0] is name ( args, kwargs )
  kUnary,     // op items[0]: "-", "+", "not"
  kBinary,    // items[0] op items[1]: + - * / // % ** ~ and or in "not in"
  kCompare,   // items[0] ops[0] items[1] ops[1] items[2] ... (Python chaining)
  kCondExpr,  // items[1] if items[0] else items[2] (items[2] null: undefined)
};

struct Expr {
  ExprKind kind;
  int line = 0;
  std::string name;  // kName, kAttr, kFilter, kTest; kUnary/kBinary: the operator
  Value value;       // kLiteral
  std::vector<ExprPtr> items;
  std::vector<std::string> ops;  // kCompare
  std::vector<std::pair<std::string, ExprPtr>> kwargs;  // kCall, kFilter, kTest
  size_t num_args = 0;  // kCall/kFilter/kTest: positional args are items[1 .. 1+num_args)
  bool known = true;    // kFilter/kTest: false when the name is unknown (error when reached)
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

enum class StmtKind {
  kText,      // text
  kOutput,    // {{ expr }}
  kIf,        // conds[k] -> bodies[k]; bodies.size() == conds.size() + 1 when there is an else
  kFor,       // targets in expr [if cond] body; bodies[1]: else
  kSet,       // targets (or expr attr target) = value
  kSetBlock,  // {% set name %}body{% endset %}, optional filter chain in value
  kMacro,     // name(params = defaults) body
  kCallBlock, // {% call(params) expr %}body{% endcall %}
  kFilterBlock,
  kBreak,
  kContinue,
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;                  // kText; kMacro/kSetBlock: name
  ExprPtr expr;                      // kOutput, kFor iterable, kSet value, kCallBlock call, kFilterBlock filter
  ExprPtr cond;                      // kFor filter
  ExprPtr attr_target;               // kSet: `ns.x` (items[0] is the namespace expr, name = attr)
  std::vector<std::string> targets;  // kFor, kSet names; kMacro/kCallBlock params
  std::vector<ExprPtr> defaults;     // kMacro/kCallBlock: per param, null when none
  std::vector<ExprPtr> conds;        // kIf
  std::vector<Body> bodies;          // kIf branches; kFor/kMacro/kSetBlock...: bodies[0]
  bool tuple_target = false;         // kFor/kSet: targets unpack a sequence
};

struct Template {
  Body body;
};

Result<std::shared_ptr<const Template>> parse_template(std::string_view source);

// The filters and tests the renderer implements (template_render.cpp); the parser rejects others
// outside `if` blocks, as jinja2 does at compile time.
bool is_known_filter(const std::string& name);
bool is_known_test(const std::string& name);

}  // namespace moat::chat_template_detail
