#include "tokenizer/regex.h"

#include <oniguruma.h>

#include <cctype>
#include <mutex>

namespace moat {

struct Regex::Compiled {
  regex_t* regex = nullptr;
  ~Compiled() {
    if (regex) onig_free(regex);
  }
};

namespace {

void initialize_oniguruma() {
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encodings[] = {ONIG_ENCODING_UTF8};
    onig_initialize(encodings, 1);
  });
}

}  // namespace

Result<Regex> Regex::compile(std::string_view pattern, std::string_view what) {
  initialize_oniguruma();
  auto compiled = std::make_shared<Compiled>();
  OnigErrorInfo info;
  const auto* begin = reinterpret_cast<const OnigUChar*>(pattern.data());
  const int rc = onig_new(&compiled->regex, begin, begin + pattern.size(), ONIG_OPTION_NONE,
                          ONIG_ENCODING_UTF8, ONIG_SYNTAX_RUBY, &info);
  if (rc != ONIG_NORMAL) {
    compiled->regex = nullptr;
    OnigUChar message[ONIG_MAX_ERROR_MESSAGE_LEN];
    onig_error_code_to_str(message, rc, &info);
    return make_error("{}: bad regex /{}/: {}", what, pattern, reinterpret_cast<char*>(message));
  }
  Regex result;
  result.compiled_ = std::move(compiled);
  return result;
}

Result<Regex> Regex::literal(std::string_view literal, std::string_view what) {
  std::string escaped;
  for (char c : literal) {
    // Escaping every ASCII punctuation character is harmless and covers all metacharacters.
    if (std::ispunct(static_cast<unsigned char>(c))) escaped += '\\';
    if (c == '\n') {
      escaped += "\\n";
    } else if (c == '\r') {
      escaped += "\\r";
    } else if (c == '\t') {
      escaped += "\\t";
    } else {
      escaped += c;
    }
  }
  return compile(escaped, what);
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  if (!compiled_ || text.empty()) return matches;
  const auto* start = reinterpret_cast<const OnigUChar*>(text.data());
  const auto* end = start + text.size();
  OnigRegion* region = onig_region_new();
  size_t pos = 0;
  while (pos <= text.size()) {
    const int rc = onig_search(compiled_->regex, start, end, start + pos, end, region,
                               ONIG_OPTION_NONE);
    if (rc < 0) break;  // ONIG_MISMATCH (or an internal limit): no more matches
    const size_t match_begin = static_cast<size_t>(region->beg[0]);
    const size_t match_end = static_cast<size_t>(region->end[0]);
    if (match_end > match_begin) {
      matches.emplace_back(match_begin, match_end);
      pos = match_end;
    } else {
      // Empty match: step over one whole character so we never split a UTF-8 sequence.
      size_t step = 1;
      while (match_begin + step < text.size() &&
             (static_cast<unsigned char>(text[match_begin + step]) & 0xC0) == 0x80) {
        ++step;
      }
      pos = match_begin + step;
    }
  }
  onig_region_free(region, 1);
  return matches;
}

}  // namespace moat
