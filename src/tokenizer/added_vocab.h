// Added tokens (special tokens such as "<|endoftext|>", and user tokens such as mpt's runs of
// spaces) are found in the raw text before normalization and pre-tokenization, leftmost-longest,
// as Hugging Face does: first the tokens with normalized=false, then the normalized ones in the
// text left between those.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moat {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;       // swallows whitespace on its left
  bool rstrip = false;       // swallows whitespace on its right
  bool single_word = false;  // matches only when not inside a word
  bool normalized = false;   // matched after the normalizer (which is the identity here)
};

class AddedVocabulary {
 public:
  AddedVocabulary() = default;
  explicit AddedVocabulary(std::vector<AddedToken> tokens);

  struct Segment {
    std::string_view text;
    int32_t id;  // -1: ordinary text for the pre-tokenizer and model
  };
  // Cuts `text` into added-token matches and the ordinary text between them.
  std::vector<Segment> split(std::string_view text) const;

  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  struct Group {
    // Indices into tokens_, per first byte, longest content first.
    std::vector<int32_t> by_first_byte[256];
    bool empty = true;
  };
  void split_with(const Group& group, std::string_view text, std::vector<Segment>& out) const;
  bool fits_single_word(std::string_view text, size_t begin, size_t end) const;

  std::vector<AddedToken> tokens_;
  Group raw_;         // normalized == false
  Group normalized_;  // normalized == true
};

}  // namespace moat
