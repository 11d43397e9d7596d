// Tensor parallelism's step protocol: rank 0's forward sends each step (the batch and which cache
// it runs on) to the worker ranks, which run the same step on their own weights and caches. Every
// rank then meets the others in the same all-reduces, in the same order.
#include <csignal>
#include <cstring>

#include "base/log.h"
#include "models/deepseek_v3.h"

namespace moat {

namespace {

// Fixed-size, sent first: what to do, and the sizes of what follows.
struct TpStepHeader {
  // 0: forward, 1: shut down, 2: rewind a state slot (speculative decoding), 3 / 4: save / restore
  // a state snapshot (hybrid prefix caching)
  int64_t command = 0;
  uint64_t cache_id = 0;
  int64_t cache_blocks = 0, block_size = 0, cache_layers = 0, cache_dim = 0, cache_dtype = 0;
  int64_t num_tokens = 0, num_sequences = 0, max_blocks = 0, num_logit_rows = 0;
  // Hybrid models: rank 0's state pool (each rank's slots hold its own heads' share)
  uint64_t pool_id = 0;
  int64_t pool_slots = 0, keep_step_states = 0;
  int64_t rewind_seq = 0, rewind_kept = 0, rewind_slot = 0;  // command 2; rewind_slot for 3 and 4 too
  uint64_t snapshot_hash = 0;                                  // commands 3 and 4
  int64_t snapshot_capacity = 0;
};

// Workers keep this many caches (rank 0 makes one per engine, one per scored sequence); rank 0
// refuses to step a cache that fell out of the list rather than let a worker attend to rows it
// never wrote.
constexpr size_t kMaxMirroredCaches = 8;

// The batch's arrays, one after another, as int64: tokens, positions, slot_mapping, token_seq [T];
// query_start [S + 1]; context_lens, state_slots [S]; block_tables [S, max_blocks]; logit_rows [R].
std::vector<int64_t> pack(const ForwardBatch& b) {
  std::vector<int64_t> out;
  auto put = [&out](const auto& v) { out.insert(out.end(), v.begin(), v.end()); };
  put(b.tokens);
  put(b.positions);
  put(b.slot_mapping);
  put(b.token_seq);
  put(b.query_start);
  put(b.context_lens);
  put(b.state_slots);
  put(b.block_tables);
  put(b.logit_rows);
  return out;
}

ForwardBatch unpack(const TpStepHeader& h, const std::vector<int64_t>& in) {
  ForwardBatch b;
  const int64_t T = h.num_tokens, S = h.num_sequences;
  size_t at = 0;
  auto take = [&](auto& v, int64_t n) {
    v.assign(in.begin() + static_cast<int64_t>(at), in.begin() + static_cast<int64_t>(at) + n);
    at += static_cast<size_t>(n);
  };
  take(b.tokens, T);
  take(b.positions, T);
  take(b.slot_mapping, T);
  take(b.token_seq, T);
  take(b.query_start, S + 1);
  take(b.context_lens, S);
  take(b.state_slots, S);
  take(b.block_tables, S * h.max_blocks);
  take(b.logit_rows, h.num_logit_rows);
  MOAT_CHECK(at == in.size(), "tensor-parallel step: {} values received, {} read", in.size(), at);
  b.max_blocks = static_cast<int32_t>(h.max_blocks);
  b.block_size = static_cast<int32_t>(h.block_size);
  return b;
}

int64_t packed_size(const TpStepHeader& h) {
  return 4 * h.num_tokens + (h.num_sequences + 1) + 2 * h.num_sequences + h.num_sequences * h.max_blocks +
         h.num_logit_rows;
}

// Moves id to the back of the list (most recent); returns the id it pushed out, or 0. Rank 0's
// list of ids and the workers' mirrors follow the same order, so both evict the same cache.
uint64_t touch(std::vector<uint64_t>& ids, uint64_t id) {
  std::erase(ids, id);
  ids.push_back(id);
  if (ids.size() <= kMaxMirroredCaches) return 0;
  const uint64_t evicted = ids.front();
  ids.erase(ids.begin());
  return evicted;
}

// A worker's mirror of rank 0's object `id` (a latent cache, a state pool or a pool's snapshot
// cache), made by make() when absent or when keep(existing) says it no longer matches; kept in
// touch()'s order and bounded alike.
template <class T, class Make, class Keep>
T& mirror_of(std::vector<std::pair<uint64_t, std::unique_ptr<T>>>& mirrors, std::vector<uint64_t>& ids, uint64_t id,
             Make make, Keep keep) {
  auto it = std::find_if(mirrors.begin(), mirrors.end(), [&](const auto& m) { return m.first == id; });
  if (it != mirrors.end() && !keep(*it->second)) {
    mirrors.erase(it);
    it = mirrors.end();
  }
  if (it == mirrors.end()) mirrors.emplace_back(id, make());
  if (uint64_t evicted = touch(ids, id))
    std::erase_if(mirrors, [&](const auto& m) { return m.first == evicted; });
  return *std::find_if(mirrors.begin(), mirrors.end(), [&](const auto& m) { return m.first == id; })->second;
}

}  // namespace

void DeepseekModel::send_tp_rewind(const StateSlotPool& states, int32_t seq, int64_t kept_tokens, int32_t slot) const {
  TpStepHeader h;
  h.command = 2;
  h.pool_id = states.id();
  h.rewind_seq = seq;
  h.rewind_kept = kept_tokens;
  h.rewind_slot = slot;
  comm_->broadcast_idle(&h, sizeof(h), 0);
}

void DeepseekModel::mirror_state_snapshot(const StateSlotPool& states, int32_t capacity, bool save, uint64_t hash,
                                          int32_t slot) const {
  if (tp_ <= 1 || tp_rank_ != 0) return;
  TpStepHeader h;
  h.command = save ? 3 : 4;
  h.pool_id = states.id();
  h.pool_slots = states.num_slots();
  h.rewind_slot = slot;
  h.snapshot_hash = hash;
  h.snapshot_capacity = capacity;
  comm_->broadcast_idle(&h, sizeof(h), 0);
}

void DeepseekModel::send_tp_step(int64_t command, const ForwardBatch* batch, const PagedLatentCache* cache,
                                 const ForwardExtras* extras) {
  TpStepHeader h;
  h.command = command;
  if (extras && extras->states && state_bytes_per_request_ > 0) {
    h.pool_id = extras->states->id();
    h.pool_slots = extras->states->num_slots();
    h.keep_step_states = extras->keep_step_states;
  }
  std::vector<int64_t> packed;
  if (command == 0) {
    MOAT_CHECK(batch != nullptr && cache != nullptr, "a forward step needs its batch and cache");
    MOAT_CHECK(std::find(tp_evicted_ids_.begin(), tp_evicted_ids_.end(), cache->id()) == tp_evicted_ids_.end(),
               "a tensor-parallel model steps at most {} latent caches in turn: this one's mirror on the worker "
               "ranks was dropped",
               kMaxMirroredCaches);
    if (uint64_t evicted = touch(tp_cache_ids_, cache->id())) tp_evicted_ids_.push_back(evicted);
    h.cache_id = cache->id();
    h.cache_blocks = cache->num_blocks();
    h.block_size = cache->block_size();
    h.cache_layers = cache->shape().num_layers;
    h.cache_dim = cache->shape().dim;
    h.cache_dtype = static_cast<int64_t>(cache->shape().dtype);
    h.num_tokens = batch->num_tokens();
    h.num_sequences = batch->num_sequences();
    h.max_blocks = batch->max_blocks;
    h.num_logit_rows = static_cast<int64_t>(batch->logit_rows.size());
    packed = pack(*batch);
    MOAT_CHECK(static_cast<int64_t>(packed.size()) == packed_size(h), "tensor-parallel step packs {} values, expected {}",
               packed.size(), packed_size(h));
  }
  comm_->broadcast_idle(&h, sizeof(h), 0);  // the workers wait for it in broadcast_idle
  if (command == 0) comm_->broadcast(packed.data(), static_cast<int64_t>(sizeof(int64_t) * packed.size()), 0);
}

void DeepseekModel::run_tp_worker() {
  MOAT_CHECK(tp_ > 1 && tp_rank_ > 0, "run_tp_worker is for ranks 1.. of a tensor-parallel group");
  // mpirun passes Ctrl-C / SIGTERM to every rank; rank 0 decides when the job ends (it finishes or
  // aborts its requests first), so the workers wait for its word.
  std::signal(SIGINT, SIG_IGN);
  std::signal(SIGTERM, SIG_IGN);
  std::vector<int64_t> packed;
  for (;;) {
    TpStepHeader h;
    comm_->broadcast_idle(&h, sizeof(h), 0);
    if (h.command == 1) return;
    auto pool_of = [&](uint64_t id) -> StateSlotPool* {
      auto p = std::find_if(tp_pools_.begin(), tp_pools_.end(), [&](const auto& e) { return e.first == id; });
      return p == tp_pools_.end() ? nullptr : p->second.get();
    };
    if (h.command == 2) {
      StateSlotPool* pool = pool_of(h.pool_id);
      MOAT_CHECK(pool != nullptr, "rewind of a state pool this rank never stepped");
      rewind_state(static_cast<int32_t>(h.rewind_seq), h.rewind_kept, *pool, static_cast<int32_t>(h.rewind_slot));
      continue;
    }
    if (h.command == 3 || h.command == 4) {
      // A save follows a step on the pool; a restore follows the save it reads.
      StateSlotPool* pool = pool_of(h.pool_id);
      MOAT_CHECK(pool != nullptr && pool->num_slots() == h.pool_slots, "state snapshot of a pool this rank never stepped");
      StateSnapshotCache& snapshots = mirror_of(
          tp_snapshots_, tp_snapshot_ids_, h.pool_id,
          [&] {
            return std::make_unique<StateSnapshotCache>(static_cast<int32_t>(h.snapshot_capacity),
                                                        state_bytes_per_request_);
          },
          [&](const StateSnapshotCache& c) { return c.capacity() == h.snapshot_capacity; });
      const auto slot = static_cast<int32_t>(h.rewind_slot);
      if (h.command == 3) {
        MOAT_CHECK(pool->in_use(slot), "state snapshot of slot {}, which never ran here", slot);
        snapshots.save(h.snapshot_hash, pool->data(slot));
      } else {
        pool->acquire(slot);  // the sequence starts past position 0, so the step will not take it
        MOAT_CHECK(snapshots.restore(h.snapshot_hash, pool->data(slot)),
                   "rank 0 restored a state snapshot this rank does not hold: the mirrors diverged");
      }
      continue;
    }
    MOAT_CHECK(h.command == 0, "unknown tensor-parallel command {}", h.command);
    packed.resize(static_cast<size_t>(packed_size(h)));
    comm_->broadcast(packed.data(), static_cast<int64_t>(sizeof(int64_t) * packed.size()), 0);
    const ForwardBatch batch = unpack(h, packed);
    const LatentCacheShape shape{h.cache_layers, h.cache_dim, static_cast<DType>(h.cache_dtype)};
    PagedLatentCache& cache = mirror_of(
        tp_caches_, tp_cache_ids_, h.cache_id,
        [&] {
          return std::make_unique<PagedLatentCache>(shape, static_cast<int32_t>(h.cache_blocks),
                                                    static_cast<int32_t>(h.block_size));
        },
        [&](const PagedLatentCache& c) {
          MOAT_CHECK(c.num_blocks() == h.cache_blocks && c.block_size() == h.block_size &&
                         c.shape().num_layers == h.cache_layers && c.shape().dim == h.cache_dim,
                     "rank 0's cache {} changed shape", h.cache_id);
          return true;
        });
    ForwardExtras extras;
    if (h.pool_id != 0) {
      StateSlotPool& pool = mirror_of(
          tp_pools_, tp_pool_ids_, h.pool_id,
          [&] { return std::make_unique<StateSlotPool>(static_cast<int32_t>(h.pool_slots), state_bytes_per_request_); },
          [&](const StateSlotPool& p) { return p.num_slots() == h.pool_slots; });
      // A sequence that starts at position 0 starts from the zero state, as rank 0's freshly
      // allocated slot does; any other is running here or was restored from a snapshot (command 4).
      for (int32_t s = 0; s < batch.num_sequences(); ++s)
        if (batch.query_start[s + 1] > batch.query_start[s] && batch.positions[batch.query_start[s]] == 0)
          pool.acquire(batch.state_slots[s]);
      extras.states = &pool;
      extras.keep_step_states = h.keep_step_states != 0;
    }
    forward_local(batch, cache, nullptr, nullptr, extras);
  }
}

}  // namespace moat
