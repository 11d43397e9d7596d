// Oniguruma wrapper: Hugging Face tokenizer.json regexes are Oniguruma syntax (the `tokenizers`
// crate compiles them with onig's default Ruby syntax), and Kimi's pattern needs \p{Han} and
// class intersection (&&), which PCRE2 and std::regex lack. Patterns compile once; matching is
// safe from many threads because each search gets its own region.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace moat {

class Regex {
 public:
  // `what` names the pattern's origin (file and field) for the error message.
  static Result<Regex> compile(std::string_view pattern, std::string_view what);
  // Pattern matching `literal` exactly (Split's {"String": ...} form).
  static Result<Regex> literal(std::string_view literal, std::string_view what);

  // Non-empty, non-overlapping matches left to right, as [begin, end) byte offsets. `text` must
  // be valid UTF-8 (callers split invalid bytes off first).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  struct Compiled;
  std::shared_ptr<const Compiled> compiled_;
};

}  // namespace moat
