// Invariant checks: a failure is a bug in moat, so it aborts loudly with file:line and a message.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

namespace moat::detail {
[[noreturn]] inline void check_failed(const char* file, int line, const char* expr,
                                      const std::string& message) {
  std::fprintf(stderr, "%s:%d: MOAT_CHECK failed: %s %s\n", file, line, expr, message.c_str());
  std::fflush(stderr);
  std::abort();
}
}  // namespace moat::detail

#define MOAT_CHECK(cond, ...)                                                          \
  do {                                                                                 \
    if (!(cond)) [[unlikely]]                                                          \
      ::moat::detail::check_failed(__FILE__, __LINE__, #cond,                         \
                                   ::fmt::format("" __VA_ARGS__));                     \
  } while (0)

#define MOAT_CHECK_EQ(a, b, ...) MOAT_CHECK((a) == (b), __VA_ARGS__)
