// Lexer and parser for the Jinja2 subset chat templates use, following jinja2's lexer.py and
// parser.py rules (read for behaviour, not copied):
//   - newlines normalized to \n, and one trailing newline dropped (keep_trailing_newline=False);
//   - `{%-`/`{{-`/`{#-` strip all whitespace before the tag, `-%}`/`-}}`/`-#}` all after it;
//   - lstrip_blocks: spaces/tabs between a line start and `{%` or `{#` go (not before `{{`),
//     unless the tag is written `{%+`;
//   - trim_blocks: the first newline after `%}` or `#}` goes, unless written `+%}`;
//   - operator precedence: if-else < or < and < not < comparisons/in < + - < ~ < * / // % < ** <
//     unary - + < filters and tests < postfix (. [] ()).
#include <cerrno>
#include <cstdlib>
#include <algorithm>
#include <cstring>

#include "tokenizer/chat_template/template_ast.h"

namespace moat::chat_template_detail {
namespace {

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;  // kText data, kName, kString (decoded), kOp
  int line = 0;
  int64_t ival = 0;
  double fval = 0;
};

struct ParseError {
  int line;
  std::string message;
};

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool is_name_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    *out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    *out += static_cast<char>(0xC0 | (cp >> 6));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *out += static_cast<char>(0xE0 | (cp >> 12));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *out += static_cast<char>(0xF0 | (cp >> 18));
    *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // Newline normalization and the dropped trailing newline, as jinja2's tokeniter does.
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') newlines_.push_back(i);
    }
  }

  std::vector<Token> run() {
    const size_t n = src_.size();
    while (pos_ < n) {
      size_t start = find_tag(pos_);
      std::string text = src_.substr(pos_, start - pos_);
      if (start == n) {
        emit_text(text, pos_);
        break;
      }
      char kind = src_[start + 1];  // '{', '%' or '#'
      char mod = start + 2 < n ? src_[start + 2] : 0;
      if (mod == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (mod != '+' && kind != '{') {
        // lstrip_blocks: drop the indentation before a block or comment tag on its own line.
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        bool line_starting = pos_ == 0 || src_[pos_ - 1] == '\n';
        if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
            std::all_of(text.begin() + l_pos, text.end(), is_space)) {
          text.resize(l_pos);
        }
      }
      emit_text(text, pos_);
      int tag_line = line_at(start);
      pos_ = start + 2 + ((mod == '-' || mod == '+') ? 1 : 0);
      if (kind == '#') {
        size_t end = src_.find("#}", pos_);
        if (end == std::string::npos) throw ParseError{tag_line, "unclosed comment: expected '#}'"};
        char before = end > pos_ ? src_[end - 1] : 0;
        pos_ = end + 2;
        after_tag_end(before, /*block=*/true);
      } else if (kind == '%' && lex_raw(tag_line)) {
        // raw block handled
      } else {
        lex_tag(kind == '%', tag_line);
      }
    }
    tokens_.push_back(Token{Tok::kEof, "", line_at(n)});
    return std::move(tokens_);
  }

 private:
  int line_at(size_t p) const {
    return static_cast<int>(std::lower_bound(newlines_.begin(), newlines_.end(), p) - newlines_.begin()) + 1;
  }

  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return src_.size();
  }

  void emit_text(const std::string& text, size_t at) {
    if (!text.empty()) tokens_.push_back(Token{Tok::kText, text, line_at(at)});
  }

  // Whitespace control after a closing delimiter: `-` strips everything, trim_blocks one newline.
  void after_tag_end(char before_delimiter, bool block) {
    if (before_delimiter == '-') {
      while (pos_ < src_.size() && is_space(src_[pos_])) ++pos_;
    } else if (block && before_delimiter != '+' && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
    }
  }

  // {% raw %}...{% endraw %}: the body is text, untouched.
  bool lex_raw(int tag_line) {
    size_t p = pos_;
    while (p < src_.size() && is_space(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0 || (p + 3 < src_.size() && is_name_char(src_[p + 3]))) return false;
    p += 3;
    while (p < src_.size() && is_space(src_[p])) ++p;
    char mod = 0;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) mod = src_[p++];
    if (src_.compare(p, 2, "%}") != 0) return false;
    pos_ = p + 2;
    after_tag_end(mod, true);
    for (size_t q = pos_; (q = src_.find("{%", q)) != std::string::npos; ++q) {
      size_t r = q + 2;
      char begin_mod = 0;
      if (r < src_.size() && (src_[r] == '-' || src_[r] == '+')) begin_mod = src_[r++];
      while (r < src_.size() && is_space(src_[r])) ++r;
      if (src_.compare(r, 6, "endraw") != 0) continue;
      r += 6;
      while (r < src_.size() && is_space(src_[r])) ++r;
      char end_mod = 0;
      if (r < src_.size() && (src_[r] == '-' || src_[r] == '+')) end_mod = src_[r++];
      if (src_.compare(r, 2, "%}") != 0) continue;
      std::string body = src_.substr(pos_, q - pos_);
      if (begin_mod == '-') {
        while (!body.empty() && is_space(body.back())) body.pop_back();
      }
      emit_text(body, pos_);
      pos_ = r + 2;
      after_tag_end(end_mod, true);
      return true;
    }
    throw ParseError{tag_line, "unexpected end of template: expected 'endraw' to close 'raw'"};
  }

  void lex_tag(bool block, int tag_line) {
    tokens_.push_back(Token{block ? Tok::kBlockBegin : Tok::kVarBegin, "", tag_line});
    int depth = 0;
    const size_t n = src_.size();
    while (true) {
      while (pos_ < n && is_space(src_[pos_])) ++pos_;
      if (pos_ >= n) {
        throw ParseError{line_at(n), std::string("unexpected end of template: expected '") +
                                         (block ? "%}" : "}}") + "' to close the tag opened on line " +
                                         std::to_string(tag_line)};
      }
      int line = line_at(pos_);
      char c = src_[pos_];
      const char* close = block ? "%}" : "}}";
      if (depth == 0) {
        if ((c == '-' || (c == '+' && block)) && src_.compare(pos_ + 1, 2, close) == 0) {
          pos_ += 3;
          after_tag_end(c, block);
          tokens_.push_back(Token{block ? Tok::kBlockEnd : Tok::kVarEnd, "", line});
          return;
        }
        if (src_.compare(pos_, 2, close) == 0) {
          pos_ += 2;
          after_tag_end(0, block);
          tokens_.push_back(Token{block ? Tok::kBlockEnd : Tok::kVarEnd, "", line});
          return;
        }
      }
      if (is_name_start(c)) {
        size_t s = pos_;
        while (pos_ < n && is_name_char(src_[pos_])) ++pos_;
        tokens_.push_back(Token{Tok::kName, src_.substr(s, pos_ - s), line});
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        lex_number(line);
      } else if (c == '\'' || c == '"') {
        lex_string(line);
      } else {
        static const char* kTwo[] = {"//", "**", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* t : kTwo) {
          if (src_.compare(pos_, 2, t) == 0) op = t;
        }
        if (op.empty()) {
          if (!std::strchr("+-*/%~<>=.:|,;()[]{}", c)) {
            throw ParseError{line, std::string("unexpected character '") + c + "'"};
          }
          op = std::string(1, c);
          if (c == '(' || c == '[' || c == '{') ++depth;
          if (c == ')' || c == ']' || c == '}') {
            if (depth == 0) throw ParseError{line, std::string("unexpected '") + c + "'"};
            --depth;
          }
        }
        pos_ += op.size();
        tokens_.push_back(Token{Tok::kOp, op, line});
      }
    }
  }

  void lex_number(int line) {
    const size_t n = src_.size();
    size_t s = pos_;
    auto digits = [&](size_t p) {
      while (p < n && (std::isdigit(static_cast<unsigned char>(src_[p])) ||
                       (src_[p] == '_' && p + 1 < n && std::isdigit(static_cast<unsigned char>(src_[p + 1])))))
        ++p;
      return p;
    };
    // 0x / 0o / 0b integers.
    if (src_[s] == '0' && s + 1 < n && std::strchr("xXoObB", src_[s + 1]) && s + 2 < n &&
        std::isxdigit(static_cast<unsigned char>(src_[s + 2]))) {
      int base = std::tolower(src_[s + 1]) == 'x' ? 16 : std::tolower(src_[s + 1]) == 'o' ? 8 : 2;
      size_t p = s + 2;
      std::string d;
      while (p < n && (std::isxdigit(static_cast<unsigned char>(src_[p])) || src_[p] == '_')) {
        if (src_[p] != '_') d += src_[p];
        ++p;
      }
      pos_ = p;
      Token t{Tok::kInt, src_.substr(s, p - s), line};
      t.ival = parse_int(d, base, line);
      tokens_.push_back(t);
      return;
    }
    size_t p = digits(s);
    bool is_float = false;
    // A float never follows a '.', so `x.0.1` is two integer subscripts (jinja2's lookbehind).
    bool after_dot = s > 0 && src_[s - 1] == '.';
    if (!after_dot) {
      if (p + 1 < n && src_[p] == '.' && std::isdigit(static_cast<unsigned char>(src_[p + 1]))) {
        p = digits(p + 1);
        is_float = true;
      }
      if (p < n && src_[p] == 'e') {
        size_t q = p + 1;
        if (q < n && (src_[q] == '+' || src_[q] == '-')) ++q;
        if (q < n && std::isdigit(static_cast<unsigned char>(src_[q]))) {
          p = digits(q);
          is_float = true;
        }
      }
    }
    std::string text;
    for (size_t k = s; k < p; ++k) {
      if (src_[k] != '_') text += src_[k];
    }
    pos_ = p;
    Token t{is_float ? Tok::kFloat : Tok::kInt, text, line};
    if (is_float) t.fval = std::strtod(text.c_str(), nullptr);  // inf or 0 past the range, as in Python
    else t.ival = parse_int(text, 10, line);
    tokens_.push_back(t);
  }

  // An integer literal; Python's are unbounded, the renderer's are int64.
  static int64_t parse_int(const std::string& digits, int base, int line) {
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(digits.c_str(), &end, base);
    if (digits.empty() || errno == ERANGE || *end != '\0')
      throw ParseError{line, "integer literal " + digits.substr(0, 40) + " does not fit in 64 bits"};
    return v;
  }

  // Python unicode-escape decoding of a string literal, as jinja2 does.
  void lex_string(int line) {
    const size_t n = src_.size();
    char quote = src_[pos_++];
    std::string out;
    while (true) {
      if (pos_ >= n) throw ParseError{line, "unterminated string literal"};
      char c = src_[pos_];
      if (c == quote) {
        ++pos_;
        break;
      }
      if (c != '\\' || pos_ + 1 >= n) {
        out += c;
        ++pos_;
        continue;
      }
      char e = src_[pos_ + 1];
      pos_ += 2;
      auto hex = [&](int count) -> bool {
        if (pos_ + count > n) return false;
        uint32_t v = 0;
        for (int k = 0; k < count; ++k) {
          char h = src_[pos_ + k];
          if (!std::isxdigit(static_cast<unsigned char>(h))) return false;
          v = v * 16 + (std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : std::tolower(h) - 'a' + 10);
        }
        pos_ += count;
        append_utf8(v, &out);
        return true;
      };
      switch (e) {
        case '\n': break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'v': out += '\v'; break;
        case 'x':
          if (!hex(2)) throw ParseError{line, "invalid \\x escape in string literal"};
          break;
        case 'u':
          if (!hex(4)) throw ParseError{line, "invalid \\u escape in string literal"};
          break;
        case 'U':
          if (!hex(8)) throw ParseError{line, "invalid \\U escape in string literal"};
          break;
        default:
          if (e >= '0' && e <= '7') {
            uint32_t v = e - '0';
            for (int k = 0; k < 2 && pos_ < n && src_[pos_] >= '0' && src_[pos_] <= '7'; ++k) v = v * 8 + (src_[pos_++] - '0');
            append_utf8(v, &out);
          } else {
            // Python keeps unknown escapes as written.
            out += '\\';
            out += e;
          }
      }
    }
    tokens_.push_back(Token{Tok::kString, out, line});
  }

  std::string src_;
  std::vector<size_t> newlines_;
  size_t pos_ = 0;
  std::vector<Token> tokens_;
};

const char* describe(const Token& t) {
  switch (t.type) {
    case Tok::kText: return "template text";
    case Tok::kVarBegin: return "'{{'";
    case Tok::kVarEnd: return "'}}'";
    case Tok::kBlockBegin: return "'{%'";
    case Tok::kBlockEnd: return "'%}'";
    case Tok::kEof: return "end of template";
    default: return nullptr;
  }
}

std::string describe_token(const Token& t) {
  if (const char* d = describe(t)) return d;
  if (t.type == Tok::kString) return "string literal";
  return "'" + t.text + "'";
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  std::shared_ptr<Template> run() {
    auto t = std::make_shared<Template>();
    std::string found;
    t->body = parse_body({}, &found);
    return t;
  }

 private:
  struct Open {
    std::string tag;
    int line;
  };

  // Every step of the descent and every link of a left-nested chain (a + b + c, x.y.z, f()(),
  // x | f | g) makes the tree one level deeper. Deeper trees are refused, so that neither this
  // parser, nor the evaluator, nor the tree's destructor (all recursive) can overflow the stack on
  // a hostile template; real templates stay under 100 levels and 10 nested blocks.
  static constexpr int kMaxDepth = 500;
  static constexpr size_t kMaxBlocks = 100;
  int depth_ = 0;
  void deepen() {
    if (++depth_ > kMaxDepth)
      throw ParseError{peek().line, "expression nested deeper than " + std::to_string(kMaxDepth) + " levels"};
  }
  // Deepens for the rest of the scope it is declared in.
  struct Deeper {
    explicit Deeper(Parser* parser) : p(parser), saved(parser->depth_) { p->deepen(); }
    ~Deeper() { p->depth_ = saved; }
    Parser* p;
    int saved;
  };

  const Token& peek(size_t ahead = 0) const { return toks_[std::min(i_ + ahead, toks_.size() - 1)]; }
  Token next() { return toks_[std::min(i_++, toks_.size() - 1)]; }
  bool at_op(const char* op, size_t ahead = 0) const {
    return peek(ahead).type == Tok::kOp && peek(ahead).text == op;
  }
  bool at_name(const char* name, size_t ahead = 0) const {
    return peek(ahead).type == Tok::kName && peek(ahead).text == name;
  }
  bool skip_op(const char* op) {
    if (!at_op(op)) return false;
    ++i_;
    return true;
  }
  bool skip_name(const char* name) {
    if (!at_name(name)) return false;
    ++i_;
    return true;
  }
  [[noreturn]] void fail(const std::string& expected) const {
    throw ParseError{peek().line, "expected " + expected + ", got " + describe_token(peek())};
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) fail(std::string("'") + op + "'");
  }
  std::string expect_name() {
    if (peek().type != Tok::kName) fail("a name");
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != Tok::kBlockEnd) fail("end of statement '%}'");
    ++i_;
  }

  static std::string join_tags(const std::vector<std::string>& tags) {
    std::string out;
    for (size_t k = 0; k < tags.size(); ++k) {
      if (k) out += k + 1 == tags.size() ? " or " : ", ";
      out += "'" + tags[k] + "'";
    }
    return out;
  }

  // Parses statements until one of `enders` opens a tag (consumed with its name; the rest of
  // that tag is the caller's), or the end of the template when enders is empty.
  Body parse_body(const std::vector<std::string>& enders, std::string* found) {
    if (open_.size() > kMaxBlocks)
      throw ParseError{peek().line, "blocks nested deeper than " + std::to_string(kMaxBlocks) + " levels"};
    Body body;
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::kEof) {
        if (enders.empty()) return body;
        const Open& open = open_.back();
        throw ParseError{t.line, "unexpected end of template: expected " + join_tags(enders) + " to close '" +
                                     open.tag + "' opened on line " + std::to_string(open.line)};
      }
      if (t.type == Tok::kText) {
        auto s = std::make_unique<Stmt>(Stmt{StmtKind::kText, t.line});
        s->text = t.text;
        body.push_back(std::move(s));
        ++i_;
      } else if (t.type == Tok::kVarBegin) {
        ++i_;
        auto s = std::make_unique<Stmt>(Stmt{StmtKind::kOutput, t.line});
        s->expr = parse_tuple(true, {});
        if (peek().type != Tok::kVarEnd) fail("end of print statement '}}'");
        ++i_;
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        const Token& name = peek(1);
        if (name.type == Tok::kName && std::find(enders.begin(), enders.end(), name.text) != enders.end()) {
          i_ += 2;
          *found = name.text;
          return body;
        }
        ++i_;
        body.push_back(parse_statement(enders));
      } else {
        fail("template text or a tag");
      }
    }
  }

  std::unique_ptr<Stmt> parse_statement(const std::vector<std::string>& enders) {
    if (peek().type != Tok::kName) fail("a statement name");
    Token tag = next();
    const std::string& name = tag.text;
    int line = tag.line;
    auto stmt = [&](StmtKind kind) { return std::make_unique<Stmt>(Stmt{kind, line}); };
    if (name == "if") {
      auto s = stmt(StmtKind::kIf);
      open_.push_back({"if", line});
      s->conds.push_back(parse_tuple(false, {}));
      while (true) {
        expect_block_end();
        std::string found;
        s->bodies.push_back(parse_body({"elif", "else", "endif"}, &found));
        if (found == "elif") {
          s->conds.push_back(parse_tuple(false, {}));
          continue;
        }
        if (found == "else") {
          expect_block_end();
          s->bodies.push_back(parse_body({"endif"}, &found));
        }
        expect_block_end();
        break;
      }
      open_.pop_back();
      return s;
    }
    if (name == "for") {
      auto s = stmt(StmtKind::kFor);
      parse_targets(s.get());
      if (!skip_name("in")) fail("'in'");
      s->expr = parse_tuple(false, {"recursive"});
      if (skip_name("if")) s->cond = parse_expression(true);
      if (at_name("recursive")) throw ParseError{peek().line, "recursive loops are not supported"};
      expect_block_end();
      open_.push_back({"for", line});
      ++loop_depth_;
      std::string found;
      s->bodies.push_back(parse_body({"endfor", "else"}, &found));
      --loop_depth_;
      if (found == "else") {
        expect_block_end();
        s->bodies.push_back(parse_body({"endfor"}, &found));
      }
      expect_block_end();
      open_.pop_back();
      return s;
    }
    if (name == "set") {
      auto s = stmt(StmtKind::kSet);
      if (peek().type == Tok::kName && at_op(".", 1)) {
        auto target = std::make_unique<Expr>(Expr{ExprKind::kAttr, line});
        auto ns = std::make_unique<Expr>(Expr{ExprKind::kName, line});
        ns->name = next().text;
        ++i_;
        target->name = expect_name();
        target->items.push_back(std::move(ns));
        s->attr_target = std::move(target);
      } else {
        parse_targets(s.get());
      }
      if (skip_op("=")) {
        s->expr = parse_tuple(true, {});
        expect_block_end();
        return s;
      }
      if (s->attr_target || s->tuple_target) fail("'='");
      s->kind = StmtKind::kSetBlock;
      s->text = s->targets[0];
      if (at_op("|")) s->expr = parse_filter_chain();
      expect_block_end();
      open_.push_back({"set", line});
      std::string found;
      s->bodies.push_back(parse_body({"endset"}, &found));
      expect_block_end();
      open_.pop_back();
      return s;
    }
    if (name == "macro" || name == "call") {
      auto s = stmt(name == "macro" ? StmtKind::kMacro : StmtKind::kCallBlock);
      if (name == "macro") {
        s->text = expect_name();
        expect_op("(");
        parse_params(s.get());
      } else {
        if (skip_op("(")) parse_params(s.get());
        s->expr = parse_expression(true);
        if (s->expr->kind != ExprKind::kCall) throw ParseError{line, "expected a call after 'call'"};
      }
      expect_block_end();
      open_.push_back({name, line});
      int saved_loops = loop_depth_;
      loop_depth_ = 0;
      std::string found;
      s->bodies.push_back(parse_body({"end" + name}, &found));
      loop_depth_ = saved_loops;
      expect_block_end();
      open_.pop_back();
      return s;
    }
    if (name == "filter") {
      auto s = stmt(StmtKind::kFilterBlock);
      s->expr = parse_filter_chain(/*leading_bar=*/false);
      expect_block_end();
      open_.push_back({"filter", line});
      std::string found;
      s->bodies.push_back(parse_body({"endfilter"}, &found));
      expect_block_end();
      open_.pop_back();
      return s;
    }
    if (name == "generation") {
      // transformers' assistant-mask tag: renders its body unchanged.
      auto s = stmt(StmtKind::kIf);
      auto yes = std::make_unique<Expr>(Expr{ExprKind::kLiteral, line});
      yes->value = Value::boolean(true);
      s->conds.push_back(std::move(yes));
      expect_block_end();
      open_.push_back({"generation", line});
      std::string found;
      s->bodies.push_back(parse_body({"endgeneration"}, &found));
      expect_block_end();
      open_.pop_back();
      return s;
    }
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) throw ParseError{line, "'" + name + "' outside of a loop"};
      expect_block_end();
      return stmt(name == "break" ? StmtKind::kBreak : StmtKind::kContinue);
    }
    if (!enders.empty()) {
      throw ParseError{line, "unexpected '" + name + "': expected " + join_tags(enders) + " to close '" +
                                 open_.back().tag + "' opened on line " + std::to_string(open_.back().line)};
    }
    throw ParseError{line, "unknown or unsupported tag '" + name + "'"};
  }

  void parse_targets(Stmt* s) {
    bool parens = skip_op("(");
    s->targets.push_back(expect_name());
    while (skip_op(",")) {
      s->tuple_target = true;
      if (peek().type != Tok::kName) break;
      s->targets.push_back(expect_name());
    }
    if (parens) {
      expect_op(")");
      s->tuple_target = true;
    }
  }

  // Macro and call-block parameters after '(': names with optional defaults, then ')'.
  void parse_params(Stmt* s) {
    while (!skip_op(")")) {
      if (!s->targets.empty()) expect_op(",");
      if (skip_op(")")) break;
      s->targets.push_back(expect_name());
      s->defaults.push_back(skip_op("=") ? parse_expression(true) : nullptr);
    }
  }

  // `| f(args) | g` for {% filter %} and block set; the filtered value is items[0] = null.
  ExprPtr parse_filter_chain(bool leading_bar = true) {
    ExprPtr node;
    bool first = true;
    while (first ? (!leading_bar || at_op("|")) : at_op("|")) {
      if (leading_bar || !first) expect_op("|");
      first = false;
      node = parse_filter(std::move(node));
    }
    return node;
  }

  bool is_tuple_end(const std::vector<std::string>& extra_end) const {
    const Token& t = peek();
    if (t.type == Tok::kVarEnd || t.type == Tok::kBlockEnd || t.type == Tok::kEof) return true;
    if (t.type == Tok::kOp && t.text == ")") return true;
    return t.type == Tok::kName && std::find(extra_end.begin(), extra_end.end(), t.text) != extra_end.end();
  }

  ExprPtr parse_tuple(bool with_condexpr, const std::vector<std::string>& extra_end,
                      bool explicit_parens = false) {
    int line = peek().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(parse_expression(with_condexpr));
      if (at_op(",")) is_tuple = true;
      else break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) fail("an expression");
    }
    auto t = std::make_unique<Expr>(Expr{ExprKind::kTuple, line});
    t->items = std::move(items);
    return t;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    int line = peek().line;
    ExprPtr expr = parse_or();
    while (skip_name("if")) {
      auto c = std::make_unique<Expr>(Expr{ExprKind::kCondExpr, line});
      c->items.push_back(parse_or());
      c->items.push_back(std::move(expr));
      c->items.push_back(skip_name("else") ? parse_condexpr() : nullptr);
      expr = std::move(c);
    }
    return expr;
  }

  ExprPtr binary(const std::string& op, ExprPtr a, ExprPtr b, int line) {
    auto e = std::make_unique<Expr>(Expr{ExprKind::kBinary, line});
    e->name = op;
    e->items.push_back(std::move(a));
    e->items.push_back(std::move(b));
    return e;
  }

  ExprPtr parse_or() {
    Deeper deeper(this);
    ExprPtr left = parse_and();
    while (at_name("or")) {
      deepen();
      int line = next().line;
      left = binary("or", std::move(left), parse_and(), line);
    }
    return left;
  }

  ExprPtr parse_and() {
    Deeper deeper(this);
    ExprPtr left = parse_not();
    while (at_name("and")) {
      deepen();
      int line = next().line;
      left = binary("and", std::move(left), parse_not(), line);
    }
    return left;
  }

  ExprPtr parse_not() {
    Deeper deeper(this);
    if (at_name("not")) {
      int line = next().line;
      auto e = std::make_unique<Expr>(Expr{ExprKind::kUnary, line});
      e->name = "not";
      e->items.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    Deeper deeper(this);
    int line = peek().line;
    ExprPtr first = parse_math1();
    std::vector<std::string> ops;
    std::vector<ExprPtr> operands;
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::kOp && (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == ">" ||
                                 t.text == "<=" || t.text == ">=")) {
        ops.push_back(next().text);
      } else if (at_name("in")) {
        ++i_;
        ops.push_back("in");
      } else if (at_name("not") && at_name("in", 1)) {
        i_ += 2;
        ops.push_back("not in");
      } else {
        break;
      }
      operands.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto e = std::make_unique<Expr>(Expr{ExprKind::kCompare, line});
    e->items.push_back(std::move(first));
    for (auto& o : operands) e->items.push_back(std::move(o));
    e->ops = std::move(ops);
    return e;
  }

  ExprPtr parse_math1() {
    Deeper deeper(this);
    ExprPtr left = parse_concat();
    while (at_op("+") || at_op("-")) {
      deepen();
      Token op = next();
      left = binary(op.text, std::move(left), parse_concat(), op.line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    Deeper deeper(this);
    ExprPtr left = parse_math2();
    while (at_op("~")) {
      deepen();
      int line = next().line;
      left = binary("~", std::move(left), parse_math2(), line);
    }
    return left;
  }

  ExprPtr parse_math2() {
    Deeper deeper(this);
    ExprPtr left = parse_pow();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      deepen();
      Token op = next();
      left = binary(op.text, std::move(left), parse_pow(), op.line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    Deeper deeper(this);
    ExprPtr left = parse_unary(true);
    while (at_op("**")) {
      deepen();
      int line = next().line;
      left = binary("**", std::move(left), parse_unary(true), line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    Deeper deeper(this);
    ExprPtr node;
    if (at_op("-") || at_op("+")) {
      Token op = next();
      node = std::make_unique<Expr>(Expr{ExprKind::kUnary, op.line});
      node->name = op.text;
      node->items.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = peek();
    int line = t.line;
    if (t.type == Tok::kName) {
      std::string n = next().text;
      auto lit = [&](Value v) {
        auto e = std::make_unique<Expr>(Expr{ExprKind::kLiteral, line});
        e->value = std::move(v);
        return e;
      };
      if (n == "true" || n == "True") return lit(Value::boolean(true));
      if (n == "false" || n == "False") return lit(Value::boolean(false));
      if (n == "none" || n == "None") return lit(Value::none());
      auto e = std::make_unique<Expr>(Expr{ExprKind::kName, line});
      e->name = n;
      return e;
    }
    if (t.type == Tok::kString) {
      // Adjacent string literals concatenate, as in Python.
      std::string s;
      while (peek().type == Tok::kString) s += next().text;
      auto e = std::make_unique<Expr>(Expr{ExprKind::kLiteral, line});
      e->value = Value::string(std::move(s));
      return e;
    }
    if (t.type == Tok::kInt || t.type == Tok::kFloat) {
      Token num = next();
      auto e = std::make_unique<Expr>(Expr{ExprKind::kLiteral, line});
      e->value = num.type == Tok::kInt ? Value::integer(num.ival) : Value::real(num.fval);
      return e;
    }
    if (skip_op("(")) {
      ExprPtr e = parse_tuple(true, {}, /*explicit_parens=*/true);
      expect_op(")");
      return e;
    }
    if (skip_op("[")) {
      auto e = std::make_unique<Expr>(Expr{ExprKind::kList, line});
      while (!skip_op("]")) {
        if (!e->items.empty()) expect_op(",");
        if (skip_op("]")) break;
        e->items.push_back(parse_expression(true));
      }
      return e;
    }
    if (skip_op("{")) {
      auto e = std::make_unique<Expr>(Expr{ExprKind::kDict, line});
      while (!skip_op("}")) {
        if (!e->items.empty()) expect_op(",");
        if (skip_op("}")) break;
        e->items.push_back(parse_expression(true));
        expect_op(":");
        e->items.push_back(parse_expression(true));
      }
      return e;
    }
    fail("an expression");
  }

  ExprPtr parse_postfix(ExprPtr node) {
    Deeper deeper(this);
    while (true) {
      int line = peek().line;
      deepen();
      if (skip_op(".")) {
        if (peek().type == Tok::kInt) {
          auto e = std::make_unique<Expr>(Expr{ExprKind::kItem, line});
          auto idx = std::make_unique<Expr>(Expr{ExprKind::kLiteral, line});
          idx->value = Value::integer(next().ival);
          e->items.push_back(std::move(node));
          e->items.push_back(std::move(idx));
          node = std::move(e);
        } else {
          auto e = std::make_unique<Expr>(Expr{ExprKind::kAttr, line});
          e->name = expect_name();
          e->items.push_back(std::move(node));
          node = std::move(e);
        }
      } else if (skip_op("[")) {
        node = parse_subscript(std::move(node), line);
      } else if (at_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr node, int line) {
    ExprPtr parts[3];
    int part = 0;
    bool is_slice = false;
    while (!at_op("]")) {
      if (skip_op(":")) {
        is_slice = true;
        if (++part > 2) fail("']'");
        continue;
      }
      if (parts[part]) fail("':' or ']'");
      parts[part] = parse_expression(true);
      if (at_op(",")) throw ParseError{peek().line, "tuple subscripts are not supported"};
    }
    expect_op("]");
    auto e = std::make_unique<Expr>(Expr{is_slice ? ExprKind::kSlice : ExprKind::kItem, line});
    e->items.push_back(std::move(node));
    if (is_slice) {
      for (auto& p : parts) e->items.push_back(std::move(p));
    } else {
      if (!parts[0]) fail("an index");
      e->items.push_back(std::move(parts[0]));
    }
    return e;
  }

  // Parses "(args, kw=args)" into e (items[1..], kwargs).
  void parse_args(Expr* e) {
    expect_op("(");
    bool first = true;
    while (!skip_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (skip_op(")")) break;
      if (at_op("*") || at_op("**")) throw ParseError{peek().line, "*args and **kwargs in calls are not supported"};
      if (peek().type == Tok::kName && at_op("=", 1)) {
        std::string key = next().text;
        ++i_;
        e->kwargs.emplace_back(key, parse_expression(true));
      } else {
        if (!e->kwargs.empty()) throw ParseError{peek().line, "positional argument after keyword argument"};
        e->items.push_back(parse_expression(true));
        ++e->num_args;
      }
    }
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = std::make_unique<Expr>(Expr{ExprKind::kCall, peek().line});
    e->items.push_back(std::move(node));
    parse_args(e.get());
    return e;
  }

  ExprPtr parse_filter(ExprPtr node) {
    int line = peek().line;
    auto e = std::make_unique<Expr>(Expr{ExprKind::kFilter, line});
    e->name = expect_name();
    while (skip_op(".")) e->name += "." + expect_name();
    e->known = is_known_filter(e->name);
    e->items.push_back(std::move(node));
    if (at_op("(")) parse_args(e.get());
    return e;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    Deeper deeper(this);
    while (true) {
      deepen();
      if (skip_op("|")) {
        node = parse_filter(std::move(node));
      } else if (at_name("is")) {
        int line = next().line;
        bool negated = skip_name("not");
        auto e = std::make_unique<Expr>(Expr{ExprKind::kTest, line});
        e->name = expect_name();
        while (skip_op(".")) e->name += "." + expect_name();
        e->known = is_known_test(e->name);
        e->items.push_back(std::move(node));
        const Token& t = peek();
        if (at_op("(")) {
          parse_args(e.get());
        } else if ((t.type == Tok::kName || t.type == Tok::kString || t.type == Tok::kInt || t.type == Tok::kFloat ||
                    at_op("[") || at_op("{")) &&
                   !at_name("else") && !at_name("or") && !at_name("and")) {
          // `x is divisibleby 3`: one argument without parentheses.
          e->items.push_back(parse_postfix(parse_primary()));
          e->num_args = 1;
        }
        node = std::move(e);
        if (negated) {
          auto n = std::make_unique<Expr>(Expr{ExprKind::kUnary, line});
          n->name = "not";
          n->items.push_back(std::move(node));
          node = std::move(n);
        }
      } else if (at_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  std::vector<Open> open_;
  int loop_depth_ = 0;
};

// jinja2 reports unknown filters and tests at compile time, except inside an `if` statement or an
// inline if-expression, where they fail only when evaluated (so a template may guard a filter
// another environment provides). This pass applies the same rule.
void check_names(const Expr* e, bool soft) {
  if (!e) return;
  if (e->kind == ExprKind::kCondExpr) soft = true;
  if ((e->kind == ExprKind::kFilter || e->kind == ExprKind::kTest) && !e->known && !soft) {
    throw ParseError{e->line, std::string("unknown ") + (e->kind == ExprKind::kFilter ? "filter" : "test") +
                                  " '" + e->name + "'"};
  }
  for (const auto& c : e->items) check_names(c.get(), soft);
  for (const auto& [k, v] : e->kwargs) check_names(v.get(), soft);
}

void check_names(const Body& body, bool soft) {
  for (const auto& s : body) {
    bool inner_soft = soft;
    if (s->kind == StmtKind::kIf) inner_soft = true;
    if (s->kind == StmtKind::kFor || s->kind == StmtKind::kMacro || s->kind == StmtKind::kCallBlock) {
      inner_soft = false;
    }
    check_names(s->expr.get(), s->kind == StmtKind::kIf ? true : soft);
    check_names(s->cond.get(), inner_soft);
    check_names(s->attr_target.get(), soft);
    for (const auto& d : s->defaults) check_names(d.get(), inner_soft);
    for (const auto& c : s->conds) check_names(c.get(), inner_soft);
    for (const auto& b : s->bodies) check_names(b, inner_soft);
  }
}

}  // namespace

Result<std::shared_ptr<const Template>> parse_template(std::string_view source) {
  try {
    std::vector<Token> tokens = Lexer(source).run();
    std::shared_ptr<Template> t = Parser(std::move(tokens)).run();
    check_names(t->body, false);
    return std::shared_ptr<const Template>(std::move(t));
  } catch (const ParseError& e) {
    return make_error("chat template syntax error, line {}: {}", e.line, e.message);
  } catch (const std::exception& e) {  // a library error (std::out_of_range, ...) is still a value
    return make_error("chat template syntax error: {}", e.what());
  }
}

}  // namespace moat::chat_template_detail
