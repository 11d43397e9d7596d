// The one clock of the bench module: seconds of std::chrono::steady_clock since its own epoch
// (CLOCK_MONOTONIC on Linux). Inline and without a process-local epoch so that code that does not
// link the bench module (the in-process fake server of the tests, bench/fake_openai_server) stamps
// events on exactly the clock the client records with, and the two can be compared.
#pragma once

#include <chrono>

namespace moat::bench {

inline double to_monotonic_s(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

inline double monotonic_s() { return to_monotonic_s(std::chrono::steady_clock::now()); }

}  // namespace moat::bench
