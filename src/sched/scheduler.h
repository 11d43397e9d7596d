// The scheduler: which requests run in the next step, and how many of their tokens.
//
// Plain data in, plain data out (vLLM v1's design): schedule() returns a SchedulerOutput, the
// model runs it, and update() takes the sampled tokens back. There is no prefill phase and no
// decode phase. Each step spends a token budget:
//   1. running requests first, in arrival order: one token for those decoding, the next chunk of
//      the prompt for those still prefilling (chunked prefill: a long prompt takes several steps
//      and never stalls the streams that are decoding);
//   2. then waiting requests, oldest first, while the budget, max_num_seqs and free blocks allow;
//      on admission the prefix cache supplies every full block of the prompt it already holds.
// Hybrid models (recurrent state beside the cache) snapshot the state whenever a step ends on a
// block boundary; a prefix hit stops at the deepest boundary with a snapshot, which is copied into
// the request's slot. So that a repeated prompt finds one, the last chunk of a prompt is cut at
// its last block boundary (the prompt's remaining < block_size + 1 tokens run in the next step).
// When a running request needs a block and none is free, the most recently admitted running
// request is preempted: its blocks are released (full ones stay in the prefix cache) and it goes
// back to the front of the waiting queue to be recomputed later, prompt and output together.
// Nothing is ever lost: a request that cannot fit the whole pool is refused when it is added.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "base/status.h"
#include "kv/block_pool.h"
#include "kv/state_pool.h"
#include "sched/request.h"

namespace moat {

struct SchedulerConfig {
  int32_t num_blocks = 0;
  int32_t block_size = 64;
  int64_t max_num_batched_tokens = 512;  // token budget per step
  int32_t max_num_seqs = 64;             // running requests at once
  int64_t max_model_len = 4096;          // prompt + output per request
  bool enable_prefix_caching = true;
  // Recurrent state per running request (kv/state_pool.h; 0 bytes: the model keeps none, as
  // DeepSeek-V3). With state, admission also needs a free slot, and a prefix hit also needs a
  // snapshot of the state where the prefix ends: num_state_snapshots of them are kept (0: hybrid
  // models take no prefix hits).
  int64_t state_bytes_per_request = 0;
  int32_t num_state_slots = 0;
  int32_t num_state_snapshots = 0;
};

struct ScheduledChunk {
  Request* request;
  int64_t first;       // index of the first token computed (== its position)
  int64_t num_tokens;  // num_spec of them speculative (Request::spec_tokens), at the end
  bool sample;         // the chunk ends the request's known tokens: its last logits pick the next token
  int64_t num_spec = 0;  // > 0: a verification: logits for the last 1 + num_spec tokens
  bool samples() const { return sample; }
};

struct SchedulerOutput {
  std::vector<ScheduledChunk> chunks;  // running requests first, then newly admitted ones
  std::vector<uint64_t> preempted;     // requests sent back to waiting during this schedule
  int64_t num_scheduled_tokens = 0;
  bool empty() const { return chunks.empty(); }
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config);

  const SchedulerConfig& config() const { return config_; }
  // Whether a request of this size can ever run (context, pool size); const, so any thread may ask.
  Status check_fits(int64_t prompt_tokens, int64_t max_tokens) const;
  // Checks that the request can ever run (context, pool size); queues it.
  Status add(std::unique_ptr<Request> request);
  Request* find(uint64_t id);
  const Request* find(uint64_t id) const { return const_cast<Scheduler*>(this)->find(id); }
  // Finishes a request at once with `reason` and releases its blocks (abort, stop strings).
  void finish(uint64_t id, FinishReason reason);
  // Takes finished requests out; their ids are never scheduled again.
  std::vector<std::unique_ptr<Request>> take_finished();

  SchedulerOutput schedule();
  // After the model ran `out`: advances computed tokens, registers newly full blocks in the
  // prefix cache, appends the tokens of emitted[i] to the request of the i-th chunk that samples,
  // and finishes requests that hit a stop token or their length limit (tokens after the one that
  // ends a request are dropped). For a verification chunk emitted[i] is the accepted prefix of
  // the proposal and then the target's own token; the rows of rejected tokens stop counting as
  // computed, and blocks past the request's length go back to the pool.
  void update(const SchedulerOutput& out, std::span<const std::vector<int32_t>> emitted);
  // One token per sampling chunk (no speculation).
  void update(const SchedulerOutput& out, std::span<const int32_t> sampled);
  // Running requests, in admission order (the engine asks proposers for the ones decoding).
  std::span<Request* const> running() const { return running_; }

  bool has_work() const { return !waiting_.empty() || !running_.empty(); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  const BlockPool& block_pool() const { return pool_; }
  const StateSlotPool& state_pool() const { return state_pool_; }
  const StateSnapshotCache& state_snapshots() const { return snapshots_; }
  // Called after every save (true) and restore (false) of a state snapshot, with the hash and the
  // request's slot: tensor parallelism repeats them on the worker ranks' shares of the state.
  void set_snapshot_mirror(std::function<void(bool save, uint64_t hash, int32_t slot)> mirror) {
    snapshot_mirror_ = std::move(mirror);
  }
  // The model reads and advances running requests' states in their slots.
  StateSlotPool& state_pool() { return state_pool_; }
  // The model writes a running request's recurrent state here (nullptr without state).
  uint8_t* state_of(const Request& r) { return r.state_slot >= 0 ? state_pool_.data(r.state_slot) : nullptr; }
  int64_t num_preemptions() const { return num_preemptions_; }
  // Blocks a request of `tokens` tokens needs.
  int64_t blocks_for(int64_t tokens) const { return (tokens + config_.block_size - 1) / config_.block_size; }
  // Refcounts equal the block tables that hold each block; the pool's own invariants.
  void check_invariants() const;

 private:
  bool grow_blocks(Request& r, int64_t rows);
  void release_blocks(Request& r);
  void release_state(Request& r);
  void preempt(Request& r);
  void admit_prefix(Request& r);
  void register_full_blocks(Request& r);
  // Hybrid prefix caching: how many of n tokens from `first` to schedule so that a prefill chunk
  // ends on a block boundary where it can; and the snapshot after a step that ended on one.
  int64_t snapshot_aligned(const Request& r, int64_t first, int64_t n) const;
  void snapshot_state(Request& r);
  void finish_request(Request& r, FinishReason reason);

  SchedulerConfig config_;
  BlockPool pool_;
  StateSlotPool state_pool_;
  StateSnapshotCache snapshots_;
  std::function<void(bool, uint64_t, int32_t)> snapshot_mirror_;
  std::unordered_map<uint64_t, std::unique_ptr<Request>> requests_;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;   // admission order
  std::vector<uint64_t> finished_;
  int64_t num_preemptions_ = 0;
};

}  // namespace moat
