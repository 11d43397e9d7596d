// Behaviour beyond the golden ids: round trips, special tokens, streaming detokenization, the
// tiktoken format, errors for bad files, speed and concurrent use.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "tokenizer/byte_level.h"
#include "tokenizer/regex.h"
#include "tokenizer/tiktoken.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace moat {
namespace {

namespace fs = std::filesystem;

fs::path vocab_dir(const std::string& vocab) {
  return fs::path(MOAT_SOURCE_DIR) / ".." / "shared" / "testdata" / "tokenizers" / vocab;
}

#define SKIP_WITHOUT(vocab)                                                              \
  if (!fs::exists(vocab_dir(vocab) / "tokenizer.json"))                                  \
  GTEST_SKIP() << "shared/testdata not found at " << vocab_dir(vocab)

const Tokenizer& load_cached(const std::string& vocab) {
  static std::map<std::string, Tokenizer> cache;
  auto it = cache.find(vocab);
  if (it == cache.end()) {
    auto loaded = Tokenizer::load(vocab_dir(vocab));
    EXPECT_TRUE(loaded.ok()) << (loaded.ok() ? "" : loaded.error().message);
    it = cache.emplace(vocab, loaded.ok() ? std::move(loaded).value() : Tokenizer()).first;
  }
  return it->second;
}

bool is_valid_utf8(std::string_view s) { return unicode::sanitize(s) == s; }

// A temp directory removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("moat_tok_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  void write(const std::string& name, const std::string& content) const {
    std::ofstream(path / name, std::ios::binary) << content;
  }
};

std::string base64(std::string_view bytes) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  if (i + 1 == bytes.size()) {
    const uint32_t v = uint8_t(bytes[i]) << 16;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == bytes.size()) {
    const uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

// A tiny Kimi-style tokenizer: 256 byte tokens (rank = byte), a few merges, three specials.
void write_tiny_tiktoken(const TempDir& dir) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  for (const char* t : {"he", "ll", "hell", "hello", " w", "or", " wor", "ld", " world"}) {
    tokens.emplace_back(t);  // ranks 256..264
  }
  std::string file;
  for (size_t rank = 0; rank < tokens.size(); ++rank) {
    file += base64(tokens[rank]) + " " + std::to_string(rank) + "\n";
  }
  dir.write("tiktoken.model", file);
  dir.write("tokenizer_config.json", R"({
    "bos_token": "[BOS]",
    "eos_token": {"content": "[EOS]"},
    "chat_template": "{{ messages }}",
    "added_tokens_decoder": {
      "265": {"content": "[BOS]", "special": true},
      "266": {"content": "[EOS]", "special": true},
      "267": {"content": "<|im_end|>", "special": true}
    }
  })");
}

// Random text from scripts with different pre-tokenizer behaviour: ASCII, Latin, Cyrillic, CJK,
// emoji, digits of several kinds, whitespace of several kinds.
std::string random_utf8(std::mt19937& rng, size_t chars, bool avoid_latin1_letters) {
  static const std::vector<std::pair<char32_t, char32_t>> kRanges = {
      {0x20, 0x7E}, {0x20, 0x7E}, {0x20, 0x7E}, {0x09, 0x0A}, {0x0D, 0x0D}, {0xA0, 0xFF},
      {0x400, 0x45F}, {0x4E00, 0x4FFF}, {0x3040, 0x30FF}, {0x1F300, 0x1F64F},
      {0x660, 0x669}, {0x2150, 0x218B}, {0x2000, 0x200A}, {0x3000, 0x3002}, {0xAC00, 0xAC80}};
  std::string out;
  for (size_t i = 0; i < chars; ++i) {
    const auto& [lo, hi] = kRanges[rng() % kRanges.size()];
    char32_t cp = lo + rng() % (hi - lo + 1);
    if (avoid_latin1_letters && cp >= 0xC0 && cp <= 0xFF) cp = 'x';
    unicode::append_utf8(out, cp);
  }
  return out;
}

std::string random_bytes(std::mt19937& rng, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += static_cast<char>(rng() & 0xFF);
  return out;
}

// ---------------------------------------------------------------------------------------------

TEST(UnicodeTest, IncompleteSuffixAndSanitize) {
  EXPECT_EQ(unicode::incomplete_suffix_length("abc"), 0u);
  EXPECT_EQ(unicode::incomplete_suffix_length("a\xF0\x9F"), 2u);      // start of an emoji
  EXPECT_EQ(unicode::incomplete_suffix_length("a\xF0\x9F\x91"), 3u);
  EXPECT_EQ(unicode::incomplete_suffix_length("a\xF0\x9F\x91\x8B"), 0u);  // complete
  EXPECT_EQ(unicode::incomplete_suffix_length("a\xC3"), 1u);
  EXPECT_EQ(unicode::incomplete_suffix_length("a\xFF"), 0u);          // can never complete
  EXPECT_EQ(unicode::incomplete_suffix_length("a\xE0\x80"), 0u);      // overlong: never valid
  EXPECT_EQ(unicode::sanitize("a\xFF" "b"), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(unicode::sanitize("\xF0\x9F\x91"), "\xEF\xBF\xBD");       // one maximal subpart
  EXPECT_EQ(unicode::sanitize("h\xC3\xA9"), "h\xC3\xA9");
}

TEST(ByteLevelTest, AlphabetRoundTripsEveryByte) {
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const std::string encoded = byte_level::encode(all);
  EXPECT_TRUE(is_valid_utf8(encoded));
  EXPECT_EQ(byte_level::decode(encoded), all);
  EXPECT_EQ(byte_level::encode(" "), "\xC4\xA0");  // U+0120 'Ġ'
  EXPECT_EQ(byte_level::encode("\n"), "\xC4\x8A");  // U+010A 'Ċ'
  EXPECT_EQ(byte_level::encode("A"), "A");
}

TEST(RegexTest, KimiPatternUsesHanAndIntersection) {
  auto regex = Regex::compile(tiktoken::kKimiPattern, "test");
  ASSERT_TRUE(regex.ok()) << regex.error().message;
  const std::string text = "Hello你好World's 12345\n\nok";
  std::vector<std::string> pieces;
  for (const auto& [b, e] : regex->find_all(text)) pieces.push_back(text.substr(b, e - b));
  EXPECT_EQ(pieces, (std::vector<std::string>{"Hello", "你好", "World's", " ", "123", "45",
                                              "\n\n", "ok"}));
}

TEST(RegexTest, BadPatternNamesItsOrigin) {
  auto regex = Regex::compile("(unclosed", "my.json pre_tokenizer.pattern");
  ASSERT_FALSE(regex.ok());
  EXPECT_NE(regex.error().message.find("my.json pre_tokenizer.pattern"), std::string::npos);
}

TEST(TokenizerTest, RoundTripRandomUtf8) {
  for (const std::string vocab : {"gpt-2", "deepseek-llm", "falcon", "mpt"}) {
    SKIP_WITHOUT(vocab);
    const Tokenizer& tokenizer = load_cached(vocab);
    std::mt19937 rng(1234);
    for (int i = 0; i < 200; ++i) {
      // DeepSeek's added tokens õ ÷ Á ... decode to the single bytes they stand for, as in
      // Hugging Face, so text containing them does not round-trip; keep them out.
      const std::string text = random_utf8(rng, 1 + rng() % 80, vocab.starts_with("deepseek"));
      ASSERT_EQ(tokenizer.decode(tokenizer.encode(text)), text) << vocab << " case " << i;
    }
  }
}

// Vocabularies with a token for each of the 256 bytes (DeepSeek through its added tokens).
// mpt's vocab lacks the bytes that never occur in UTF-8 (C0, C1, F5..FF), so it can only keep the
// others, as Hugging Face would (starcoder and falcon lack a few more).
TEST(TokenizerTest, RoundTripRandomBytes) {
  for (const std::string vocab : {"gpt-2", "deepseek-llm", "deepseek-coder", "mpt"}) {
    SKIP_WITHOUT(vocab);
    const Tokenizer& tokenizer = load_cached(vocab);
    std::mt19937 rng(99);
    for (int i = 0; i < 200; ++i) {
      std::string bytes = random_bytes(rng, 1 + rng() % 100);
      if (vocab == "mpt") {
        for (char& c : bytes) {
          const auto u = static_cast<unsigned char>(c);
          if (u == 0xC0 || u == 0xC1 || u >= 0xF5) c = '?';
        }
      }
      if (vocab.starts_with("deepseek")) {
        for (char& c : bytes) {
          if (c == '\xC3') c = 'x';  // see RoundTripRandomUtf8
        }
      }
      ASSERT_EQ(tokenizer.decode(tokenizer.encode(bytes)), bytes) << vocab << " case " << i;
    }
  }
}

TEST(TokenizerTest, SpecialTokensAreMatchedInText) {
  SKIP_WITHOUT("gpt-2");
  const Tokenizer& gpt2 = load_cached("gpt-2");
  const auto ids = gpt2.encode("Hello<|endoftext|>world");
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1], 50256);
  EXPECT_TRUE(gpt2.is_special(50256));
  EXPECT_FALSE(gpt2.is_special(ids[0]));
  EXPECT_EQ(gpt2.bos_id(), 50256);
  EXPECT_EQ(gpt2.eos_id(), 50256);
  EXPECT_EQ(gpt2.vocab_size(), 50257);
  EXPECT_EQ(gpt2.token_to_id("<|endoftext|>"), 50256);
  EXPECT_EQ(gpt2.token_to_id("\xC4\xA0the"), gpt2.token_to_id(" the"));  // "Ġthe" or raw bytes
  EXPECT_EQ(gpt2.token_bytes(*gpt2.token_to_id("\xC4\xA0the")), " the");
  EXPECT_EQ(gpt2.decode(ids), "Hello<|endoftext|>world");

  SKIP_WITHOUT("deepseek-llm");
  const Tokenizer& deepseek = load_cached("deepseek-llm");
  EXPECT_EQ(deepseek.bos_id(), 100000);
  EXPECT_EQ(deepseek.eos_id(), 100001);
  const auto ds = deepseek.encode("<｜begin▁of▁sentence｜>Hi<｜end▁of▁sentence｜>");
  ASSERT_GE(ds.size(), 3u);
  EXPECT_EQ(ds.front(), 100000);
  EXPECT_EQ(ds.back(), 100001);
  EXPECT_EQ(deepseek.decode(ds), "<｜begin▁of▁sentence｜>Hi<｜end▁of▁sentence｜>");

  SKIP_WITHOUT("mpt");
  const Tokenizer& mpt = load_cached("mpt");
  EXPECT_EQ(mpt.encode("  ").front(), 50276);  // non-special added token: two spaces
  EXPECT_FALSE(mpt.is_special(50276));
  EXPECT_TRUE(mpt.is_special(0));
}

TEST(DetokenizerTest, NeverEmitsBrokenUtf8) {
  SKIP_WITHOUT("gpt-2");
  const Tokenizer& tokenizer = load_cached("gpt-2");
  const std::string text = "Hi 👋🏽 naïve café 你好世界 🤖 done";
  const auto ids = tokenizer.encode(text);
  bool some_token_was_partial = false;
  IncrementalDetokenizer detok(tokenizer);
  std::string streamed;
  for (int32_t id : ids) {
    if (!is_valid_utf8(tokenizer.token_bytes(id))) some_token_was_partial = true;
    const std::string piece = detok.push(id);
    EXPECT_TRUE(is_valid_utf8(piece)) << "token " << id;
    streamed += piece;
  }
  streamed += detok.flush();
  EXPECT_TRUE(some_token_was_partial) << "the test text should split a character across tokens";
  EXPECT_EQ(streamed, text);
}

TEST(DetokenizerTest, LeftoverBytesFlushAsReplacementCharacter) {
  SKIP_WITHOUT("gpt-2");
  const Tokenizer& tokenizer = load_cached("gpt-2");
  const auto lead = tokenizer.token_to_id(byte_level::encode("\xF0"));  // first byte of an emoji
  const auto a = tokenizer.token_to_id("a");
  ASSERT_TRUE(lead && a);
  IncrementalDetokenizer detok(tokenizer);
  EXPECT_EQ(detok.push(*a), "a");
  EXPECT_EQ(detok.push(*lead), "");
  EXPECT_EQ(detok.flush(), "\xEF\xBF\xBD");
  // A lead byte followed by something that cannot continue it is replaced, not held forever.
  EXPECT_EQ(detok.push(*lead), "");
  EXPECT_EQ(detok.push(*a), "\xEF\xBF\xBD" "a");
  EXPECT_EQ(detok.flush(), "");
}

TEST(TiktokenTest, TinyRankFileWithSpecials) {
  TempDir dir;
  write_tiny_tiktoken(dir);
  auto loaded = Tokenizer::load(dir.path);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  const Tokenizer& tokenizer = *loaded;
  EXPECT_EQ(tokenizer.encode("hello world"), (std::vector<int32_t>{259, 264}));
  EXPECT_EQ(tokenizer.encode("[BOS]hello<|im_end|>"), (std::vector<int32_t>{265, 259, 267}));
  EXPECT_EQ(tokenizer.encode("hi"), (std::vector<int32_t>{'h', 'i'}));
  // "你" is one pre-token of three bytes with no merges.
  EXPECT_EQ(tokenizer.encode("你"), (std::vector<int32_t>{0xE4, 0xBD, 0xA0}));
  EXPECT_EQ(tokenizer.bos_id(), 265);
  EXPECT_EQ(tokenizer.eos_id(), 266);
  EXPECT_TRUE(tokenizer.is_special(267));
  EXPECT_FALSE(tokenizer.is_special(259));
  // 265 ranked tokens + Kimi's 256 reserved special ids.
  EXPECT_EQ(tokenizer.vocab_size(), 265 + 256);
  EXPECT_EQ(tokenizer.token_to_id("<|reserved_token_300|>"), 300);
  EXPECT_EQ(tokenizer.token_to_id("hello"), 259);
  EXPECT_EQ(tokenizer.token_bytes(264), " world");
  EXPECT_EQ(tokenizer.chat_template(), "{{ messages }}");
  EXPECT_EQ(tokenizer.decode({265, 259, 264, 267}), "[BOS]hello world<|im_end|>");
  std::mt19937 rng(7);
  for (int i = 0; i < 100; ++i) {
    const std::string bytes = random_bytes(rng, 1 + rng() % 60);
    ASSERT_EQ(tokenizer.decode(tokenizer.encode(bytes)), bytes);
    const std::string text = random_utf8(rng, 1 + rng() % 40, false);
    ASSERT_EQ(tokenizer.decode(tokenizer.encode(text)), text);
  }
}

TEST(TiktokenTest, Base64) {
  EXPECT_EQ(tiktoken::base64_decode("aGVsbG8="), "hello");
  EXPECT_EQ(tiktoken::base64_decode("aGVsbG8"), "hello");
  EXPECT_EQ(tiktoken::base64_decode("IQ=="), "!");
  EXPECT_FALSE(tiktoken::base64_decode("a*b=").has_value());
}

// ---------------------------------------------------------------------------------------------
// Bad input: every error names the file and, where there is one, the field.

void expect_error(const fs::path& dir, std::initializer_list<std::string> parts) {
  auto loaded = Tokenizer::load(dir);
  ASSERT_FALSE(loaded.ok());
  for (const std::string& part : parts) {
    EXPECT_NE(loaded.error().message.find(part), std::string::npos)
        << "message \"" << loaded.error().message << "\" lacks \"" << part << "\"";
  }
}

const char* kMinimalJson = R"({
  "added_tokens": [{"id": 3, "content": "<s>", "special": true}],
  "normalizer": NORMALIZER,
  "pre_tokenizer": PRE,
  "decoder": {"type": "ByteLevel"},
  "model": {"type": "MODEL", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}
})";

std::string minimal_json(const std::string& normalizer = "null",
                         const std::string& pre = R"({"type": "ByteLevel"})",
                         const std::string& model = "BPE") {
  std::string s = kMinimalJson;
  s.replace(s.find("NORMALIZER"), 10, normalizer);
  s.replace(s.find("PRE"), 3, pre);
  s.replace(s.find("MODEL"), 5, model);
  return s;
}

TEST(BadInputTest, MinimalTokenizerJsonLoads) {
  TempDir dir;
  dir.write("tokenizer.json", minimal_json());
  auto loaded = Tokenizer::load(dir.path);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  EXPECT_EQ(loaded->encode("ab<s>ba"), (std::vector<int32_t>{2, 3, 1, 0}));
  EXPECT_EQ(loaded->bos_id(), 3);  // no tokenizer_config.json: a well-known name
  EXPECT_EQ(loaded->chat_template(), "");
  // merges given as [a, b] pairs work the same
  std::string pairs = minimal_json();
  pairs.replace(pairs.find(R"(["a b"])"), 7, R"([["a", "b"]])");
  dir.write("tokenizer.json", pairs);
  auto loaded_pairs = Tokenizer::load(dir.path);
  ASSERT_TRUE(loaded_pairs.ok()) << loaded_pairs.error().message;
  EXPECT_EQ(loaded_pairs->encode("ab"), (std::vector<int32_t>{2}));
}

TEST(PreTokenizerTest, SplitOnLiteralString) {
  TempDir dir;
  dir.write("tokenizer.json",
            minimal_json("null", R"({"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"String": "b."}, "behavior": "Removed"},
              {"type": "ByteLevel", "use_regex": false}]})"));
  auto loaded = Tokenizer::load(dir.path);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  // "b." is removed as a literal, leaving "a", "a", "bb"; "bb" does not match (no wildcard).
  EXPECT_EQ(loaded->encode("ab.ab.bb"), (std::vector<int32_t>{0, 0, 1, 1}));
}

TEST(BadInputTest, MissingFiles) {
  TempDir dir;
  expect_error(dir.path, {dir.path.string(), "tokenizer.json", "tiktoken.model"});
  expect_error(dir.path / "nope", {"nope"});
}

TEST(BadInputTest, MalformedJson) {
  TempDir dir;
  dir.write("tokenizer.json", "{\"model\": {");
  expect_error(dir.path, {"tokenizer.json", "malformed JSON"});
}

TEST(BadInputTest, UnknownModelType) {
  TempDir dir;
  dir.write("tokenizer.json", minimal_json("null", R"({"type": "ByteLevel"})", "WordPiece"));
  expect_error(dir.path, {"tokenizer.json", "model.type", "WordPiece"});
}

TEST(BadInputTest, UnsupportedNormalizerAndPreTokenizer) {
  TempDir dir;
  dir.write("tokenizer.json", minimal_json(R"({"type": "Sequence", "normalizers": [{"type": "NFKC"}]})"));
  expect_error(dir.path, {"tokenizer.json", "normalizer.normalizers[0]", "NFKC"});
  dir.write("tokenizer.json", minimal_json("null", R"({"type": "Metaspace"})"));
  expect_error(dir.path, {"tokenizer.json", "pre_tokenizer", "Metaspace"});
  dir.write("tokenizer.json",
            minimal_json("null", R"({"type": "Sequence", "pretokenizers": [{"type": "Split",
              "pattern": {"Regex": "(["}, "behavior": "Isolated"}]})"));
  expect_error(dir.path, {"tokenizer.json", "pre_tokenizer.pretokenizers[0].pattern"});
  dir.write("tokenizer.json",
            minimal_json("null", R"({"type": "Split", "pattern": {"String": "x"}, "behavior": "Sideways"})"));
  expect_error(dir.path, {"tokenizer.json", "behavior", "Sideways"});
}

TEST(BadInputTest, BadMergesAndVocab) {
  TempDir dir;
  std::string bad = minimal_json();
  bad.replace(bad.find(R"(["a b"])"), 7, R"(["a c"])");
  dir.write("tokenizer.json", bad);
  expect_error(dir.path, {"tokenizer.json", "model.merges[0]"});
  bad = minimal_json();
  bad.replace(bad.find(R"("b": 1)"), 6, R"("b": "x")");
  dir.write("tokenizer.json", bad);
  expect_error(dir.path, {"tokenizer.json", "model.vocab[\"b\"]"});
}

TEST(BadInputTest, MalformedTokenizerConfig) {
  TempDir dir;
  dir.write("tokenizer.json", minimal_json());
  dir.write("tokenizer_config.json", R"({"bos_token": 5})");
  expect_error(dir.path, {"tokenizer_config.json", "bos_token"});
  dir.write("tokenizer_config.json", "{oops");
  expect_error(dir.path, {"tokenizer_config.json", "malformed JSON"});
}

TEST(BadInputTest, MalformedTiktokenFile) {
  TempDir dir;
  dir.write("tiktoken.model", "YQ== 0\nnot-base64! 1\n");
  expect_error(dir.path, {"tiktoken.model:2"});
  dir.write("tiktoken.model", "YQ== zero\n");
  expect_error(dir.path, {"tiktoken.model:1"});
  dir.write("tiktoken.model", "");
  expect_error(dir.path, {"tiktoken.model", "no tokens"});
  // ranks with gaps (found by fuzz_tiktoken: rank 13,301,111 alone sized the id tables to it)
  dir.write("tiktoken.model", "AA 013301111");
  expect_error(dir.path, {"tiktoken.model", "ranks run to 13301111", "without gaps"});
  dir.write("tiktoken.model", "YQ== 0\nYg== 2\n");
  expect_error(dir.path, {"tiktoken.model", "ranks run to 2", "2 tokens"});
}

// ---------------------------------------------------------------------------------------------

std::string ten_kilobytes_of_text() {
  const fs::path inp = vocab_dir("gpt-2") / "gpt-2.inp";
  std::ifstream in(inp, std::ios::binary);
  std::string sample((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string text;
  while (text.size() < 10 * 1024) text += sample;
  text.resize(10 * 1024);
  while (!text.empty() && unicode::incomplete_suffix_length(text) > 0) text.pop_back();
  return text;
}

TEST(PerformanceTest, EncodesTenKilobytesQuickly) {
  for (const std::string vocab : {"gpt-2", "deepseek-llm", "falcon"}) {
    SKIP_WITHOUT(vocab);
    const Tokenizer& tokenizer = load_cached(vocab);
    const std::string text = ten_kilobytes_of_text();
    (void)tokenizer.encode(text);  // warm up
    double best_ms = 1e9;
    for (int i = 0; i < 5; ++i) {
      const auto start = std::chrono::steady_clock::now();
      const auto ids = tokenizer.encode(text);
      const auto end = std::chrono::steady_clock::now();
      best_ms = std::min(best_ms, std::chrono::duration<double, std::milli>(end - start).count());
      ASSERT_FALSE(ids.empty());
    }
    std::printf("%s: encode %zu bytes in %.2f ms (%.1f MB/s)\n", vocab.c_str(), text.size(),
                best_ms, text.size() / best_ms / 1e3);
    EXPECT_LT(best_ms, 50.0) << vocab;
  }
}

TEST(ConcurrencyTest, ConstUseFromManyThreads) {
  SKIP_WITHOUT("deepseek-llm");
  const Tokenizer& tokenizer = load_cached("deepseek-llm");
  const std::string text = ten_kilobytes_of_text();
  const std::vector<int32_t> want = tokenizer.encode(text);
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Tokenizer copy = tokenizer;  // copies share the same state
      for (int i = 0; i < 5; ++i) ok[t] += copy.encode(text) == want;
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(ok[t], 5);
}

}  // namespace
}  // namespace moat
