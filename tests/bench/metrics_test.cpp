// Pure parts of the bench module: metrics arithmetic, workload sampling, SSE splitting, URLs.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <sstream>

#include "bench/client.h"
#include "bench/metrics.h"
#include "bench/plot.h"
#include "bench/workload.h"

namespace moat::bench {
namespace {

TEST(Percentile, MatchesNumpyLinear) {
  // np.percentile([1,2,3,4], [50, 99]) == [2.5, 3.97]; [15,20,35,40,50] at 40 == 29.
  EXPECT_DOUBLE_EQ(percentile({4, 1, 3, 2}, 50), 2.5);
  EXPECT_NEAR(percentile({1, 2, 3, 4}, 99), 3.97, 1e-12);
  EXPECT_NEAR(percentile({15, 20, 35, 40, 50}, 40), 29.0, 1e-12);
  EXPECT_DOUBLE_EQ(percentile({7}, 99), 7);
  EXPECT_DOUBLE_EQ(percentile({}, 50), 0);
  EXPECT_DOUBLE_EQ(percentile({1, 2, 3}, 100), 3);
  EXPECT_DOUBLE_EQ(percentile({1, 2, 3}, 0), 1);
}

TEST(Summarize, MeanMedianP99StdMax) {
  Stat s = summarize({1, 2, 3, 4});
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_DOUBLE_EQ(s.median, 2.5);
  EXPECT_NEAR(s.p99, 3.97, 1e-12);
  EXPECT_NEAR(s.stddev, std::sqrt(1.25), 1e-12);  // numpy std, ddof=0
  EXPECT_DOUBLE_EQ(s.max, 4);
}

TEST(Cost, SeedArithmetic) {
  // The seed table: 952 tok/s on 8 GPUs at $2.50 per GPU-hour.
  EXPECT_NEAR(tps_per_gpu_hour_dollar(952, 8, 2.50), 47.6, 1e-9);
  // $20/h buys 952 * 3600 tokens: $/Mtok = 20 / 3.4272 = 5.8357...
  EXPECT_NEAR(usd_per_mtok(952, 8, 2.50), 20.0 / (952 * 3600) * 1e6, 1e-9);
  EXPECT_DOUBLE_EQ(tps_per_gpu_hour_dollar(952, 0, 2.5), 0);
  EXPECT_DOUBLE_EQ(usd_per_mtok(0, 8, 2.5), 0);
}

RequestRecord ok_record(double send, double first, double gap, int chunks) {
  RequestRecord r;
  r.success = true;
  r.send_s = send;
  for (int i = 0; i < chunks; ++i) r.chunk_s.push_back(send + first + i * gap);
  r.end_s = r.chunk_s.back() + 0.001;
  r.expected_input_tokens = 100;
  return r;
}

TEST(ComputeMetrics, DefinitionsFromDesign) {
  std::vector<RequestRecord> rs;
  rs.push_back(ok_record(0.0, 0.2, 0.05, 11));   // E2E 0.7, TPOT 0.05
  rs.push_back(ok_record(0.1, 0.4, 0.10, 6));    // E2E 0.9, TPOT 0.1
  rs.back().completion_tokens = 11;              // usage wins over chunk count: TPOT 0.05
  rs.back().prompt_tokens = 50;
  RequestRecord bad;
  bad.error = "HTTP 500: later";
  bad.end_s = 0.9;
  rs.push_back(bad);
  RequestRecord earlier = bad;
  earlier.error = "HTTP 500: first";
  earlier.end_s = 0.3;
  rs.push_back(earlier);
  RequestRecord cancelled;
  cancelled.cancelled = true;
  rs.push_back(cancelled);

  Metrics m = compute_metrics(rs, 2.0, 4, INFINITY, CostInputs{8, 2.5});
  EXPECT_EQ(m.completed, 2);
  EXPECT_EQ(m.failed, 2);
  EXPECT_EQ(m.cancelled, 1);
  EXPECT_EQ(m.first_error, "HTTP 500: first");
  EXPECT_EQ(m.total_output_tokens, 22);
  EXPECT_EQ(m.total_input_tokens, 150);
  EXPECT_NEAR(m.output_tps, 11.0, 1e-9);
  EXPECT_NEAR(m.request_tps, 1.0, 1e-9);
  EXPECT_NEAR(m.input_tps, 75.0, 1e-9);
  EXPECT_NEAR(m.ttft_ms.mean, 300, 1e-6);
  EXPECT_NEAR(m.e2e_ms.mean, 800, 1e-6);
  EXPECT_NEAR(m.tpot_ms.mean, 50, 1e-6);
  EXPECT_NEAR(m.per_stream_tps, 20, 1e-6);
  // ITL pools chunk gaps: ten of 50 ms and five of 100 ms.
  EXPECT_NEAR(m.itl_ms.mean, (10 * 50 + 5 * 100) / 15.0, 1e-6);
  EXPECT_NEAR(m.itl_ms.median, 50, 1e-6);
  EXPECT_NEAR(m.measured_concurrency, (0.7 + 0.9) / 2.0, 1e-9);
  EXPECT_NEAR(m.tps_per_gpu_hour_dollar, 11.0 / 20.0, 1e-9);
  EXPECT_NEAR(m.output_tps_per_gpu, 11.0 / 8, 1e-9);
}

TEST(ComputeMetrics, OneTokenRequestsHaveNoTpot) {
  std::vector<RequestRecord> rs{ok_record(0, 0.1, 0, 1)};
  Metrics m = compute_metrics(rs, 1.0, 1, INFINITY, {});
  EXPECT_EQ(m.completed, 1);
  EXPECT_DOUBLE_EQ(m.tpot_ms.mean, 0);
  EXPECT_DOUBLE_EQ(m.per_stream_tps, 0);
  EXPECT_NEAR(m.ttft_ms.mean, 100, 1e-9);
}

TEST(Workload, RangeRatioLikeSglang) {
  auto fixed = sample_lengths(50, 100, 20, 1.0, 7);
  for (auto l : fixed) {
    EXPECT_EQ(l.input, 100);
    EXPECT_EQ(l.output, 20);
  }
  auto half = sample_lengths(2000, 100, 20, 0.5, 7);
  int64_t lo = 1000, hi = 0;
  for (auto l : half) {
    lo = std::min(lo, l.input);
    hi = std::max(hi, l.input);
    EXPECT_GE(l.output, 10);
    EXPECT_LE(l.output, 20);
  }
  EXPECT_EQ(lo, 50);
  EXPECT_EQ(hi, 100);
  auto zero = sample_lengths(2000, 10, 10, 0.0, 7);
  for (auto l : zero) EXPECT_GE(l.input, 1);
  // Same seed, same lengths; another seed, others.
  auto again = sample_lengths(2000, 100, 20, 0.5, 7);
  auto other = sample_lengths(2000, 100, 20, 0.5, 8);
  bool same = true, differ = false;
  for (size_t i = 0; i < half.size(); ++i) {
    same &= half[i].input == again[i].input;
    differ |= half[i].input != other[i].input;
  }
  EXPECT_TRUE(same);
  EXPECT_TRUE(differ);
}

TEST(Workload, ApproximatePromptsHaveOneWordPerToken) {
  auto reqs = approximate_prompts({{5, 3}, {64, 8}}, 1);
  ASSERT_EQ(reqs.size(), 2u);
  for (const auto& r : reqs) {
    std::istringstream ss(r.prompt);
    int words = 0;
    for (std::string w; ss >> w;) ++words;
    EXPECT_EQ(words, r.input_tokens);
  }
  EXPECT_EQ(reqs[1].output_tokens, 8);
  EXPECT_NE(approximate_prompts({{64, 8}}, 2)[0].prompt, reqs[1].prompt);
}

TEST(Workload, JsonlPrompts) {
  std::string path = std::string(MOAT_BINARY_DIR) + "/bench_prompts_test.jsonl";
  {
    std::ofstream f(path);
    f << R"({"prompt": "hello world", "output_len": 7})" << "\n\n"
      << R"({"text": "second one"})" << "\n";
  }
  auto r = load_jsonl_prompts(path, 3, 32, 1);
  ASSERT_TRUE(r.ok()) << r.error().message;
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[0].prompt, "second one");
  EXPECT_EQ((*r)[0].output_tokens, 32);
  EXPECT_EQ((*r)[1].prompt, "hello world");
  EXPECT_EQ((*r)[1].output_tokens, 7);
  {
    std::ofstream f(path);
    f << R"({"messages": []})" << "\n";
  }
  auto bad = load_jsonl_prompts(path, 1, 32);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find(":1:"), std::string::npos) << bad.error().message;
  EXPECT_FALSE(load_jsonl_prompts("/nonexistent.jsonl", 1, 1).ok());
}

TEST(Workload, BuildRejectsBadFlags) {
  WorkloadSpec spec;
  spec.range_ratio = 1.5;
  EXPECT_FALSE(build_workload(spec, 4, 1, 0).ok());
  spec.range_ratio = 1;
  auto ok = build_workload(spec, 4, 1, 0);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->size(), 4u);
  EXPECT_EQ((*ok)[0].input_tokens, 1024);
}

TEST(Sse, SplitsAcrossArbitrarySegments) {
  std::string stream =
      ": keep-alive\n\ndata: {\"a\":1}\r\n\r\ndata:{\"b\":2}\n\nevent: x\ndata: [DONE]\n\n";
  for (size_t step : {1u, 2u, 5u, 1000u}) {
    SseSplitter sse;
    std::vector<std::string> got;
    for (size_t i = 0; i < stream.size(); i += step)
      sse.feed(std::string_view(stream).substr(i, step),
               [&](std::string_view d) { got.emplace_back(d); });
    ASSERT_EQ(got.size(), 3u) << "step " << step;
    EXPECT_EQ(got[0], "{\"a\":1}");
    EXPECT_EQ(got[1], "{\"b\":2}");
    EXPECT_EQ(got[2], "[DONE]");
  }
}

TEST(Url, BaseUrlForms) {
  auto a = parse_base_url("http://127.0.0.1:8000");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->scheme_host_port, "http://127.0.0.1:8000");
  EXPECT_EQ(a->prefix, "");
  auto b = parse_base_url("http://host:30000/v1/");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->scheme_host_port, "http://host:30000");
  EXPECT_EQ(b->prefix, "");
  auto c = parse_base_url("https://gw.example.com/team/v1");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->prefix, "/team");
  EndpointConfig e;
  e.base_url = "https://gw.example.com/team/v1";
  e.chat = true;
  EXPECT_EQ(request_path(e), "/team/v1/chat/completions");
  EXPECT_FALSE(parse_base_url("127.0.0.1:8000").ok());
  EXPECT_FALSE(parse_base_url("ftp://x").ok());
}

TEST(RequestBody, CarriesStreamUsageAndIgnoreEos) {
  EndpointConfig e;
  e.model = "m";
  BenchRequest r{"hi there", 2, 9};
  auto j = nlohmann::json::parse(request_body(e, r));
  EXPECT_EQ(j["prompt"], "hi there");
  EXPECT_EQ(j["max_tokens"], 9);
  EXPECT_EQ(j["stream"], true);
  EXPECT_EQ(j["stream_options"]["include_usage"], true);
  EXPECT_EQ(j["ignore_eos"], true);
  e.chat = true;
  e.ignore_eos = false;
  j = nlohmann::json::parse(request_body(e, r));
  EXPECT_EQ(j["messages"][0]["content"], "hi there");
  EXPECT_FALSE(j.contains("ignore_eos"));
}

TEST(Plot, NiceTicks) {
  auto t = nice_ticks(952, 6);
  EXPECT_DOUBLE_EQ(t.front(), 0);
  EXPECT_GE(t.back(), 952);
  EXPECT_DOUBLE_EQ(t[1], 200);
  auto small = nice_ticks(0.37, 5);
  EXPECT_NEAR(small[1], 0.1, 1e-12);
  EXPECT_GE(small.back(), 0.37);
}

}  // namespace
}  // namespace moat::bench

namespace moat::bench {
namespace {

// With a tokenizer the prompts have exactly the asked-for token counts. Skipped where the shared
// test vocabularies are absent; nothing else in these tests needs a tokenizer.
TEST(Workload, TokenizerPromptsAreExact) {
  std::string dir = std::string(MOAT_SOURCE_DIR) + "/../shared/testdata/tokenizers/gpt-2";
  if (!std::ifstream(dir + "/tokenizer.json")) GTEST_SKIP() << "no " << dir;
  auto lengths = sample_lengths(8, 200, 4, 0.5, 3);
  auto reqs = tokenizer_prompts(dir, lengths, 3);
  if (!reqs.ok() && reqs.error().message.find("no tokenizer module") != std::string::npos)
    GTEST_SKIP() << reqs.error().message;
  ASSERT_TRUE(reqs.ok()) << reqs.error().message;
  ASSERT_EQ(reqs->size(), 8u);
  auto counts = count_tokens(dir, {(*reqs)[0].prompt, (*reqs)[7].prompt});
  ASSERT_TRUE(counts.ok());
  for (size_t i = 0; i < reqs->size(); ++i) EXPECT_EQ((*reqs)[i].input_tokens, lengths[i].input);
  EXPECT_EQ((*counts)[0], lengths[0].input);
  EXPECT_EQ((*counts)[1], lengths[7].input);
  EXPECT_FALSE(tokenizer_prompts("/nonexistent", lengths, 3).ok());
  // The tokenizer-free approximation is one GPT-2 token per word.
  auto approx = approximate_prompts({{500, 1}}, 3);
  auto approx_count = count_tokens(dir, {approx[0].prompt});
  ASSERT_TRUE(approx_count.ok());
  EXPECT_EQ((*approx_count)[0], 500);
}

}  // namespace
}  // namespace moat::bench
