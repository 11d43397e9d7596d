// Scheduler output -> the model's batch: the one place that turns requests into tokens,
// positions, block tables and slot mappings.
#pragma once

#include "models/forward_batch.h"
#include "sched/scheduler.h"

namespace moat {

// Chunks in order; a chunk that reaches the end of its request asks for the logits of its last
// token, so logits row i belongs to the i-th sampling chunk.
inline ForwardBatch build_forward_batch(const SchedulerOutput& out, int32_t block_size) {
  ForwardBatch batch;
  batch.block_size = block_size;
  std::vector<int32_t> tokens;
  for (const ScheduledChunk& c : out.chunks) {
    const Request& r = *c.request;
    tokens.resize(static_cast<size_t>(c.num_tokens));
    for (int64_t i = 0; i < c.num_tokens; ++i) tokens[i] = r.token_at(c.first + i);
    batch.add_sequence(tokens, static_cast<int32_t>(c.first), r.block_table,
                       c.samples() ? ForwardBatch::Logits::last : ForwardBatch::Logits::none);
  }
  return batch;
}

}  // namespace moat
