// Every case of shared/testdata/tokenizers/<vocab>/<vocab>.json (ids Hugging Face `tokenizers`
// produced with add_special_tokens=False) must encode to exactly the same ids.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>

#include "tokenizer/tokenizer.h"

namespace moat {
namespace {

namespace fs = std::filesystem;

fs::path testdata_dir() { return fs::path(MOAT_SOURCE_DIR) / ".." / "shared" / "testdata" / "tokenizers"; }

// Loading a 4 MB tokenizer.json takes a while; each vocabulary is loaded once per binary.
const Tokenizer& cached_tokenizer(const std::string& vocab) {
  static std::map<std::string, Tokenizer> cache;
  auto it = cache.find(vocab);
  if (it == cache.end()) {
    auto loaded = Tokenizer::load(testdata_dir() / vocab);
    if (!loaded.ok()) {
      ADD_FAILURE() << loaded.error().message;
      it = cache.emplace(vocab, Tokenizer()).first;
    } else {
      it = cache.emplace(vocab, std::move(loaded).value()).first;
    }
  }
  return it->second;
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, AllCasesMatchHuggingFace) {
  const std::string vocab = GetParam();
  const fs::path cases_path = testdata_dir() / vocab / (vocab + ".json");
  if (!fs::exists(cases_path)) GTEST_SKIP() << "no test data at " << cases_path;
  const Tokenizer& tokenizer = cached_tokenizer(vocab);
  std::ifstream in(cases_path);
  const nlohmann::json cases = nlohmann::json::parse(in)["cases"];
  int passed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string text = cases[i]["text"];
    const std::vector<int32_t> want = cases[i]["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = tokenizer.encode(text);
    if (got == want) {
      ++passed;
    } else {
      ADD_FAILURE() << vocab << " case " << i << " " << nlohmann::json(text).dump()
                    << "\n  want " << nlohmann::json(want).dump() << "\n  got  "
                    << nlohmann::json(got).dump();
    }
  }
  std::printf("%s: %d/%zu cases\n", vocab.c_str(), passed, cases.size());
  EXPECT_EQ(passed, static_cast<int>(cases.size()));
}

INSTANTIATE_TEST_SUITE_P(Vocabularies, GoldenTest,
                         ::testing::Values("gpt-2", "deepseek-llm", "deepseek-coder", "starcoder",
                                           "refact", "mpt", "falcon"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace moat
