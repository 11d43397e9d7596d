// IncrementalDetokenizer (declared in tokenizer.h).
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace moat {

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}

std::string IncrementalDetokenizer::push(int32_t id) {
  pending_ += tokenizer_.token_bytes(id);
  const size_t hold = unicode::incomplete_suffix_length(pending_);
  std::string out = unicode::sanitize(std::string_view(pending_).substr(0, pending_.size() - hold));
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string IncrementalDetokenizer::flush() {
  std::string out = unicode::sanitize(pending_);
  pending_.clear();
  return out;
}

}  // namespace moat
