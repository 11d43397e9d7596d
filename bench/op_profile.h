// The readable split of an ops::OpProfile that the benchmarks print with --profile (model_bench per
// decode token and per prefill, engine_bench per decode-only step).
#pragma once

#include <cstdio>

#include "ops/dispatch.h"

namespace moat::bench {

// Per kind of op: ms and calls per `per` (a token, a step, a repetition), and for the matmuls and
// routed experts the weight bytes they streamed, as GB/s and % of `bandwidth` (bytes/s); then what
// `total_s` holds beyond the ops (`rest_what` says what that is).
inline void print_op_profile(const ops::OpProfile& prof, double total_s, double per, double bandwidth,
                             const char* rest_what) {
  for (int k = 0; k < ops::OpProfile::kNumKinds; ++k) {
    const auto& b = prof.buckets[k];
    if (b.calls == 0) continue;
    std::printf("    %-16s %7.2f ms, %5.1f calls", ops::OpProfile::kNames[k], 1e3 * b.seconds / per,
                static_cast<double>(b.calls) / per);
    if (b.weight_bytes > 0)
      std::printf(", %.1f MB of weights at %.1f GB/s (%.0f%% of the bandwidth)", b.weight_bytes / per / 1e6,
                  b.weight_bytes / b.seconds / 1e9, 100 * b.weight_bytes / b.seconds / bandwidth);
    std::printf("\n");
  }
  std::printf("    %-16s %7.2f ms (%s)\n", "rest", 1e3 * (total_s - prof.seconds()) / per, rest_what);
}

}  // namespace moat::bench
