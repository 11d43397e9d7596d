// Drives one benchmark run: a fixed pool of worker threads (the concurrency limit), each with its
// own keep-alive connection, pulling requests in order. Request i may not start before its
// arrival time (all at 0 for an infinite rate, Poisson for a finite one), and a request that has
// arrived waits for a free worker, which is sglang's semaphore-plus-rate model.
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "base/status.h"
#include "bench/client.h"
#include "bench/metrics.h"
#include "bench/workload.h"

namespace moat::bench {

struct RunOptions {
  int concurrency = 1;  // workers; 0 = one per request (unlimited)
  double request_rate = std::numeric_limits<double>::infinity();  // requests/s
  uint64_t seed = 0;    // arrival times
  bool progress = false;  // progress bar on stderr
  std::string label;      // shown before the bar, e.g. "c=16"
  // Set asynchronously (SIGINT): stop sending, abort requests in flight, return what finished.
  const std::atomic<bool>* interrupt = nullptr;
};

struct RunResult {
  std::vector<RequestRecord> records;  // one per request that was sent, in workload order
  double start_s = 0;     // monotonic_s() when the measured requests were released
  double duration_s = 0;  // start_s to last finish (to the interrupt when interrupted)
  bool interrupted = false;
};

// Arrival offsets in seconds: zeros for an infinite rate, exponential gaps for a finite one.
std::vector<double> arrival_times(int n, double request_rate, uint64_t seed);

// Sends `warmup` first at the same concurrency (not measured; give them prompts of their own so
// the measured ones do not hit a prefix cache they warmed), then `requests`, measured.
// Errors only when no request can be made at all (bad URL, every warmup request failed).
Result<RunResult> run_benchmark(const EndpointConfig& endpoint,
                                const std::vector<BenchRequest>& requests,
                                const std::vector<BenchRequest>& warmup,
                                const RunOptions& options);

}  // namespace moat::bench
