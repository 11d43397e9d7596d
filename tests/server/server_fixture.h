// What the in-process server tests share: a client for the test server, and waiting until the
// engine and the server hold nothing.
#pragma once

#include <httplib.h>

#include <chrono>
#include <memory>
#include <thread>

#include "engine/async_engine.h"
#include "server/server.h"

namespace moat::server::testing {

inline std::unique_ptr<httplib::Client> make_client(const OpenAIServer& server, int read_timeout_s,
                                                    int connection_timeout_s) {
  auto c = std::make_unique<httplib::Client>("127.0.0.1", server.port());
  c->set_read_timeout(read_timeout_s, 0);
  c->set_connection_timeout(connection_timeout_s, 0);
  return c;
}

// Polls until no request runs or waits, no KV block is held and no response is in flight;
// false after `timeout`.
inline bool wait_engine_idle(AsyncEngine& engine, const OpenAIServer& server, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  do {
    const EngineSnapshot s = engine.snapshot();
    if (s.running == 0 && s.waiting == 0 && s.kv_blocks_used == 0 && server.in_flight() == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  } while (std::chrono::steady_clock::now() < deadline);
  return false;
}

}  // namespace moat::server::testing
