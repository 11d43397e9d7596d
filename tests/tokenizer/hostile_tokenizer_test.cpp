// Hostile tokenizer files: each test starts from a valid tokenizer (models/k3-nano's tokenizer.json,
// or a small tiktoken rank file), corrupts one thing in a temp directory, and checks that loading
// is refused with a message naming the file, the entry and the problem: never a crash, a huge
// allocation or an id outside the tables.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tokenizer/tiktoken.h"
#include "tokenizer/tokenizer.h"

namespace moat {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE((haystack).find(needle), std::string::npos) << "message: " << (haystack)

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class HostileTokenizer : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moat_hostile_tok_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    k3_ = ojson::parse(read_text(fs::path(MOAT_SOURCE_DIR) / "models/k3-nano/tokenizer.json"));
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary | std::ios::trunc) << text;
  }
  std::string load_error() {
    auto t = Tokenizer::load(dir_);
    return t.ok() ? std::string("(loaded)") : t.error().message;
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // A small valid rank file: the 256 bytes, then "ab", "abc".
  static std::string rank_file() {
    std::string out;
    for (int b = 0; b < 256; ++b) {
      static const char* kB64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
      out += std::string{kB64[b >> 2], kB64[(b & 3) << 4], '=', '='} + " " + std::to_string(b) + "\n";
    }
    return out + "YWI= 256\nYWJj 257\n";
  }

  fs::path dir_;
  ojson k3_;
};

TEST_F(HostileTokenizer, TheBaseFilesLoad) {
  write("tokenizer.json", k3_.dump());
  EXPECT_EQ(load_error(), "(loaded)");
  fs::remove(dir_ / "tokenizer.json");
  write("tiktoken.model", rank_file());
  auto t = Tokenizer::load(dir_);
  ASSERT_TRUE(t.ok()) << t.error().message;
  EXPECT_EQ(t->encode("abc"), (std::vector<int32_t>{257}));
}

TEST_F(HostileTokenizer, MergeOfUnknownTokens) {
  k3_["model"]["merges"][5] = "zzq_not_a_token qqz_nor_this";
  write("tokenizer.json", k3_.dump());
  EXPECT_HAS(load_error(), path("tokenizer.json") +
                               ": model.merges[5] (\"zzq_not_a_token\" \"qqz_nor_this\") uses a token missing "
                               "from model.vocab");
}

TEST_F(HostileTokenizer, MergeWhoseResultIsNotInTheVocabulary) {
  // both halves exist, their concatenation does not
  k3_["model"]["vocab"].erase("th");
  write("tokenizer.json", k3_.dump());
  const std::string e = load_error();
  EXPECT_HAS(e, path("tokenizer.json") + ": model.merges[");
  EXPECT_HAS(e, "uses a token missing from model.vocab");
}

TEST_F(HostileTokenizer, MergeThatIsNotTwoTokens) {
  k3_["model"]["merges"][0] = "a b c";
  write("tokenizer.json", k3_.dump());
  EXPECT_HAS(load_error(),
             path("tokenizer.json") + ": model.merges[0] \"a b c\" must be two tokens separated by one space");
}

TEST_F(HostileTokenizer, VocabularyIdOfTwoToTheThirtyOne) {
  // The per-id tables are sized by the largest id: 2^31 - 1 would allocate ~100 GB.
  k3_["model"]["vocab"]["zzz_hostile"] = 2147483647;
  write("tokenizer.json", k3_.dump());
  EXPECT_HAS(load_error(), path("tokenizer.json") +
                               ": model.vocab[\"zzz_hostile\"] must be a non-negative integer id (at most "
                               "16777215), got 2147483647");
}

TEST_F(HostileTokenizer, NegativeVocabularyId) {
  k3_["model"]["vocab"]["zzz_hostile"] = -3;
  write("tokenizer.json", k3_.dump());
  EXPECT_HAS(load_error(), "model.vocab[\"zzz_hostile\"] must be a non-negative integer id");
}

TEST_F(HostileTokenizer, AddedTokenIdOutOfRange) {
  k3_["added_tokens"].push_back({{"id", int64_t{1} << 40}, {"content", "<huge>"}, {"special", true}});
  write("tokenizer.json", k3_.dump());
  const std::string e = load_error();
  EXPECT_HAS(e, path("tokenizer.json") + " added_tokens[");
  EXPECT_HAS(e, "id 1099511627776 out of range (expected 0 to 16777215)");
}

TEST_F(HostileTokenizer, UnknownTokenNotInTheVocabulary) {
  k3_["model"]["unk_token"] = "<no such unk>";
  write("tokenizer.json", k3_.dump());
  EXPECT_HAS(load_error(), path("tokenizer.json") + ": model.unk_token \"<no such unk>\" is not in model.vocab");
}

// Fuzz finding: nlohmann's out_of_range for a number past double escaped the parse_error catch.
TEST_F(HostileTokenizer, NumberPastDoubleIsAnErrorNotACrash) {
  std::string text = k3_.dump();
  text.insert(1, "\"version\": 1e400, ");
  write("tokenizer.json", text);
  const std::string e = load_error();
  EXPECT_HAS(e, path("tokenizer.json") + ": malformed JSON");
  EXPECT_HAS(e, "number overflow");
}

TEST_F(HostileTokenizer, ConfigAddedTokenIdOutOfRange) {
  write("tokenizer.json", k3_.dump());
  write("tokenizer_config.json", R"({"added_tokens_decoder": {"99999999999": {"content": "<x>", "special": true}}})");
  EXPECT_HAS(load_error(), path("tokenizer_config.json") +
                               " added_tokens_decoder[\"99999999999\"]: id 99999999999 out of range");
}

TEST_F(HostileTokenizer, TiktokenLineWithoutARank) {
  write("tiktoken.model", rank_file() + "YWJjZA==\n");
  EXPECT_HAS(load_error(), path("tiktoken.model") + ":259: expected \"<base64 token> <rank>\"");
}

TEST_F(HostileTokenizer, TiktokenLineThatIsNotBase64) {
  write("tiktoken.model", rank_file() + "not*base64 258\n");
  EXPECT_HAS(load_error(), path("tiktoken.model") + ":259: expected \"<base64 token> <rank>\"");
}

TEST_F(HostileTokenizer, TiktokenNegativeOrHugeRank) {
  write("tiktoken.model", rank_file() + "YWJjZA== -4\n");
  EXPECT_HAS(load_error(), path("tiktoken.model") + ":259: expected \"<base64 token> <rank>\"");
  // INT32_MAX: rank + 1 overflowed int32, and the tables would be sized 2^31
  write("tiktoken.model", rank_file() + "YWJjZA== 2147483647\n");
  EXPECT_HAS(load_error(), path("tiktoken.model") + ":259: rank 2147483647 out of range (expected 0 to 16776959)");
}

TEST_F(HostileTokenizer, TiktokenRankGivenTwice) {
  write("tiktoken.model", rank_file() + "YWJjZA== 256\n");
  EXPECT_HAS(load_error(), path("tiktoken.model") + ":259: rank 256 already given on line 257");
}

TEST_F(HostileTokenizer, TiktokenTokenGivenTwice) {
  write("tiktoken.model", rank_file() + "YWI= 258\n");
  EXPECT_HAS(load_error(), path("tiktoken.model") + ":259: token listed twice");
}

// The id tables are sized by the largest id: ids within range but far past the tokens a file
// defines (one entry at 16,000,000 after 4096) would allocate ~1 GB on every load.
TEST_F(HostileTokenizer, SparseVocabularyId) {
  k3_["model"]["vocab"]["zzz_hostile"] = 16000000;
  write("tokenizer.json", k3_.dump());
  const std::string e = load_error();
  EXPECT_HAS(e, path("tokenizer.json") + ": ids run to 16000000 but only ");
  EXPECT_HAS(e, "more than 65536 ids would name no token");
}

TEST_F(HostileTokenizer, SparseAddedTokenId) {
  k3_["added_tokens"].push_back({{"id", 9000000}, {"content", "<far>"}, {"special", true}});
  write("tokenizer.json", k3_.dump());
  EXPECT_HAS(load_error(), path("tokenizer.json") + ": ids run to 9000000 but only ");
  // a few unused ids below an added token are fine (real files reserve some)
  k3_["added_tokens"].back()["id"] = 4096 + 300;
  write("tokenizer.json", k3_.dump());
  EXPECT_EQ(load_error(), "(loaded)");
}

TEST_F(HostileTokenizer, TiktokenConfigSpecialFarPastTheRanks) {
  write("tiktoken.model", rank_file());
  write("tokenizer_config.json", R"({"added_tokens_decoder": {"12000000": {"content": "<x>", "special": true}}})");
  EXPECT_HAS(load_error(), path("tokenizer_config.json") + ": ids run to 12000000 but only ");
  write("tokenizer_config.json", R"({"added_tokens_decoder": {"600": {"content": "<x>", "special": true}}})");
  EXPECT_EQ(load_error(), "(loaded)");
}

}  // namespace
}  // namespace moat
