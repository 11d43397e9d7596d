// End-to-end: the client, runner and reports against a fake streaming server on loopback whose
// delays are known, so the measured TTFT / TPOT / ITL can be checked against them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "bench/metrics.h"
#include "bench/plot.h"
#include "bench/report.h"
#include "bench/runner.h"
#include "fake_server.h"

namespace moat::bench {
namespace {

using testing::FakeOptions;
using testing::FakeServer;

std::vector<BenchRequest> requests(int n, int64_t output_len) {
  auto lengths = sample_lengths(n, 16, output_len, 1.0, 1);
  return approximate_prompts(lengths, 1);
}

Metrics run_and_measure(const FakeServer& server, bool chat, int n, int concurrency,
                        int64_t output_len, int warmup = 0) {
  EndpointConfig e;
  e.base_url = server.url();
  e.model = "fake-model";
  e.chat = chat;
  RunOptions o;
  o.concurrency = concurrency;
  auto reqs = requests(n + warmup, output_len);
  std::vector<BenchRequest> measured(reqs.begin(), reqs.begin() + n), warm(reqs.begin() + n, reqs.end());
  auto r = run_benchmark(e, measured, warm, o);
  EXPECT_TRUE(r.ok()) << r.error().message;
  if (!r.ok()) return {};
  return compute_metrics(r->records, r->duration_s, concurrency, INFINITY, {});
}

void expect_within(double got, double want, double rel, const char* what) {
  EXPECT_NEAR(got, want, want * rel) << what;
}

TEST(BenchE2E, CompletionsTimingsMatchKnownDelays) {
  FakeServer server(FakeOptions{.first_ms = 200, .gap_ms = 50, .prompt_tokens = 16});
  // Eight tokens: E2E = 200 + 7 x 50 = 550 ms.
  Metrics m = run_and_measure(server, false, 4, 2, 8, /*warmup=*/1);
  EXPECT_EQ(server.requests(), 5);
  EXPECT_EQ(m.completed, 4);
  EXPECT_EQ(m.failed, 0);
  expect_within(m.ttft_ms.mean, 200, 0.05, "TTFT mean");
  expect_within(m.ttft_ms.median, 200, 0.05, "TTFT median");
  expect_within(m.tpot_ms.mean, 50, 0.05, "TPOT mean");
  expect_within(m.itl_ms.mean, 50, 0.05, "ITL mean");
  expect_within(m.itl_ms.median, 50, 0.05, "ITL median");
  expect_within(m.e2e_ms.mean, 550, 0.05, "E2E mean");
  expect_within(m.per_stream_tps, 20, 0.05, "per-stream tok/s");
  EXPECT_EQ(m.total_output_tokens, 32);
  EXPECT_EQ(m.total_input_tokens, 64);  // from usage.prompt_tokens
  // Two waves of two: duration ~1.1 s, output ~29 tok/s, concurrency ~2.
  expect_within(m.duration_s, 1.1, 0.05, "duration");
  expect_within(m.output_tps, 32 / 1.1, 0.05, "output tok/s");
  expect_within(m.measured_concurrency, 2.0, 0.05, "concurrency");
}

TEST(BenchE2E, ChatWithoutUsageAndEmptyChunks) {
  // The chat stream opens with a role-only empty delta at t=0 and interleaves empty chunks:
  // neither may count as the first token or as a token.
  FakeServer server(FakeOptions{.first_ms = 200, .gap_ms = 50, .usage = false, .empty_chunks = true});
  Metrics m = run_and_measure(server, true, 4, 4, 6);
  EXPECT_EQ(m.completed, 4);
  expect_within(m.ttft_ms.mean, 200, 0.05, "TTFT mean");
  expect_within(m.tpot_ms.mean, 50, 0.05, "TPOT mean");
  expect_within(m.itl_ms.mean, 50, 0.05, "ITL mean");
  EXPECT_EQ(m.total_output_tokens, 24);  // counted from chunks
  EXPECT_EQ(m.total_input_tokens, 64);   // the workload's own count: no usage
}

TEST(BenchE2E, FailuresAreCountedAndTheRunContinues) {
  FakeServer server(FakeOptions{.first_ms = 5, .gap_ms = 2, .http_500_every = 3,
                                .midstream_error_every = 4});
  Metrics m = run_and_measure(server, false, 24, 4, 5);
  // Of requests 1..24: 8 are multiples of 3 (HTTP 500), 4 more multiples of 4 but not 12.
  EXPECT_EQ(server.requests(), 24);
  EXPECT_EQ(m.failed, 8 + 4);
  EXPECT_EQ(m.completed, 12);
  EXPECT_TRUE(m.first_error.find("HTTP 500: fake overload") != std::string::npos ||
              m.first_error.find("fake mid-stream failure") != std::string::npos)
      << m.first_error;
  EXPECT_EQ(m.total_output_tokens, 12 * 5);
}

TEST(BenchE2E, UnreachableServerFailsCleanly) {
  int port;
  {
    FakeServer s(FakeOptions{});
    port = std::stoi(s.url().substr(s.url().rfind(':') + 1));
  }
  EndpointConfig e;
  e.base_url = "http://127.0.0.1:" + std::to_string(port);
  auto reqs = requests(2, 4);
  auto with_warmup = run_benchmark(e, reqs, {reqs[0]}, RunOptions{});
  ASSERT_FALSE(with_warmup.ok());
  EXPECT_NE(with_warmup.error().message.find("warmup"), std::string::npos);
  auto without = run_benchmark(e, reqs, {}, RunOptions{});
  ASSERT_TRUE(without.ok());
  Metrics m = compute_metrics(without->records, without->duration_s, 1, INFINITY, {});
  EXPECT_EQ(m.failed, 2);
  EXPECT_NE(m.first_error.find("transport"), std::string::npos) << m.first_error;
}

TEST(BenchE2E, PoissonArrivalsAreSeededAndSpaced) {
  auto a = arrival_times(200, 10.0, 3), b = arrival_times(200, 10.0, 3);
  EXPECT_EQ(a, b);
  EXPECT_DOUBLE_EQ(a[0], 0);
  for (size_t i = 1; i < a.size(); ++i) EXPECT_GE(a[i], a[i - 1]);
  expect_within(a.back() / 199, 0.1, 0.25, "mean gap");
  for (double t : arrival_times(5, INFINITY, 3)) EXPECT_EQ(t, 0);
  // A finite rate spaces the sends: 6 requests at 20/s span ~0.25 s more than at infinity.
  FakeServer server(FakeOptions{.first_ms = 1, .gap_ms = 1});
  EndpointConfig e;
  e.base_url = server.url();
  RunOptions o;
  o.concurrency = 0;
  o.request_rate = 20;
  o.seed = 5;
  auto r = run_benchmark(e, requests(6, 2), {}, o);
  ASSERT_TRUE(r.ok());
  auto t = arrival_times(6, 20, 5);
  EXPECT_GE(r->records.back().send_s - r->records.front().send_s, t.back() - 0.01);
}

TEST(BenchE2E, CtrlCStopsAndKeepsWhatFinished) {
  FakeServer server(FakeOptions{.first_ms = 100, .gap_ms = 100});
  EndpointConfig e;
  e.base_url = server.url();
  std::atomic<bool> stop{false};
  RunOptions o;
  o.concurrency = 2;
  o.interrupt = &stop;
  // Each request takes 100 + 9 x 100 = 1 s; interrupt during the second wave.
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1300));
    stop = true;
  });
  double t0 = monotonic_s();
  auto r = run_benchmark(e, requests(8, 10), {}, o);
  double took = monotonic_s() - t0;
  killer.join();
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->interrupted);
  EXPECT_LT(took, 1.8);
  Metrics m = compute_metrics(r->records, r->duration_s, 2, INFINITY, {});
  EXPECT_EQ(m.completed, 2);
  EXPECT_EQ(m.cancelled, 2);
  EXPECT_EQ(m.failed, 0);
  expect_within(m.duration_s, 1.3, 0.1, "duration up to the interrupt");
}

TEST(BenchE2E, SweepWritesJsonCsvAndPlots) {
  FakeServer server(FakeOptions{.first_ms = 20, .gap_ms = 5, .prompt_tokens = 16});
  RunContext ctx{server.url(), "fake-model", "completions", 16, 6, 1.0, 8, false};
  std::vector<Metrics> sweep;
  for (int c : {1, 2, 4}) {
    EndpointConfig e;
    e.base_url = server.url();
    RunOptions o;
    o.concurrency = c;
    auto r = run_benchmark(e, requests(8, 6), {}, o);
    ASSERT_TRUE(r.ok());
    sweep.push_back(compute_metrics(r->records, r->duration_s, c, INFINITY, CostInputs{8, 2.5}));
  }
  // More streams, more aggregate throughput, on a server with no batching cost.
  EXPECT_GT(sweep[2].output_tps, sweep[0].output_tps * 2);

  namespace fs = std::filesystem;
  fs::path dir = fs::path(MOAT_BINARY_DIR) / "bench_test_out";
  fs::create_directories(dir);
  ASSERT_TRUE(write_json((dir / "sweep.json").string(), sweep, ctx).ok());
  ASSERT_TRUE(write_csv((dir / "sweep.csv").string(), sweep, ctx).ok());
  ASSERT_TRUE(plot_throughput_curve((dir / "curve.png").string(), sweep, 8, "fake").ok());
  ASSERT_TRUE(plot_throughput_curve((dir / "curve.svg").string(), sweep, 8, "fake").ok());
  EXPECT_FALSE(plot_throughput_curve((dir / "curve.gif").string(), sweep, 8, "fake").ok());

  std::ifstream jf(dir / "sweep.json");
  auto j = nlohmann::json::parse(jf);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 3u);
  for (const char* key : {"concurrency", "completed", "failed", "duration_s", "output_tps",
                          "request_tps", "per_stream_tps", "tps_per_gpu_hour_dollar",
                          "usd_per_mtok"})
    EXPECT_TRUE(j[0].contains(key)) << key;
  for (const char* key : {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"})
    for (const char* s : {"mean", "median", "p99"}) EXPECT_TRUE(j[1][key][s].is_number()) << key << s;
  EXPECT_EQ(j[2]["concurrency"], 4);
  EXPECT_EQ(j[2]["completed"], 8);

  std::ifstream cf(dir / "sweep.csv");
  std::string header, row;
  std::getline(cf, header);
  EXPECT_NE(header.find("ttft_ms_p99"), std::string::npos);
  int rows = 0;
  while (std::getline(cf, row)) ++rows;
  EXPECT_EQ(rows, 3);

  std::ifstream pf(dir / "curve.png", std::ios::binary);
  char sig[8] = {};
  pf.read(sig, 8);
  EXPECT_EQ(std::string(sig + 1, 3), "PNG");
  EXPECT_GT(fs::file_size(dir / "curve.svg"), 1000u);

  // The terminal reports print without crashing and carry the sglang headings.
  std::FILE* tmp = std::tmpfile();
  print_summary(tmp, sweep[0], ctx);
  print_sweep_table(tmp, sweep);
  std::rewind(tmp);
  std::string text(8192, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), tmp));
  std::fclose(tmp);
  EXPECT_NE(text.find("Serving Benchmark Result"), std::string::npos);
  EXPECT_NE(text.find("Output token throughput (tok/s):"), std::string::npos);
  EXPECT_NE(text.find("tok/s per $/h"), std::string::npos);
}

TEST(BenchE2E, ModelIdFromServer) {
  FakeServer server(FakeOptions{});
  EndpointConfig e;
  e.base_url = server.url() + "/v1";
  auto id = fetch_model_id(e);
  ASSERT_TRUE(id.ok()) << id.error().message;
  EXPECT_EQ(*id, "fake-model");
}

// How many requests/s the client drives against a server that answers at once (16 one-token
// chunks per request): the ceiling above which the client, not the server, is measured.
// Run: test_bench --gtest_also_run_disabled_tests --gtest_filter='*ClientOverhead*'
TEST(BenchE2E, DISABLED_ClientOverhead) {
  FakeServer server(FakeOptions{.first_ms = 0, .gap_ms = 0});
  for (int c : {1, 16, 64}) {
    EndpointConfig e;
    e.base_url = server.url();
    RunOptions o;
    o.concurrency = c;
    // The warmup opens the connections: httplib's server listens with a backlog of 5, so a
    // burst of 64 connects loses a few to SYN retries, which is the fake server, not the client.
    auto all = requests(2000 + c, 16);
    std::vector<BenchRequest> measured(all.begin(), all.begin() + 2000), warm(all.begin() + 2000, all.end());
    auto r = run_benchmark(e, measured, warm, o);
    ASSERT_TRUE(r.ok());
    Metrics m = compute_metrics(r->records, r->duration_s, c, INFINITY, {});
    EXPECT_EQ(m.failed, 0) << m.first_error;
    std::printf("concurrency %3d: %.0f req/s, %.0f chunks/s (server and client share the CPU)\n",
                c, m.request_tps, m.output_tps);
  }
}

}  // namespace
}  // namespace moat::bench
