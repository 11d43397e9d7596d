#include "tokenizer/added_vocab.h"

#include <algorithm>

#include "tokenizer/unicode.h"

namespace moat {
namespace {

// The code point that ends at `end` (exclusive) and its length; length 0 when there is none or
// it is ill-formed.
std::pair<char32_t, size_t> code_point_before(std::string_view text, size_t end) {
  if (end == 0) return {0, 0};
  size_t begin = end - 1;
  while (begin > 0 && end - begin < 4 && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) {
    --begin;
  }
  const size_t length = unicode::valid_sequence_length(text, begin);
  if (length != end - begin) return {0, 0};
  return {unicode::decode_at(text, begin, length), length};
}

char32_t code_point_at(std::string_view text, size_t pos) {
  if (pos >= text.size()) return 0;
  const size_t length = unicode::valid_sequence_length(text, pos);
  return length ? unicode::decode_at(text, pos, length) : 0;
}

}  // namespace

AddedVocabulary::AddedVocabulary(std::vector<AddedToken> tokens) : tokens_(std::move(tokens)) {
  for (int32_t i = 0; i < static_cast<int32_t>(tokens_.size()); ++i) {
    const AddedToken& token = tokens_[i];
    if (token.content.empty()) continue;
    Group& group = token.normalized ? normalized_ : raw_;
    group.by_first_byte[static_cast<unsigned char>(token.content[0])].push_back(i);
    group.empty = false;
  }
  for (Group* group : {&raw_, &normalized_}) {
    for (auto& list : group->by_first_byte) {
      std::stable_sort(list.begin(), list.end(), [&](int32_t a, int32_t b) {
        return tokens_[a].content.size() > tokens_[b].content.size();
      });
    }
  }
}

bool AddedVocabulary::fits_single_word(std::string_view text, size_t begin, size_t end) const {
  const char32_t before = code_point_before(text, begin).first;
  const char32_t after = code_point_at(text, end);
  return !(before && unicode::is_word(before)) && !(after && unicode::is_word(after));
}

void AddedVocabulary::split_with(const Group& group, std::string_view text,
                                 std::vector<Segment>& out) const {
  if (group.empty) {
    if (!text.empty()) out.push_back(Segment{text, -1});
    return;
  }
  size_t emitted = 0;  // text before this offset is already in `out`
  size_t pos = 0;
  while (pos < text.size()) {
    const AddedToken* match = nullptr;
    for (int32_t index : group.by_first_byte[static_cast<unsigned char>(text[pos])]) {
      const AddedToken& token = tokens_[index];
      if (text.compare(pos, token.content.size(), token.content) != 0) continue;
      if (token.single_word && !fits_single_word(text, pos, pos + token.content.size())) continue;
      match = &token;
      break;
    }
    if (!match) {
      ++pos;
      continue;
    }
    size_t begin = pos, end = pos + match->content.size();
    if (match->lstrip) {
      while (begin > emitted) {
        const auto [cp, length] = code_point_before(text, begin);
        if (length == 0 || begin - length < emitted || !unicode::is_space(cp)) break;
        begin -= length;
      }
    }
    if (match->rstrip) {
      while (end < text.size()) {
        const char32_t cp = code_point_at(text, end);
        if (!cp || !unicode::is_space(cp)) break;
        end += unicode::valid_sequence_length(text, end);
      }
    }
    if (begin > emitted) out.push_back(Segment{text.substr(emitted, begin - emitted), -1});
    out.push_back(Segment{text.substr(begin, end - begin), match->id});
    emitted = pos = end;
  }
  if (emitted < text.size()) out.push_back(Segment{text.substr(emitted), -1});
}

std::vector<AddedVocabulary::Segment> AddedVocabulary::split(std::string_view text) const {
  std::vector<Segment> first;
  split_with(raw_, text, first);
  if (normalized_.empty) return first;
  std::vector<Segment> out;
  for (const Segment& segment : first) {
    if (segment.id >= 0) {
      out.push_back(segment);
    } else {
      split_with(normalized_, segment.text, out);
    }
  }
  return out;
}

}  // namespace moat
