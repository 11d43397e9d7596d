// One logging call for the whole project: MOAT_LOG(info, "loaded {} tensors", n). Goes to stderr
// so that stdout stays clean for generated text and --json output.
#pragma once

#include <fmt/format.h>

#include <cstdio>

namespace moat {

enum class LogLevel { debug = 0, info = 1, warn = 2, error = 3 };

LogLevel log_level();
void set_log_level(LogLevel level);
void log_write(LogLevel level, const std::string& message);

}  // namespace moat

#define MOAT_LOG(level, ...)                                                     \
  do {                                                                           \
    if (::moat::LogLevel::level >= ::moat::log_level())                          \
      ::moat::log_write(::moat::LogLevel::level, ::fmt::format(__VA_ARGS__));    \
  } while (0)
