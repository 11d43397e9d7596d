// The throughput-vs-interactivity curve across a concurrency sweep: aggregate output tok/s per
// GPU (y) against per-stream decode tok/s (x), one labelled point per concurrency. Drawn with
// cairo; the file extension picks the format (.png or .svg).
#pragma once

#include <string>
#include <vector>

#include "base/status.h"
#include "bench/metrics.h"

namespace moat::bench {

// gpus divides the aggregate (1 when the user gave no --gpus).
Status plot_throughput_curve(const std::string& path, const std::vector<Metrics>& sweep, int gpus,
                             const std::string& title);

// "Nice" tick positions (1, 2, 5 x 10^k steps) covering [0, max]; exposed for tests.
std::vector<double> nice_ticks(double max_value, int target_count);

}  // namespace moat::bench
