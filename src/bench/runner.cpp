#include "bench/runner.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

namespace moat::bench {

namespace {

bool interrupted(const RunOptions& o) {
  return o.interrupt && o.interrupt->load(std::memory_order_relaxed);
}

void draw_progress(const RunOptions& o, int done, int failed, int total, double elapsed) {
  constexpr int kWidth = 30;
  int filled = total > 0 ? done * kWidth / total : kWidth;
  std::string bar(filled, '#');
  bar.append(kWidth - filled, '.');
  std::fprintf(stderr, "\r%s [%s] %d/%d  failed %d  %.1fs ", o.label.c_str(), bar.c_str(), done,
               total, failed, elapsed);
  std::fflush(stderr);
}

// Runs requests[0..n) on the given clients; fills records (sent ones only).
void drive(std::vector<std::unique_ptr<StreamingClient>>& clients,
           const std::vector<BenchRequest>& requests, const std::vector<double>& arrivals,
           const RunOptions& o, bool show_progress, std::vector<RequestRecord>& records,
           std::vector<char>& sent, double& start, double& stop_time) {
  const int n = static_cast<int>(requests.size());
  records.assign(n, RequestRecord{});
  sent.assign(n, 0);
  std::atomic<int> next{0}, done{0}, failed{0}, running{static_cast<int>(clients.size())};
  start = monotonic_s();
  std::vector<std::thread> workers;
  workers.reserve(clients.size());
  for (auto& client : clients) {
    workers.emplace_back([&, c = client.get()] {
      for (;;) {
        if (interrupted(o)) break;
        int i = next.fetch_add(1);
        if (i >= n) break;
        // Sleep towards the arrival time in short steps so that Ctrl-C is noticed.
        for (double wait; (wait = start + arrivals[i] - monotonic_s()) > 0 && !interrupted(o);)
          std::this_thread::sleep_for(std::chrono::duration<double>(std::min(wait, 0.05)));
        if (interrupted(o)) break;
        sent[i] = 1;
        records[i] = c->send(requests[i], o.interrupt);
        if (!records[i].success && !records[i].cancelled) failed.fetch_add(1);
        done.fetch_add(1);
      }
      running.fetch_sub(1);
    });
  }
  bool stopped_clients = false;
  double last_draw = -1;
  while (running.load() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (interrupted(o) && !stopped_clients) {
      stop_time = monotonic_s();
      for (auto& c : clients) c->stop();  // unblocks reads on silent connections
      stopped_clients = true;
    }
    double now = monotonic_s();
    if (show_progress && now - last_draw >= 0.2) {
      draw_progress(o, done.load(), failed.load(), n, now - start);
      last_draw = now;
    }
  }
  for (auto& w : workers) w.join();
  if (show_progress) {
    draw_progress(o, done.load(), failed.load(), n, monotonic_s() - start);
    std::fprintf(stderr, "\n");
  }
}

}  // namespace

std::vector<double> arrival_times(int n, double request_rate, uint64_t seed) {
  std::vector<double> t(n, 0.0);
  if (!std::isfinite(request_rate) || request_rate <= 0) return t;
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(request_rate);
  for (int i = 1; i < n; ++i) t[i] = t[i - 1] + gap(rng);
  return t;
}

Result<RunResult> run_benchmark(const EndpointConfig& endpoint,
                                const std::vector<BenchRequest>& requests,
                                const std::vector<BenchRequest>& warmup,
                                const RunOptions& options) {
  const int n = static_cast<int>(requests.size());
  if (n == 0) return make_error("--num-prompts: no requests to send");
  int workers = options.concurrency > 0 ? std::min(options.concurrency, n) : n;
  std::vector<std::unique_ptr<StreamingClient>> clients;
  for (int i = 0; i < workers; ++i) {
    MOAT_ASSIGN_OR_RETURN(auto client, StreamingClient::create(endpoint));
    clients.push_back(std::move(client));
  }

  std::vector<RequestRecord> records;
  std::vector<char> sent;
  double start = 0, stop_time = 0;

  if (!warmup.empty()) {
    const std::vector<BenchRequest>& warm = warmup;
    std::vector<std::unique_ptr<StreamingClient>> some;
    int w = std::min<int>(workers, static_cast<int>(warmup.size()));
    for (int i = 0; i < w; ++i) some.push_back(std::move(clients[i]));
    RunOptions quiet = options;
    quiet.label = options.label + " warmup";
    drive(some, warm, std::vector<double>(warm.size(), 0.0), quiet, options.progress, records,
          sent, start, stop_time);
    for (int i = 0; i < w; ++i) clients[i] = std::move(some[i]);
    if (interrupted(options)) return RunResult{{}, 0, true};
    bool any_ok = std::any_of(records.begin(), records.end(), [](auto& r) { return r.success; });
    if (!any_ok)
      return make_error("every warmup request to {} failed; the first: {}", request_path(endpoint),
                        records.front().error);
  }

  std::vector<double> arrivals = arrival_times(n, options.request_rate, options.seed);
  drive(clients, requests, arrivals, options, options.progress, records, sent, start, stop_time);

  RunResult result;
  result.interrupted = interrupted(options);
  double end = start;
  for (int i = 0; i < n; ++i) {
    if (!sent[i]) continue;
    if (!records[i].cancelled) end = std::max(end, records[i].end_s);
    result.records.push_back(std::move(records[i]));
  }
  if (result.interrupted && stop_time > 0) end = std::max(end, stop_time);
  result.start_s = start;
  result.duration_s = end - start;
  return result;
}

}  // namespace moat::bench
