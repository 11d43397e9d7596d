// A thread-safe front for the engine core, for the server (DESIGN.md: "one engine thread owns
// the scheduler, the KV cache and the model; server threads only enqueue requests and read
// per-request output queues"). submit() validates on the calling thread (Engine::validate reads
// only immutable state) and hands the request to the engine thread; the engine thread applies
// submissions and aborts between steps, steps while there is work, and sleeps otherwise. Each
// request's outputs arrive on its own RequestStream.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>

#include "engine/engine.h"

namespace moat {

// Rung on every output of the streams that share it, so one reader can sleep on several
// streams (a response's n choices) instead of polling them in turn.
class StreamSignal {
 public:
  uint64_t rings() const;
  // Waits until rings() differs from `seen` or `timeout` passed.
  void wait(uint64_t seen, std::chrono::milliseconds timeout);
  void ring();

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t rings_ = 0;
};

// One request's outputs, in order. The engine thread pushes; one reader pops.
class RequestStream {
 public:
  explicit RequestStream(uint64_t id, std::shared_ptr<StreamSignal> signal = nullptr)
      : id_(id), signal_(std::move(signal)) {}
  uint64_t id() const { return id_; }
  // The next output, waiting up to `timeout`; nullopt on timeout, or after the finished output
  // was taken (finished() then says so).
  std::optional<RequestOutput> next(std::chrono::milliseconds timeout);
  bool finished() const;

  void push(RequestOutput out);  // engine thread

 private:
  uint64_t id_;
  std::shared_ptr<StreamSignal> signal_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<RequestOutput> queue_;
  bool finished_pushed_ = false, finished_taken_ = false;
};

// What /metrics and /health read; refreshed by the engine thread after every step.
struct EngineSnapshot {
  int64_t running = 0, waiting = 0;    // waiting includes submitted requests not yet scheduled
  int64_t kv_blocks_used = 0, kv_blocks_total = 0, block_size = 0;
  int64_t prefix_block_lookups = 0, prefix_block_hits = 0;
  int64_t prompt_tokens_computed = 0, generated_tokens = 0;
  int64_t preemptions = 0, steps = 0;
  int64_t spec_steps = 0, draft_tokens = 0, accepted_tokens = 0;  // speculative decoding
};

class AsyncEngine {
 public:
  struct Options {
    int64_t max_waiting = 1024;  // submit() refuses beyond this many requests not yet running
  };
  // Starts the engine thread; it owns `engine` from now on.
  AsyncEngine(std::unique_ptr<Engine> engine, Options options);
  ~AsyncEngine();  // shutdown(false)
  AsyncEngine(const AsyncEngine&) = delete;
  AsyncEngine& operator=(const AsyncEngine&) = delete;

  enum class SubmitError { invalid, queue_full, shutting_down };
  struct Refusal {
    SubmitError kind;
    std::string message;
  };
  // Validates and queues; the stream receives the outputs and rings `signal` (if any) on each.
  // Thread-safe.
  std::variant<std::shared_ptr<RequestStream>, Refusal> submit(GenerateRequest request,
                                                               std::shared_ptr<StreamSignal> signal = nullptr);
  // Ends a request at once (its stream gets a finished output with reason abort) and frees its KV
  // blocks before the next step. Thread-safe; unknown or finished ids are ignored.
  void abort(uint64_t id);
  // Stops accepting requests; with drain, waits for every in-flight request to finish, otherwise
  // aborts them; then stops the engine thread. Thread-safe, idempotent.
  void shutdown(bool drain);

  EngineSnapshot snapshot() const;
  // Immutable after construction: safe from any thread.
  const Engine& engine() const { return *engine_; }

 private:
  void loop();
  void publish_snapshot();

  std::unique_ptr<Engine> engine_;
  Options options_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::vector<std::pair<GenerateRequest, std::shared_ptr<RequestStream>>> submitted_;
  std::vector<uint64_t> aborted_;
  bool accepting_ = true, stop_ = false, drain_ = false;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<int64_t> not_running_{0};  // submitted + waiting in the scheduler
  EngineSnapshot snapshot_;              // under mu_
  std::unordered_map<uint64_t, std::shared_ptr<RequestStream>> streams_;  // engine thread only
  std::thread thread_;
};

}  // namespace moat
