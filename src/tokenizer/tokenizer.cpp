#include "tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "tokenizer/byte_level.h"
#include "tokenizer/tokenizer_data.h"
#include "tokenizer/unicode.h"

namespace moat {
namespace fs = std::filesystem;
using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Shared loading helpers

Result<json> read_json_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("{}: cannot open file", path.string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  json parsed = json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    // Re-parse with exceptions only to get the position of the error into the message.
    try {
      const json unused = json::parse(buffer.str());
      (void)unused;
    } catch (const json::exception& e) {  // parse_error, and out_of_range for 1e400
      return make_error("{}: malformed JSON: {}", path.string(), e.what());
    }
    return make_error("{}: malformed JSON", path.string());
  }
  return parsed;
}

namespace {

// bos_token / eos_token: a string, {"content": ...} (an AddedToken dump), or null.
Result<std::optional<std::string>> token_field(const json& config, const char* field,
                                               const std::string& what) {
  const auto it = config.find(field);
  if (it == config.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return std::optional<std::string>((*it)["content"].get<std::string>());
  }
  return make_error("{}: {} must be a string or {{\"content\": string}}", what, field);
}

bool bool_field(const json& object, const char* field, bool fallback) {
  const auto it = object.find(field);
  return it != object.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

Result<AddedToken> parse_added_token(const json& entry, int64_t id, const std::string& where) {
  if (!entry.is_object() || !entry.contains("content") || !entry["content"].is_string()) {
    return make_error("{}: must be an object with a string \"content\"", where);
  }
  if (id < 0 || id > kMaxTokenId)
    return make_error("{}: id {} out of range (expected 0 to {})", where, id, kMaxTokenId);
  AddedToken token;
  token.id = static_cast<int32_t>(id);
  token.content = entry["content"].get<std::string>();
  token.special = bool_field(entry, "special", false);
  token.lstrip = bool_field(entry, "lstrip", false);
  token.rstrip = bool_field(entry, "rstrip", false);
  token.single_word = bool_field(entry, "single_word", false);
  token.normalized = bool_field(entry, "normalized", !token.special);
  return token;
}

}  // namespace

Result<TokenizerConfig> read_tokenizer_config(const fs::path& dir) {
  TokenizerConfig config;
  const fs::path path = dir / "tokenizer_config.json";
  if (fs::exists(path)) {
    MOAT_ASSIGN_OR_RETURN(json j, read_json_file(path));
    const std::string what = path.string();
    if (!j.is_object()) return make_error("{}: top level must be an object", what);
    MOAT_ASSIGN_OR_RETURN(config.bos_token, token_field(j, "bos_token", what));
    MOAT_ASSIGN_OR_RETURN(config.eos_token, token_field(j, "eos_token", what));
    if (const auto it = j.find("chat_template"); it != j.end() && !it->is_null()) {
      if (it->is_string()) {
        config.chat_template = it->get<std::string>();
      } else if (it->is_array()) {
        // Named templates [{"name", "template"}]: the one called "default", else the first.
        for (const json& named : *it) {
          if (!named.is_object() || !named.contains("template") || !named["template"].is_string()) {
            return make_error("{}: chat_template entries must be {{\"name\", \"template\"}}", what);
          }
          if (config.chat_template.empty() || named.value("name", "") == "default") {
            config.chat_template = named["template"].get<std::string>();
          }
        }
      } else {
        return make_error("{}: chat_template must be a string or a list of named templates", what);
      }
    }
    if (const auto it = j.find("added_tokens_decoder"); it != j.end() && !it->is_null()) {
      if (!it->is_object()) return make_error("{}: added_tokens_decoder must be an object", what);
      for (const auto& [key, entry] : it->items()) {
        const std::string where = fmt::format("{} added_tokens_decoder[\"{}\"]", what, key);
        int64_t id = -1;
        try {
          size_t used = 0;
          id = std::stoll(key, &used);
          if (used != key.size()) id = -1;
        } catch (...) {
          id = -1;
        }
        if (id < 0) return make_error("{}: key must be a token id", where);
        MOAT_ASSIGN_OR_RETURN(AddedToken token, parse_added_token(entry, id, where));
        config.added_tokens_decoder.push_back(std::move(token));
      }
      std::sort(config.added_tokens_decoder.begin(), config.added_tokens_decoder.end(),
                [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
    }
  }
  if (config.chat_template.empty()) {
    // Newer Hugging Face repos keep the template in its own file.
    const fs::path jinja = dir / "chat_template.jinja";
    if (fs::exists(jinja)) {
      std::ifstream in(jinja, std::ios::binary);
      std::stringstream buffer;
      buffer << in.rdbuf();
      config.chat_template = buffer.str();
    }
  }
  return config;
}

void TokenizerData::index() {
  special.resize(bytes_of_id.size(), 0);
  for (const AddedToken& token : added.tokens()) {
    if (token.special) special[token.id] = 1;
  }
  id_of_token.reserve(token_of_id.size());
  id_of_bytes.reserve(bytes_of_id.size());
  for (int32_t id = 0; id < static_cast<int32_t>(token_of_id.size()); ++id) {
    if (!token_of_id[id].empty()) id_of_token.try_emplace(token_of_id[id], id);
  }
  // Added tokens win over vocabulary entries with the same string, as in Hugging Face.
  for (const AddedToken& token : added.tokens()) id_of_token[token.content] = token.id;
  for (int32_t id = 0; id < static_cast<int32_t>(bytes_of_id.size()); ++id) {
    if (!bytes_of_id[id].empty()) id_of_bytes.try_emplace(bytes_of_id[id], id);
  }
}

void resolve_bos_eos(const TokenizerConfig& config, TokenizerData& data) {
  const auto find = [&](const std::string& token) -> std::optional<int32_t> {
    const auto it = data.id_of_token.find(token);
    if (it == data.id_of_token.end()) return std::nullopt;
    return it->second;
  };
  const auto guess = [&](std::initializer_list<const char*> names) -> std::optional<int32_t> {
    for (const char* name : names) {
      if (const auto id = find(name); id && data.special[*id]) return id;
    }
    return std::nullopt;
  };
  data.bos_id = config.bos_token ? find(*config.bos_token)
                                 : guess({"<｜begin▁of▁sentence｜>", "[BOS]", "<|begin_of_text|>",
                                          "<s>", "<|endoftext|>"});
  data.eos_id = config.eos_token ? find(*config.eos_token)
                                 : guess({"<｜end▁of▁sentence｜>", "[EOS]", "<|end_of_text|>",
                                          "</s>", "<|endoftext|>"});
}

Status check_token_ids_dense(int64_t max_id, int64_t defined, std::string_view what) {
  if (max_id + 1 - defined > kMaxUnusedTokenIds) {
    return make_error("{}: ids run to {} but only {} tokens are defined: more than {} ids would name no token "
                      "(the id tables are sized by the largest id)",
                      what, max_id, defined, kMaxUnusedTokenIds);
  }
  return ok_status();
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json

namespace {

Status check_normalizer(const json& normalizer, const std::string& what, const std::string& field) {
  if (normalizer.is_null()) return ok_status();
  if (!normalizer.is_object() || !normalizer.contains("type") || !normalizer["type"].is_string()) {
    return make_error("{}: {} must be null or an object with a string \"type\"", what, field);
  }
  const std::string type = normalizer["type"].get<std::string>();
  if (type == "Sequence") {
    const auto it = normalizer.find("normalizers");
    if (it == normalizer.end() || !it->is_array()) {
      return make_error("{}: {}.normalizers must be an array", what, field);
    }
    for (size_t i = 0; i < it->size(); ++i) {
      MOAT_TRY(check_normalizer((*it)[i], what, fmt::format("{}.normalizers[{}]", field, i)));
    }
    return ok_status();
  }
  // NFC is accepted as the identity: no decomposition/composition tables are built in, and the
  // vocabularies that declare it (mpt) are fed NFC text in practice (all test data is NFC).
  // Non-NFC input therefore may tokenize differently from Hugging Face.
  if (type == "NFC") return ok_status();
  return make_error("{}: {}.type \"{}\" is not supported (supported: Sequence, NFC)", what, field,
                    type);
}

Result<bool> decoder_is_byte_level(const json& decoder, const std::string& what) {
  if (decoder.is_null()) return false;
  const std::string type = decoder.is_object() ? decoder.value("type", "") : "";
  if (type == "ByteLevel") return true;
  if (type == "Sequence" && decoder.contains("decoders") && decoder["decoders"].is_array()) {
    bool byte_level = false;
    for (const json& step : decoder["decoders"]) {
      MOAT_ASSIGN_OR_RETURN(bool step_byte_level, decoder_is_byte_level(step, what));
      byte_level = byte_level || step_byte_level;
    }
    return byte_level;
  }
  return make_error("{}: decoder.type \"{}\" is not supported (supported: ByteLevel, or null)",
                    what, type);
}

Result<std::shared_ptr<const TokenizerData>> load_tokenizer_json(const fs::path& dir) {
  const fs::path path = dir / "tokenizer.json";
  const std::string what = path.string();
  MOAT_ASSIGN_OR_RETURN(json j, read_json_file(path));
  if (!j.is_object()) return make_error("{}: top level must be an object", what);

  const auto model_it = j.find("model");
  if (model_it == j.end() || !model_it->is_object()) {
    return make_error("{}: \"model\" must be an object", what);
  }
  const json& model = *model_it;
  const std::string type = model.value("type", "BPE");
  if (type != "BPE") {
    return make_error("{}: model.type \"{}\" is not supported (supported: BPE)", what, type);
  }
  if (bool_field(model, "byte_fallback", false)) {
    return make_error("{}: model.byte_fallback is not supported", what);
  }
  for (const char* field : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto it = model.find(field);
    if (it != model.end() && it->is_string() && !it->get<std::string>().empty()) {
      return make_error("{}: model.{} is not supported", what, field);
    }
  }
  if (const auto it = model.find("dropout"); it != model.end() && it->is_number() &&
                                             it->get<double>() > 0.0) {
    return make_error("{}: model.dropout is not supported", what);
  }

  const auto vocab_it = model.find("vocab");
  if (vocab_it == model.end() || !vocab_it->is_object()) {
    return make_error("{}: model.vocab must be an object of token -> id", what);
  }
  StringMap<int32_t> vocab;
  vocab.reserve(vocab_it->size());
  int64_t max_id = -1;
  for (const auto& [token, id] : vocab_it->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > kMaxTokenId) {
      return make_error("{}: model.vocab[\"{}\"] must be a non-negative integer id (at most {}), got {}", what,
                        token, kMaxTokenId, id.dump());
    }
    vocab.emplace(token, static_cast<int32_t>(id.get<int64_t>()));
    max_id = std::max(max_id, id.get<int64_t>());
  }

  const auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array()) {
    return make_error("{}: model.merges must be an array", what);
  }
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(merges_it->size());
  for (size_t i = 0; i < merges_it->size(); ++i) {
    const json& merge = (*merges_it)[i];
    if (merge.is_string()) {
      const std::string s = merge.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return make_error("{}: model.merges[{}] \"{}\" must be two tokens separated by one space",
                          what, i, s);
      }
      merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
    } else {
      return make_error("{}: model.merges[{}] must be \"a b\" or [\"a\", \"b\"]", what, i);
    }
  }

  BpeModel::MergesOptions options;
  options.ignore_merges = bool_field(model, "ignore_merges", false);
  if (const auto it = model.find("unk_token"); it != model.end() && it->is_string()) {
    const auto unk = vocab.find(it->get<std::string>());
    if (unk == vocab.end()) {
      return make_error("{}: model.unk_token \"{}\" is not in model.vocab", what,
                        it->get<std::string>());
    }
    options.unk_id = unk->second;
  }

  std::vector<AddedToken> added;
  if (const auto it = j.find("added_tokens"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return make_error("{}: added_tokens must be an array", what);
    for (size_t i = 0; i < it->size(); ++i) {
      const json& entry = (*it)[i];
      const std::string where = fmt::format("{} added_tokens[{}]", what, i);
      if (!entry.is_object() || !entry.contains("id") || !entry["id"].is_number_integer()) {
        return make_error("{}: must have an integer \"id\"", where);
      }
      MOAT_ASSIGN_OR_RETURN(AddedToken token,
                            parse_added_token(entry, entry["id"].get<int64_t>(), where));
      max_id = std::max<int64_t>(max_id, token.id);
      added.push_back(std::move(token));
    }
  }

  MOAT_TRY(check_normalizer(j.value("normalizer", json()), what, "normalizer"));
  auto data = std::make_shared<TokenizerData>();
  MOAT_ASSIGN_OR_RETURN(data->pre_tokenizer,
                        PreTokenizer::from_json(j.value("pre_tokenizer", json()), what));
  MOAT_ASSIGN_OR_RETURN(bool byte_level, decoder_is_byte_level(j.value("decoder", json()), what));
  if (data->pre_tokenizer.maps_to_byte_level()) {
    data->stray_bytes = TokenizerData::StrayBytes::kByteLevel;
  }

  // an upper bound on the distinct ids (an added token usually repeats a vocabulary entry)
  MOAT_TRY(check_token_ids_dense(max_id, static_cast<int64_t>(vocab.size() + added.size()), what));
  const size_t size = static_cast<size_t>(max_id + 1);
  data->bytes_of_id.resize(size);
  data->token_of_id.resize(size);
  for (const auto& [token, id] : vocab) {
    data->token_of_id[id] = token;
    data->bytes_of_id[id] = byte_level ? byte_level::decode(token) : token;
  }
  // Hugging Face runs added tokens through the decoder too (DeepSeek's added "õ" decodes to the
  // byte 0xF5 it stands for; "<｜begin▁of▁sentence｜>" stays as it is).
  StringMap<int32_t> fallback;
  for (const AddedToken& token : added) {
    data->token_of_id[token.id] = token.content;
    data->bytes_of_id[token.id] = byte_level ? byte_level::decode(token.content) : token.content;
    if (!vocab.contains(token.content)) fallback.emplace(token.content, token.id);
  }

  MOAT_ASSIGN_OR_RETURN(data->model,
                        BpeModel::from_merges(std::move(vocab), merges, options, what));
  data->model.set_symbol_fallback(std::move(fallback));
  data->added = AddedVocabulary(std::move(added));
  data->index();

  MOAT_ASSIGN_OR_RETURN(TokenizerConfig config, read_tokenizer_config(dir));
  resolve_bos_eos(config, *data);
  data->chat_template = std::move(config.chat_template);
  return std::shared_ptr<const TokenizerData>(std::move(data));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Tokenizer

Tokenizer::Tokenizer() : data_(std::make_shared<TokenizerData>()) {}

Tokenizer::Tokenizer(std::shared_ptr<const TokenizerData> data) : data_(std::move(data)) {}

Result<Tokenizer> Tokenizer::load(const fs::path& dir) {
  if (fs::exists(dir / "tokenizer.json")) {
    MOAT_ASSIGN_OR_RETURN(auto data, load_tokenizer_json(dir));
    return Tokenizer(std::move(data));
  }
  if (fs::exists(dir / "tiktoken.model")) {
    MOAT_ASSIGN_OR_RETURN(auto data, load_tiktoken(dir));
    return Tokenizer(std::move(data));
  }
  return make_error("{}: no tokenizer.json or tiktoken.model in this directory", dir.string());
}

void Tokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  const TokenizerData& d = *data_;
  std::vector<std::string> words;
  // Valid UTF-8 runs go through the pre-tokenizer; stray bytes between them are words of their
  // own, since no regex may look at them.
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = pos;
    while (end < text.size()) {
      const size_t length = unicode::valid_sequence_length(text, end);
      if (length == 0) break;
      end += length;
    }
    if (end > pos) {
      words.clear();
      d.pre_tokenizer.split(text.substr(pos, end - pos), words);
      for (const std::string& word : words) d.model.encode_word(word, out);
      pos = end;
    }
    while (end < text.size() && unicode::valid_sequence_length(text, end) == 0) ++end;
    if (end > pos) {
      const std::string_view stray = text.substr(pos, end - pos);
      if (d.stray_bytes == TokenizerData::StrayBytes::kByteLevel) {
        d.model.encode_word(byte_level::encode(stray), out);
      } else if (d.stray_bytes == TokenizerData::StrayBytes::kRaw) {
        d.model.encode_word(stray, out);
      }
      pos = end;
    }
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  for (const AddedVocabulary::Segment& segment : data_->added.split(text)) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
    } else {
      encode_text(segment.text, ids);
    }
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && static_cast<size_t>(id) < data_->bytes_of_id.size()) {
      out += data_->bytes_of_id[id];
    }
  }
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= data_->bytes_of_id.size()) return {};
  return data_->bytes_of_id[id];
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(data_->bytes_of_id.size()); }

std::optional<int32_t> Tokenizer::bos_id() const { return data_->bos_id; }
std::optional<int32_t> Tokenizer::eos_id() const { return data_->eos_id; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = data_->id_of_token.find(token); it != data_->id_of_token.end()) {
    return it->second;
  }
  if (const auto it = data_->id_of_bytes.find(token); it != data_->id_of_bytes.end()) {
    return it->second;
  }
  return std::nullopt;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < data_->special.size() && data_->special[id];
}

const std::string& Tokenizer::chat_template() const { return data_->chat_template; }

}  // namespace moat
