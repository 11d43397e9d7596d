// Scheduler output -> the model's batch: the one place that turns requests into tokens,
// positions, block tables and slot mappings.
#pragma once

#include "models/forward_batch.h"
#include "sched/scheduler.h"

namespace moat {

// Chunks in order; a chunk that reaches the end of its request asks for the logits of its last
// token, a verification chunk (num_spec > 0: the last token and the proposal) for all of its
// 1 + num_spec tokens. Logits rows follow the sampling chunks in order.
inline ForwardBatch build_forward_batch(const SchedulerOutput& out, int32_t block_size) {
  ForwardBatch batch;
  batch.block_size = block_size;
  std::vector<int32_t> tokens;
  for (const ScheduledChunk& c : out.chunks) {
    const Request& r = *c.request;
    tokens.resize(static_cast<size_t>(c.num_tokens));
    for (int64_t i = 0; i < c.num_tokens; ++i) tokens[i] = r.token_or_spec_at(c.first + i);
    const ForwardBatch::Logits logits = !c.samples()     ? ForwardBatch::Logits::none
                                        : c.num_spec > 0 ? ForwardBatch::Logits::all
                                                         : ForwardBatch::Logits::last;
    batch.add_sequence(tokens, static_cast<int32_t>(c.first), r.block_table, logits, r.state_slot);
  }
  return batch;
}

}  // namespace moat
