// End-to-end: the client, runner and reports against a fake streaming server on loopback that
// stamps what it did on the client's clock, so the measured TTFT / TPOT / ITL can be checked
// against what really happened rather than against delays a loaded machine stretches.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "bench/calibrate.h"
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

// The timing tests never compare a measurement with a nominal delay (a loaded machine stretches
// every delay): the fake server stamps, on the client's clock, when each request reached its
// handler and when each token went to the socket, and the client's records are checked against
// those stamps. Nothing may be recorded before the server did it: exact, whatever the load. How
// late the client records is bounded in the median, by kSlackS: scheduling on a 2-core machine
// under stress-ng --cpu 2 and two compilers delayed single chunks by up to 32 ms but left
// medians under 8 ms, while a client that stamps a chunk when the next one arrives, stamps the
// first when the stream ends, or stamps its send before it sent, is late by 50 ms or more in
// every request.
constexpr double kSlackS = 0.020;

double median(std::vector<double> v) { return percentile(std::move(v), 50); }

struct Measured {
  std::vector<BenchRequest> sent;  // the measured requests, in the order of result.records
  RunResult result;
  Metrics m;
};

Measured run_and_measure(const FakeServer& server, bool chat, int n, int concurrency,
                         int64_t output_len, int warmup = 0) {
  EndpointConfig e;
  e.base_url = server.url();
  e.model = "fake-model";
  e.chat = chat;
  RunOptions o;
  o.concurrency = concurrency;
  auto reqs = requests(n + warmup, output_len);
  Measured out;
  out.sent.assign(reqs.begin(), reqs.begin() + n);
  std::vector<BenchRequest> warm(reqs.begin() + n, reqs.end());
  auto r = run_benchmark(e, out.sent, warm, o);
  EXPECT_TRUE(r.ok()) << r.error().message;
  if (!r.ok()) return out;
  out.result = std::move(*r);
  out.m = compute_metrics(out.result.records, out.result.duration_s, concurrency, INFINITY, {});
  return out;
}

// The most requests the server was answering at one time (handler start to last token).
int max_in_flight(const std::vector<testing::Served>& served) {
  std::vector<std::pair<double, int>> events;
  for (const auto& s : served) {
    if (s.token_s.empty()) continue;
    events.push_back({s.received_s, +1});
    events.push_back({s.token_s.back(), -1});
  }
  std::sort(events.begin(), events.end());  // at a tie, an end (-1) sorts before a start
  int now = 0, most = 0;
  for (auto& [t, d] : events) most = std::max(most, now += d);
  return most;
}

// Every measured request as the client recorded it against what the server did for it.
void expect_client_tracks_server(const FakeServer& server, const Measured& run, int first_ms) {
  auto served = server.served();
  ASSERT_EQ(run.result.records.size(), run.sent.size());
  std::vector<RequestRecord> server_view;
  std::vector<double> send_lag;                 // per request: its handler started - client's send
  std::vector<std::vector<double>> chunk_lag;   // [chunk index][request]: recorded - written
  for (size_t i = 0; i < run.sent.size(); ++i) {
    const RequestRecord& rec = run.result.records[i];
    SCOPED_TRACE("request " + std::to_string(i));
    const testing::Served* s = server.find(served, run.sent[i].prompt);
    ASSERT_NE(s, nullptr);
    ASSERT_TRUE(rec.success) << rec.error;
    EXPECT_LE(rec.send_s, s->received_s) << "the send was stamped after the server had the request";
    ASSERT_EQ(rec.chunk_s.size(), s->token_s.size()) << "one recorded chunk per token written";
    ASSERT_FALSE(s->token_s.empty());
    EXPECT_GE(s->token_s[0] - s->received_s, first_ms / 1e3);  // the server waits that long
    EXPECT_GE(rec.chunk_s[0] - rec.send_s, first_ms / 1e3) << "TTFT below the server's wait";
    send_lag.push_back(s->received_s - rec.send_s);
    std::vector<double> lags;
    for (size_t k = 0; k < rec.chunk_s.size(); ++k) {
      EXPECT_GE(rec.chunk_s[k], s->token_s[k]) << "chunk " << k << " recorded before it was written";
      lags.push_back(rec.chunk_s[k] - s->token_s[k]);
      if (chunk_lag.size() <= k) chunk_lag.resize(k + 1);
      chunk_lag[k].push_back(lags.back());
    }
    EXPECT_LE(median(lags), kSlackS) << "this request's chunks were recorded late";
    RequestRecord v = rec;  // the same request timed by the server: from receipt, per write
    v.send_s = s->received_s;
    v.chunk_s = s->token_s;
    server_view.push_back(v);
  }
  EXPECT_LE(median(send_lag), kSlackS) << "sends were stamped long before the requests left";
  for (size_t k = 0; k < chunk_lag.size(); ++k)
    EXPECT_LE(median(chunk_lag[k]), kSlackS) << "chunk " << k << " was recorded late";
  // The client's metrics against the same metrics of the server's stamps: never below them
  // (every stamp is at or after the server's), and equal up to the lag in the median.
  Metrics truth = compute_metrics(server_view, run.result.duration_s, 1, INFINITY, {});
  const double slack_ms = 2 * kSlackS * 1e3;
  EXPECT_GE(run.m.ttft_ms.mean, truth.ttft_ms.mean);
  EXPECT_GE(run.m.e2e_ms.mean, truth.e2e_ms.mean);
  EXPECT_GE(run.m.ttft_ms.mean, first_ms);
  EXPECT_NEAR(run.m.ttft_ms.median, truth.ttft_ms.median, slack_ms);
  EXPECT_NEAR(run.m.itl_ms.median, truth.itl_ms.median, slack_ms);
  EXPECT_NEAR(run.m.tpot_ms.median, truth.tpot_ms.median, slack_ms);
  EXPECT_NEAR(run.m.e2e_ms.median, truth.e2e_ms.median, slack_ms);
}

TEST(BenchE2E, CompletionsTimingsMatchTheServersStamps) {
  FakeServer server(FakeOptions{.first_ms = 200, .gap_ms = 50, .prompt_tokens = 16});
  // Eight tokens each, two streams, one warmup request first.
  Measured run = run_and_measure(server, false, 4, 2, 8, /*warmup=*/1);
  const Metrics& m = run.m;
  EXPECT_EQ(server.requests(), 5);
  EXPECT_EQ(m.completed, 4);
  EXPECT_EQ(m.failed, 0);
  EXPECT_EQ(m.total_output_tokens, 32);
  EXPECT_EQ(m.total_input_tokens, 64);  // from usage.prompt_tokens
  expect_client_tracks_server(server, run, 200);
  // Some stream ran two requests one after the other, each at least 200 + 7 x 50 ms long.
  EXPECT_GE(m.duration_s, 2 * 0.55);
  // Two streams: never more at the server, and no more than two requests' worth of E2E per second.
  EXPECT_LE(max_in_flight(server.served()), 2);
  EXPECT_LE(m.measured_concurrency, 2.0 + 1e-9);
}

TEST(BenchE2E, ChatWithoutUsageAndEmptyChunks) {
  // The chat stream opens with a role-only empty delta at t=0 and interleaves empty chunks:
  // neither may count as the first token or as a token. No warmup: the four connections are
  // opened under the clock, which the send stamps must account for.
  FakeServer server(FakeOptions{.first_ms = 200, .gap_ms = 50, .usage = false, .empty_chunks = true});
  Measured run = run_and_measure(server, true, 4, 4, 6);
  EXPECT_EQ(run.m.completed, 4);
  expect_client_tracks_server(server, run, 200);
  EXPECT_EQ(run.m.total_output_tokens, 24);  // counted from chunks
  EXPECT_EQ(run.m.total_input_tokens, 64);   // the workload's own count: no usage
}

TEST(BenchE2E, FailuresAreCountedAndTheRunContinues) {
  FakeServer server(FakeOptions{.first_ms = 5, .gap_ms = 2, .http_500_every = 3,
                                .midstream_error_every = 4});
  Metrics m = run_and_measure(server, false, 24, 4, 5).m;
  // Of requests 1..24: 8 are multiples of 3 (HTTP 500), 4 more multiples of 4 but not 12.
  EXPECT_EQ(server.requests(), 24);
  EXPECT_EQ(m.failed, 8 + 4);
  EXPECT_EQ(m.completed, 12);
  EXPECT_TRUE(m.first_error.find("HTTP 500: fake overload") != std::string::npos ||
              m.first_error.find("fake mid-stream failure") != std::string::npos)
      << m.first_error;
  EXPECT_EQ(m.total_output_tokens, 12 * 5);
}

// llama-server promises keep-alive and closes the connection after every streamed response; a
// request written onto the connection just before the close is never answered. The fake server
// does that every time (it closes when the next request arrives), so each stream's second
// request is lost unless the client resends it on a fresh connection.
TEST(BenchE2E, ServerThatClosesKeptAliveConnectionsLosesNoRequest) {
  for (int c : {1, 4}) {
    SCOPED_TRACE("concurrency " + std::to_string(c));
    FakeServer server(FakeOptions{.first_ms = 2, .gap_ms = 1, .port = 0, .close_after_ms = 5000});
    Measured run = run_and_measure(server, false, 12, c, 4);
    EXPECT_EQ(run.m.failed, 0) << run.m.first_error;
    EXPECT_EQ(run.m.completed, 12);
    // Every lost attempt was resent and none reached a handler twice.
    EXPECT_EQ(server.requests(), 12);
    // Each stream ran more than one request (12 > 4), so each met a closed connection once and
    // then stopped reusing connections.
    EXPECT_GE(run.m.resent, 1);
    EXPECT_LE(run.m.resent, c);
  }
}

// A connection cut after the response began is the server's failure: never resent.
TEST(BenchE2E, CutAfterTheResponseBeganIsAFailure) {
  FakeServer server(FakeOptions{.first_ms = 2, .gap_ms = 1, .drop_midstream_every = 2});
  Metrics m = run_and_measure(server, false, 6, 1, 5).m;
  EXPECT_EQ(server.requests(), 6);
  EXPECT_EQ(m.failed, 3);
  EXPECT_EQ(m.completed, 3);
  EXPECT_EQ(m.resent, 0);
  EXPECT_NE(m.first_error.find("transport error"), std::string::npos) << m.first_error;
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
  EXPECT_NEAR(a.back() / 199, 0.1, 0.025) << "mean gap";
  for (double t : arrival_times(5, INFINITY, 3)) EXPECT_EQ(t, 0);
  // A finite rate holds each send until its arrival time, counted from the run's start.
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
  ASSERT_EQ(r->records.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_GE(r->records[i].send_s, r->start_s + t[i]) << i;
}

TEST(BenchE2E, CtrlCStopsAndKeepsWhatFinished) {
  // Requests 3 and up send two tokens, then nothing until the client goes away: they can only
  // end by being aborted. Requests 1 and 2 complete.
  FakeServer server(FakeOptions{.first_ms = 20, .gap_ms = 20, .hang_from_request = 3});
  EndpointConfig e;
  e.base_url = server.url();
  std::atomic<bool> stop{false};
  RunOptions o;
  o.concurrency = 2;
  o.interrupt = &stop;
  // Interrupt once both streams are inside a hung request (so 1 and 2 have finished).
  double stop_set_s = 0;
  std::thread killer([&] {
    auto hung = [&] {
      int n = 0;
      for (const auto& s : server.served()) n += s.index >= 3 && s.token_s.size() == 2;
      return n;
    };
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (hung() < 2 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    stop_set_s = monotonic_s();
    stop = true;
  });
  double t0 = monotonic_s();
  auto r = run_benchmark(e, requests(8, 10), {}, o);
  double t1 = monotonic_s();
  killer.join();
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->interrupted);
  // Without an abort the hung streams would run 30 s and then complete.
  EXPECT_EQ(server.requests(), 4);  // nothing sent after the interrupt
  Metrics m = compute_metrics(r->records, r->duration_s, 2, INFINITY, {});
  EXPECT_EQ(m.completed, 2);
  EXPECT_EQ(m.cancelled, 2);
  EXPECT_EQ(m.failed, 0);
  // The duration runs from the start to the interrupt, which came after the first send.
  double first_send = r->records.front().send_s;
  for (const auto& rec : r->records) first_send = std::min(first_send, rec.send_s);
  EXPECT_GE(m.duration_s, stop_set_s - first_send);
  EXPECT_LE(m.duration_s, t1 - t0);
}

TEST(BenchE2E, SweepWritesJsonCsvAndPlots) {
  RunContext ctx{"http://fake", "fake-model", "completions", 16, 6, 1.0, 8, false};
  std::vector<Metrics> sweep;
  for (int c : {1, 2, 4}) {
    // The server holds every first token until c requests have arrived, so c streams must be
    // in flight at once for the level to finish, however slow the machine.
    FakeServer server(FakeOptions{.first_ms = 20, .gap_ms = 5, .prompt_tokens = 16,
                                  .hold_first_token_until = c});
    EndpointConfig e;
    e.base_url = server.url();
    RunOptions o;
    o.concurrency = c;
    auto r = run_benchmark(e, requests(8, 6), {}, o);
    ASSERT_TRUE(r.ok());
    sweep.push_back(compute_metrics(r->records, r->duration_s, c, INFINITY, CostInputs{8, 2.5}));
    EXPECT_EQ(sweep.back().completed, 8);
    EXPECT_EQ(max_in_flight(server.served()), c) << "concurrency " << c;
  }

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

// A server whose tokenizer makes 2.5 tokens of each common word and adds 3 (BOS, template):
// word prompts sized by its usage.prompt_tokens come out at the asked length on it.
TEST(BenchE2E, WordPromptsAreCalibratedOnTheServersTokenCount) {
  FakeServer server(FakeOptions{.first_ms = 1, .gap_ms = 1, .tokens_per_word = 2.5,
                                .prompt_overhead_tokens = 3});
  EndpointConfig e;
  e.base_url = server.url();
  auto c = calibrate_word_prompts(e, 1);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->method, "usage.prompt_tokens");
  EXPECT_EQ(server.requests(), 2);
  EXPECT_DOUBLE_EQ(c->tokens_per_word, 2.5);
  EXPECT_NEAR(c->added_tokens, 3, 1e-9);
  EXPECT_NE(describe(*c, 128).find("2.50 tokens per word, so prompts of 128 tokens are 51 words"),
            std::string::npos)
      << describe(*c, 128);

  WorkloadSpec spec;
  spec.input_len = 128;
  spec.output_len = 2;
  spec.tokens_per_word = c->tokens_per_word;
  auto reqs = build_workload(spec, 4, 7, 0);
  ASSERT_TRUE(reqs.ok());
  RunOptions o;
  auto r = run_benchmark(e, *reqs, {}, o);
  ASSERT_TRUE(r.ok());
  for (const auto& rec : r->records) {
    ASSERT_TRUE(rec.success) << rec.error;
    // 51 words x 2.5 = 127.5 tokens of text: within half a word of 128, plus the server's 3.
    EXPECT_NEAR(rec.prompt_tokens - 3, 128, 1.25);
    EXPECT_EQ(rec.expected_input_tokens, 128);  // llround(51 x 2.5)
  }
}

TEST(BenchE2E, CalibrationPrefersTokenizeAndSaysWhatIsMissing) {
  {
    FakeServer server(FakeOptions{.tokens_per_word = 3, .prompt_overhead_tokens = 1,
                                  .tokenize_endpoint = true});
    EndpointConfig e;
    e.base_url = server.url() + "/v1";
    auto c = calibrate_word_prompts(e, 1);
    ASSERT_TRUE(c.ok()) << c.error().message;
    EXPECT_EQ(c->method, "POST /tokenize");
    EXPECT_EQ(server.tokenize_calls(), 2);
    EXPECT_EQ(server.requests(), 0);  // nothing generated
    EXPECT_DOUBLE_EQ(c->tokens_per_word, 3);
    EXPECT_EQ(words_for_tokens(128, c->tokens_per_word), 43);
  }
  {
    FakeServer server(FakeOptions{.first_ms = 1, .gap_ms = 1, .usage = false});
    EndpointConfig e;
    e.base_url = server.url();
    auto c = calibrate_word_prompts(e, 1);
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.error().message.find("/tokenize"), std::string::npos) << c.error().message;
    EXPECT_NE(c.error().message.find("no usage.prompt_tokens"), std::string::npos)
        << c.error().message;
  }
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
