#include "tokenizer/bpe.h"

#include <queue>

#include "tokenizer/unicode.h"

namespace moat {
namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

Result<BpeModel> BpeModel::from_merges(StringMap<int32_t> vocab,
                                       const std::vector<std::pair<std::string, std::string>>& merges,
                                       MergesOptions options, std::string_view what) {
  BpeModel model;
  model.options_ = options;
  model.vocab_ = std::move(vocab);
  model.merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const auto l = model.vocab_.find(left);
    const auto r = model.vocab_.find(right);
    const auto merged = model.vocab_.find(left + right);
    if (l == model.vocab_.end() || r == model.vocab_.end() || merged == model.vocab_.end()) {
      return make_error("{}: model.merges[{}] (\"{}\" \"{}\") uses a token missing from "
                        "model.vocab",
                        what, rank, left, right);
    }
    // The first occurrence of a duplicated pair keeps its (lower) rank, as in Hugging Face.
    model.merges_.try_emplace(pair_key(l->second, r->second),
                              Merge{static_cast<int32_t>(rank), merged->second});
  }
  return model;
}

BpeModel BpeModel::from_ranks(StringMap<int32_t> ranks) {
  BpeModel model;
  model.by_bytes_ = true;
  int32_t max_id = -1;
  for (const auto& [bytes, id] : ranks) max_id = std::max(max_id, id);
  model.bytes_of_id_.resize(static_cast<size_t>(max_id + 1));
  for (const auto& [bytes, id] : ranks) model.bytes_of_id_[id] = bytes;
  model.vocab_ = std::move(ranks);
  return model;
}

std::optional<int32_t> BpeModel::symbol_id(std::string_view symbol) const {
  if (const auto it = vocab_.find(symbol); it != vocab_.end()) return it->second;
  if (const auto it = fallback_.find(symbol); it != fallback_.end()) return it->second;
  return options_.unk_id;
}

std::optional<BpeModel::Merge> BpeModel::find_merge(int32_t left, int32_t right) const {
  if (!by_bytes_) {
    const auto it = merges_.find(pair_key(left, right));
    if (it == merges_.end()) return std::nullopt;
    return it->second;
  }
  if (static_cast<size_t>(left) >= bytes_of_id_.size() ||
      static_cast<size_t>(right) >= bytes_of_id_.size()) {
    return std::nullopt;  // a fallback symbol outside the rank table never merges
  }
  std::string joined;
  joined.reserve(bytes_of_id_[left].size() + bytes_of_id_[right].size());
  joined += bytes_of_id_[left];
  joined += bytes_of_id_[right];
  const auto it = vocab_.find(joined);
  if (it == vocab_.end()) return std::nullopt;
  return Merge{it->second, it->second};
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (const auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }

  // Symbols form a doubly linked list over their start positions; a merge folds the right
  // symbol into the left one.
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  size_t pos = 0;
  while (pos < word.size()) {
    size_t length = 1;
    if (!by_bytes_) {
      length = unicode::valid_sequence_length(word, pos);
      if (length == 0) length = 1;
    }
    if (const auto id = symbol_id(word.substr(pos, length))) {
      const auto index = static_cast<int32_t>(symbols.size());
      symbols.push_back(Symbol{*id, index - 1, index + 1});
    }
    pos += length;
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  if (symbols.size() > 1) {
    // Candidates (rank, left symbol, left id, right id); stale ones are skipped when popped.
    struct Candidate {
      int32_t rank;
      int32_t left;
      int32_t left_id;
      int32_t right_id;
      int32_t merged_id;
      bool operator>(const Candidate& o) const {
        return rank != o.rank ? rank > o.rank : left > o.left;
      }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
    const auto consider = [&](int32_t left) {
      if (left < 0) return;
      const int32_t right = symbols[left].next;
      if (right < 0) return;
      if (const auto merge = find_merge(symbols[left].id, symbols[right].id)) {
        queue.push(Candidate{merge->rank, left, symbols[left].id, symbols[right].id, merge->id});
      }
    };
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
    while (!queue.empty()) {
      const Candidate c = queue.top();
      queue.pop();
      Symbol& left = symbols[c.left];
      if (left.id != c.left_id || left.next < 0 || symbols[left.next].id != c.right_id) continue;
      const int32_t right = left.next;
      left.id = c.merged_id;
      left.next = symbols[right].next;
      if (left.next >= 0) symbols[left.next].prev = c.left;
      symbols[right].id = -1;  // dead
      if (left.prev >= 0) consider(left.prev);
      consider(c.left);
    }
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
}

}  // namespace moat
