#include "tokenizer/tiktoken.h"

#include <charconv>
#include <fstream>
#include <unordered_map>

#include "tokenizer/byte_level.h"
#include "tokenizer/tokenizer_data.h"

namespace moat {
namespace tiktoken {

std::optional<std::string> base64_decode(std::string_view text) {
  while (!text.empty() && text.back() == '=') text.remove_suffix(1);
  std::string out;
  out.reserve(text.size() * 3 / 4);
  uint32_t bits = 0;
  int count = 0;
  for (char c : text) {
    int v;
    if (c >= 'A' && c <= 'Z') {
      v = c - 'A';
    } else if (c >= 'a' && c <= 'z') {
      v = c - 'a' + 26;
    } else if (c >= '0' && c <= '9') {
      v = c - '0' + 52;
    } else if (c == '+') {
      v = 62;
    } else if (c == '/') {
      v = 63;
    } else {
      return std::nullopt;
    }
    bits = (bits << 6) | static_cast<uint32_t>(v);
    count += 6;
    if (count >= 8) {
      count -= 8;
      out += static_cast<char>((bits >> count) & 0xFF);
    }
  }
  if (count >= 6) return std::nullopt;  // one leftover character cannot encode a byte
  return out;
}

}  // namespace tiktoken

Result<std::shared_ptr<const TokenizerData>> load_tiktoken(const std::filesystem::path& dir) {
  const auto path = dir / "tiktoken.model";
  const std::string what = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("{}: cannot open file", what);

  StringMap<int32_t> ranks;
  std::unordered_map<int32_t, size_t> line_of_rank;
  int32_t num_base = 0;
  std::string line;
  for (size_t line_number = 1; std::getline(in, line); ++line_number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos) {
      return make_error("{}:{}: expected \"<base64 token> <rank>\"", what, line_number);
    }
    const auto bytes = tiktoken::base64_decode(std::string_view(line).substr(0, space));
    int32_t rank = -1;
    const char* first = line.data() + space + 1;
    const char* last = line.data() + line.size();
    const auto [end, ec] = std::from_chars(first, last, rank);
    if (!bytes || bytes->empty() || ec != std::errc() || end != last || rank < 0) {
      return make_error("{}:{}: expected \"<base64 token> <rank>\"", what, line_number);
    }
    if (rank > kMaxTokenId - tiktoken::kNumReservedSpecialTokens) {
      return make_error("{}:{}: rank {} out of range (expected 0 to {})", what, line_number, rank,
                        kMaxTokenId - tiktoken::kNumReservedSpecialTokens);
    }
    if (!ranks.emplace(*bytes, rank).second) {
      return make_error("{}:{}: token listed twice", what, line_number);
    }
    // Two tokens with one rank would share an id, and decode could not tell them apart.
    if (const auto [it, added] = line_of_rank.emplace(rank, line_number); !added) {
      return make_error("{}:{}: rank {} already given on line {}", what, line_number, rank, it->second);
    }
    num_base = std::max(num_base, rank + 1);
  }
  if (ranks.empty()) return make_error("{}: no tokens", what);
  // A tiktoken file numbers its tokens 0 to N-1. Gaps would leave ids with no bytes, and the id
  // tables are sized by the largest rank: a 12-byte file naming rank 13,301,111 made every load
  // allocate ~850 MB (found by fuzz_tiktoken).
  if (static_cast<size_t>(num_base) != ranks.size()) {
    return make_error("{}: ranks run to {} but the file has {} tokens: ranks must be 0 to {} without gaps", what,
                      num_base - 1, ranks.size(), ranks.size() - 1);
  }

  MOAT_ASSIGN_OR_RETURN(TokenizerConfig config, read_tokenizer_config(dir));
  std::vector<AddedToken> specials = config.added_tokens_decoder;
  // Specials are matched in the raw text; tiktoken has no normalizer.
  for (AddedToken& token : specials) token.normalized = false;
  // Name the unnamed reserved ids as tokenization_kimi.py does.
  std::vector<uint8_t> named(static_cast<size_t>(num_base + tiktoken::kNumReservedSpecialTokens), 0);
  int32_t max_id = num_base - 1;
  for (const AddedToken& token : specials) {
    if (static_cast<size_t>(token.id) < named.size()) named[token.id] = 1;
    max_id = std::max(max_id, token.id);
  }
  for (int32_t id = num_base; id < num_base + tiktoken::kNumReservedSpecialTokens; ++id) {
    if (named[id]) continue;
    AddedToken reserved;
    reserved.id = id;
    reserved.content = fmt::format("<|reserved_token_{}|>", id);
    reserved.special = true;
    specials.push_back(std::move(reserved));
    max_id = std::max(max_id, id);
  }

  // tokenizer_config.json's specials extend the tables too: one at a far id would size them by it
  MOAT_TRY(check_token_ids_dense(max_id, static_cast<int64_t>(ranks.size() + specials.size()),
                                 (dir / "tokenizer_config.json").string()));
  auto data = std::make_shared<TokenizerData>();
  data->stray_bytes = TokenizerData::StrayBytes::kRaw;
  MOAT_ASSIGN_OR_RETURN(Regex pattern,
                        Regex::compile(tiktoken::kKimiPattern, "tiktoken default (Kimi) pattern"));
  data->pre_tokenizer = PreTokenizer::from_regex(std::move(pattern));
  const size_t size = static_cast<size_t>(max_id + 1);
  data->bytes_of_id.resize(size);
  data->token_of_id.resize(size);
  for (const auto& [bytes, id] : ranks) {
    data->bytes_of_id[id] = bytes;
    // The string form Hugging Face's tiktoken conversion gives these tokens.
    data->token_of_id[id] = byte_level::encode(bytes);
  }
  for (const AddedToken& token : specials) {
    data->bytes_of_id[token.id] = token.content;
    data->token_of_id[token.id] = token.content;
  }
  data->model = BpeModel::from_ranks(std::move(ranks));
  data->added = AddedVocabulary(std::move(specials));
  data->index();
  resolve_bos_eos(config, *data);
  data->chat_template = std::move(config.chat_template);
  return std::shared_ptr<const TokenizerData>(std::move(data));
}

}  // namespace moat
