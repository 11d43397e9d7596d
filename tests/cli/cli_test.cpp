// Runs the built `moat` binary as a user would and checks its output and exit codes.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

namespace {

const std::string kMoat = std::string(MOAT_BINARY_DIR) + "/moat";
const std::filesystem::path kRoot = MOAT_SOURCE_DIR;

struct CliRun {
  int exit_code;
  std::string output;  // stdout (stderr too when merge_stderr)
};

// A shell command line's exit code and stdout.
CliRun shell(const std::string& cmd) {
  FILE* pipe = popen(cmd.c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  const int status = pclose(pipe);
  return {WEXITSTATUS(status), out};
}

CliRun run(const std::string& args, bool merge_stderr = false) {
  return shell(kMoat + " " + args + (merge_stderr ? " 2>&1" : " 2>/dev/null"));
}

TEST(Cli, ScorePrintsTopLogitsAsJson) {
  const auto dir = kRoot / "tests/golden/tiny_qlora";
  CliRun r = run("score --model " + dir.string() + " --tokens 1,5,17 --top 5 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["tokens"], nlohmann::json::array({1, 5, 17}));
  ASSERT_EQ(j["top"].size(), 5u);
  for (size_t i = 1; i < 5; ++i) EXPECT_GE(j["top"][i - 1]["logit"].get<double>(), j["top"][i]["logit"].get<double>());
}

TEST(Cli, ScoreAgreesAcrossBackends) {
  const auto dir = kRoot / "tests/golden/tiny_fp8";
  CliRun ref = run("score --backend reference --model " + dir.string() + " --tokens 3,1,4,1,5,9,2,6 --top 3 --json");
  CliRun cpu = run("score --backend cpu --model " + dir.string() + " --tokens 3,1,4,1,5,9,2,6 --top 3 --json");
  ASSERT_EQ(ref.exit_code, 0);
  ASSERT_EQ(cpu.exit_code, 0);
  auto a = nlohmann::json::parse(ref.output), b = nlohmann::json::parse(cpu.output);
  EXPECT_EQ(a["top"][0]["id"], b["top"][0]["id"]);
}

// MOAT_DISABLE_ISA takes kernels away: doctor names why, and the model still runs on what is left
// with the same top tokens.
TEST(Cli, DisabledIsaFallsBackAndDoctorSaysWhy) {
  const std::string model = (kRoot / "tests/golden/tiny_qlora").string();
  const std::string env = "MOAT_DISABLE_ISA=amx-bf16,avx512bf16 ";
  const CliRun doctor_run = shell(env + kMoat + " doctor --model " + model + " 2>&1");
  const std::string& doctor = doctor_run.output;
  ASSERT_EQ(doctor_run.exit_code, 0) << doctor;
  const size_t matmul = doctor.find("matmul[BF16]");
  ASSERT_NE(matmul, std::string::npos) << doctor;
  const std::string line = doctor.substr(matmul, doctor.find('\n', matmul) - matmul);
  for (const char* kernel : {"cpu.matmul_avx512bf16", "cpu.matmul_amx_bf16"})
    EXPECT_EQ(line.find(kernel), std::string::npos) << kernel << " resolved although disabled: " << line;
  EXPECT_NE(doctor.find("cpu.matmul_avx512bf16: avx512bf16 "), std::string::npos) << doctor;
  // what an AVX-512F server without BF16 (Skylake-SP .. Ice Lake) runs: the register-decoding
  // kernel with its 512-bit packed GEMM, not the portable avx512 one (10x slower decode); an
  // AVX2-only CPU its ymm twin
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  EXPECT_NE(line.find(avx512 ? "cpu.matmul_avx512fma" : "cpu.matmul_avx2fma"),
            std::string::npos)
      << line;
  const std::string score = " score --model " + model + " --tokens 3,1,4,1,5,9,2,6 --top 3 --json";
  CliRun plain = run(score), disabled = shell(env + kMoat + score + " 2>/dev/null");
  ASSERT_EQ(plain.exit_code, 0);
  ASSERT_EQ(disabled.exit_code, 0) << disabled.output;
  EXPECT_EQ(nlohmann::json::parse(plain.output)["top"][0]["id"], nlohmann::json::parse(disabled.output)["top"][0]["id"]);
}

TEST(Cli, MissingModelDirectoryIsAClearError) {
  CliRun r = run("score --model /nonexistent/model --tokens 1", true);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("/nonexistent/model"), std::string::npos) << r.output;
}

TEST(Cli, TokenOutsideVocabularyIsAClearError) {
  CliRun r = run("score --model " + (kRoot / "tests/golden/tiny_qlora").string() + " --tokens 1,999999", true);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("999999"), std::string::npos) << r.output;
}

TEST(Cli, GenerateWithDefaultModelPrintsTextAndSpeed) {
  if (!std::filesystem::exists(kRoot / "models/k3-nano/config.json")) GTEST_SKIP() << "models/k3-nano not shipped yet";
  CliRun r = run("generate --prompt \"The\" --max-tokens 8 --temperature 0", true);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("The", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("decode"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tok/s"), std::string::npos) << r.output;
}

TEST(Cli, GenerateRejectsPromptLongerThanContext) {
  if (!std::filesystem::exists(kRoot / "models/k3-nano/config.json")) GTEST_SKIP() << "models/k3-nano not shipped yet";
  CliRun r = run("generate --prompt \"one two three four five six seven eight nine ten\" --max-context 8 --max-tokens 4", true);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("exceeds the context"), std::string::npos) << r.output;
}

}  // namespace

namespace {

TEST(Cli, GenerateChatWrapsThePromptInTheTemplate) {
  if (!std::filesystem::exists(kRoot / "models/k3-nano/config.json")) GTEST_SKIP() << "models/k3-nano not shipped yet";
  // <|bos|><|user|>Hi<|eos|><|assistant|>: 4 special tokens around the prompt's own.
  CliRun plain = run("generate --prompt \"Hi\" --max-tokens 1 --temperature 0", true);
  CliRun chat = run("generate --chat --prompt \"Hi\" --max-tokens 1 --temperature 0", true);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_EQ(chat.exit_code, 0) << chat.output;
  auto prompt_tokens = [](const std::string& out) {
    const auto at = out.find("prompt ");
    return at == std::string::npos ? -1 : std::stoi(out.substr(at + 7));
  };
  // plain = BOS + "Hi"; chat = BOS + <|user|> + "Hi" + <|eos|> + <|assistant|>
  EXPECT_EQ(prompt_tokens(chat.output), prompt_tokens(plain.output) + 3) << chat.output;
}

}  // namespace

namespace {

TEST(Cli, GenerateSpeculativeKeepsGreedyTextAndReportsAcceptance) {
  if (!std::filesystem::exists(kRoot / "models/k3-nano-draft/config.json")) GTEST_SKIP() << "no shipped draft";
  const std::string base = "generate --prompt \"The meaning of life is\" --max-tokens 24 --temperature 0 --exact";
  CliRun plain = run(base);
  const std::string draft = (kRoot / "models/k3-nano-draft").string();
  CliRun with_draft = run(base + " --speculative draft:" + draft + " --num-speculative-tokens 3");
  CliRun with_ngram = run(base + " --speculative ngram");
  ASSERT_EQ(plain.exit_code, 0);
  ASSERT_EQ(with_draft.exit_code, 0);
  ASSERT_EQ(with_ngram.exit_code, 0);
  EXPECT_EQ(with_draft.output, plain.output);
  EXPECT_EQ(with_ngram.output, plain.output);
  CliRun summary = run(base + " --speculative draft:" + draft, true);
  EXPECT_NE(summary.output.find("accepted"), std::string::npos) << summary.output;
}

TEST(Cli, BadSpeculativeFlagsNameTheProblem) {
  if (!std::filesystem::exists(kRoot / "models/k3-nano/config.json")) GTEST_SKIP() << "models/k3-nano not shipped yet";
  CliRun unknown = run("generate --prompt Hi --max-tokens 2 --speculative eagle", true);
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.output.find("eagle"), std::string::npos) << unknown.output;
  CliRun missing = run("generate --prompt Hi --max-tokens 2 --speculative draft:/nonexistent/draft", true);
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("/nonexistent/draft"), std::string::npos) << missing.output;
  CliRun no_dir = run("generate --prompt Hi --max-tokens 2 --speculative draft", true);
  EXPECT_NE(no_dir.exit_code, 0);
  EXPECT_NE(no_dir.output.find("draft:DIR"), std::string::npos) << no_dir.output;
  // a draft with another vocabulary
  CliRun vocab = run("generate --prompt Hi --max-tokens 2 --speculative draft:" + (kRoot / "tests/golden/tiny_qlora").string(), true);
  EXPECT_NE(vocab.exit_code, 0);
  EXPECT_NE(vocab.output.find("vocabulary"), std::string::npos) << vocab.output;
}

}  // namespace
