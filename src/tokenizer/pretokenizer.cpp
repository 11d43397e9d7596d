#include "tokenizer/pretokenizer.h"

#include <nlohmann/json.hpp>

#include "tokenizer/byte_level.h"

namespace moat {
namespace {

using Spans = std::vector<std::pair<size_t, size_t>>;

Result<SplitBehavior> parse_behavior(const nlohmann::json& value, std::string_view what,
                                     std::string_view field) {
  static const std::pair<const char*, SplitBehavior> kNames[] = {
      {"Isolated", SplitBehavior::kIsolated},
      {"Removed", SplitBehavior::kRemoved},
      {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
      {"MergedWithNext", SplitBehavior::kMergedWithNext},
      {"Contiguous", SplitBehavior::kContiguous},
  };
  if (value.is_string()) {
    for (const auto& [name, behavior] : kNames) {
      if (value.get<std::string>() == name) return behavior;
    }
  }
  return make_error("{}: {}.behavior is {}; expected one of Isolated, Removed, "
                    "MergedWithPrevious, MergedWithNext, Contiguous",
                    what, field, value.dump());
}

// The stretches between matches become the spans (Split's invert flag).
Spans invert_spans(const Spans& spans, size_t size) {
  Spans inverted;
  size_t pos = 0;
  for (const auto& [begin, end] : spans) {
    if (begin > pos) inverted.emplace_back(pos, begin);
    pos = end;
  }
  if (pos < size) inverted.emplace_back(pos, size);
  return inverted;
}

void emit(std::string_view text, size_t begin, size_t end, std::vector<std::string>& out) {
  if (end > begin) out.emplace_back(text.substr(begin, end - begin));
}

void split_by_spans(std::string_view text, Spans spans, SplitBehavior behavior,
                    std::vector<std::string>& out) {
  if (behavior == SplitBehavior::kContiguous) {
    Spans fused;
    for (const auto& span : spans) {
      if (!fused.empty() && fused.back().second == span.first) {
        fused.back().second = span.second;
      } else {
        fused.push_back(span);
      }
    }
    spans = std::move(fused);
    behavior = SplitBehavior::kIsolated;
  }
  size_t pos = 0;
  for (const auto& [begin, end] : spans) {
    switch (behavior) {
      case SplitBehavior::kIsolated:
        emit(text, pos, begin, out);
        emit(text, begin, end, out);
        pos = end;
        break;
      case SplitBehavior::kRemoved:
        emit(text, pos, begin, out);
        pos = end;
        break;
      case SplitBehavior::kMergedWithPrevious:
        emit(text, pos, end, out);
        pos = end;
        break;
      case SplitBehavior::kMergedWithNext:
        emit(text, pos, begin, out);
        pos = begin;
        break;
      case SplitBehavior::kContiguous:
        break;  // rewritten to kIsolated above
    }
  }
  emit(text, pos, text.size(), out);
}

Result<Regex> compile_builtin(std::string_view pattern, std::string_view what) {
  return Regex::compile(pattern, what);
}

}  // namespace

Result<PreTokenizer> PreTokenizer::from_json(const nlohmann::json& config, std::string_view what) {
  PreTokenizer out;
  if (config.is_null()) return out;
  MOAT_TRY(add_steps(config, what, "pre_tokenizer", out));
  return out;
}

PreTokenizer PreTokenizer::from_regex(Regex regex) {
  PreTokenizer out;
  Step step;
  step.regex = std::move(regex);
  out.steps_.push_back(std::move(step));
  return out;
}

Status PreTokenizer::add_steps(const nlohmann::json& config, std::string_view what,
                               std::string_view field, PreTokenizer& out) {
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string()) {
    return make_error("{}: {} must be an object with a string \"type\"", what, field);
  }
  const std::string type = config["type"].get<std::string>();
  const auto flag = [&](const char* name, bool fallback) {
    return config.contains(name) && config[name].is_boolean() ? config[name].get<bool>() : fallback;
  };
  Step step;
  if (type == "Sequence") {
    const auto it = config.find("pretokenizers");
    if (it == config.end() || !it->is_array()) {
      return make_error("{}: {}.pretokenizers must be an array", what, field);
    }
    for (size_t i = 0; i < it->size(); ++i) {
      MOAT_TRY(add_steps((*it)[i], what, fmt::format("{}.pretokenizers[{}]", field, i), out));
    }
    return ok_status();
  } else if (type == "ByteLevel") {
    step.kind = Step::Kind::kByteLevel;
    step.add_prefix_space = flag("add_prefix_space", false);
    step.use_regex = flag("use_regex", true);
    if (step.use_regex) {
      MOAT_ASSIGN_OR_RETURN(step.regex, compile_builtin(kGpt2Pattern, what));
    }
    out.maps_to_byte_level_ = true;
  } else if (type == "Split") {
    const auto pattern = config.find("pattern");
    if (pattern == config.end() || !pattern->is_object()) {
      return make_error("{}: {}.pattern must be {{\"Regex\": ...}} or {{\"String\": ...}}", what,
                        field);
    }
    const std::string where = fmt::format("{} {}.pattern", what, field);
    if (pattern->contains("Regex") && (*pattern)["Regex"].is_string()) {
      MOAT_ASSIGN_OR_RETURN(step.regex,
                            Regex::compile((*pattern)["Regex"].get<std::string>(), where));
    } else if (pattern->contains("String") && (*pattern)["String"].is_string()) {
      MOAT_ASSIGN_OR_RETURN(step.regex,
                            Regex::literal((*pattern)["String"].get<std::string>(), where));
    } else {
      return make_error("{}: {}.pattern must be {{\"Regex\": ...}} or {{\"String\": ...}}", what,
                        field);
    }
    MOAT_ASSIGN_OR_RETURN(step.behavior,
                          parse_behavior(config.value("behavior", nlohmann::json("Isolated")),
                                         what, field));
    step.invert = flag("invert", false);
  } else if (type == "Digits") {
    // Rust char::is_numeric: general categories Nd, Nl and No, which is what \p{N} matches.
    MOAT_ASSIGN_OR_RETURN(step.regex, compile_builtin(R"(\p{N})", what));
    step.behavior = flag("individual_digits", false) ? SplitBehavior::kIsolated
                                                     : SplitBehavior::kContiguous;
  } else if (type == "Punctuation") {
    // Hugging Face: ASCII punctuation (which includes symbols such as $+<=>^`|~) or any P*.
    MOAT_ASSIGN_OR_RETURN(
        step.regex, compile_builtin(R"([\p{P}\x21-\x2F\x3A-\x40\x5B-\x60\x7B-\x7E])", what));
    MOAT_ASSIGN_OR_RETURN(step.behavior,
                          parse_behavior(config.value("behavior", nlohmann::json("Isolated")),
                                         what, field));
  } else if (type == "Whitespace") {
    MOAT_ASSIGN_OR_RETURN(step.regex, compile_builtin(R"(\w+|[^\w\s]+)", what));
    step.behavior = SplitBehavior::kRemoved;
    step.invert = true;
  } else if (type == "WhitespaceSplit") {
    MOAT_ASSIGN_OR_RETURN(step.regex, compile_builtin(R"(\s+)", what));
    step.behavior = SplitBehavior::kRemoved;
  } else {
    return make_error("{}: {}.type \"{}\" is not supported (supported: ByteLevel, Split, Digits, "
                      "Punctuation, Whitespace, WhitespaceSplit, Sequence)",
                      what, field, type);
  }
  out.steps_.push_back(std::move(step));
  return ok_status();
}

void PreTokenizer::apply(const Step& step, std::string_view piece,
                         std::vector<std::string>& out) const {
  if (step.kind == Step::Kind::kSplit) {
    Spans spans = step.regex.find_all(piece);
    if (step.invert) spans = invert_spans(spans, piece.size());
    split_by_spans(piece, std::move(spans), step.behavior, out);
    return;
  }
  std::string prefixed;
  if (step.add_prefix_space && (piece.empty() || piece.front() != ' ')) {
    prefixed = " ";
    prefixed += piece;
    piece = prefixed;
  }
  std::vector<std::string> parts;
  if (step.use_regex) {
    split_by_spans(piece, step.regex.find_all(piece), SplitBehavior::kIsolated, parts);
  } else if (!piece.empty()) {
    parts.emplace_back(piece);
  }
  for (const std::string& part : parts) out.push_back(byte_level::encode(part));
}

void PreTokenizer::split(std::string_view text, std::vector<std::string>& words) const {
  if (text.empty()) return;
  if (steps_.empty()) {
    words.emplace_back(text);
    return;
  }
  std::vector<std::string> pieces{std::string(text)};
  std::vector<std::string> next;
  for (const Step& step : steps_) {
    next.clear();
    for (const std::string& piece : pieces) apply(step, piece, next);
    pieces.swap(next);
  }
  for (std::string& piece : pieces) words.push_back(std::move(piece));
}

}  // namespace moat
