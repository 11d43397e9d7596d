#include "base/log.h"

#include <atomic>
#include <chrono>
#include <mutex>

namespace moat {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::info)};
std::mutex g_mutex;
}  // namespace

LogLevel log_level() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }
void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }

void log_write(LogLevel level, const std::string& message) {
  static const char* names[] = {"debug", "info", "warn", "error"};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "[moat %s] %s\n", names[static_cast<int>(level)], message.c_str());
}

}  // namespace moat
