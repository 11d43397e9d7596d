// Hugging Face pre-tokenizers: cut normalized text into words before BPE. Supported:
// ByteLevel, Split, Digits, Punctuation, Whitespace, WhitespaceSplit and Sequence. Each step runs
// on every piece the previous step left, and ByteLevel maps its pieces to the byte-level alphabet,
// so later steps (falcon's Digits and Split) see the mapped characters, as in Hugging Face.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "tokenizer/regex.h"

namespace moat {

// How a Split-like step treats the spans its pattern matches.
enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

class PreTokenizer {
 public:
  // `config` is tokenizer.json's "pre_tokenizer" (null means: the whole text is one word).
  // `what` names the file for error messages.
  static Result<PreTokenizer> from_json(const nlohmann::json& config, std::string_view what);
  // One regex, matches kept as words and gaps kept too (tiktoken-style splitting that never
  // drops text).
  static PreTokenizer from_regex(Regex regex);

  // Appends the words of `text` (valid UTF-8) to `words`.
  void split(std::string_view text, std::vector<std::string>& words) const;

  // True when a ByteLevel step maps words to the byte-level alphabet.
  bool maps_to_byte_level() const { return maps_to_byte_level_; }

 private:
  struct Step {
    enum class Kind { kSplit, kByteLevel } kind = Kind::kSplit;
    Regex regex;                       // kSplit; for kByteLevel, the GPT-2 regex when use_regex
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;
    bool use_regex = true;             // kByteLevel
    bool add_prefix_space = false;     // kByteLevel
  };

  static Status add_steps(const nlohmann::json& config, std::string_view what,
                          std::string_view field, PreTokenizer& out);
  void apply(const Step& step, std::string_view piece, std::vector<std::string>& out) const;

  std::vector<Step> steps_;
  bool maps_to_byte_level_ = false;
};

// GPT-2's pre-tokenizer regex, built into Hugging Face's ByteLevel(use_regex=true).
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace moat
