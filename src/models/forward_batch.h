// One model step's tokens, from any number of sequences: prompt chunks and decode tokens mixed
// (no prefill or decode phase). Plain data: the scheduler's output becomes one of these, and the
// model reads nothing else about the requests.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/check.h"

namespace moat {

struct ForwardBatch {
  std::vector<int32_t> tokens;        // [T]
  std::vector<int32_t> positions;     // [T] position of each token in its sequence
  std::vector<int32_t> query_start;   // [S + 1] cu_seqlens: sequence s owns tokens [query_start[s], query_start[s+1])
  std::vector<int32_t> context_lens;  // [S] cache rows of sequence s once this step has written its tokens
  std::vector<int32_t> block_tables;  // [S, max_blocks] block ids of each sequence, -1 past its end
  int32_t max_blocks = 0;
  int32_t block_size = 0;             // rows per block (the cache's)
  std::vector<int64_t> slot_mapping;  // [T] cache slot each token's latent row is written to
  std::vector<int32_t> token_seq;     // [T] the sequence each token belongs to
  std::vector<int32_t> logit_rows;    // tokens whose logits are wanted, in output order
  std::vector<int32_t> state_slots;   // [S] each sequence's recurrent-state slot (kv/state_pool.h); -1: none

  int32_t num_sequences() const { return static_cast<int32_t>(context_lens.size()); }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }

  enum class Logits { none, last, all };
  // Appends one sequence's tokens at positions first_position.. . blocks: the sequence's block
  // table, covering at least first_position + tokens.size() rows.
  void add_sequence(std::span<const int32_t> new_tokens, int32_t first_position, std::span<const int32_t> blocks,
                    Logits logits, int32_t state_slot = -1) {
    MOAT_CHECK(block_size > 0, "set ForwardBatch::block_size before adding sequences");
    const int32_t n = static_cast<int32_t>(new_tokens.size());
    const int32_t end = first_position + n;
    MOAT_CHECK(static_cast<int64_t>(blocks.size()) * block_size >= end,
               "block table of {} blocks of {} cannot hold {} tokens", blocks.size(), block_size, end);
    const int32_t s = num_sequences();
    if (query_start.empty()) query_start.push_back(0);
    const int32_t need = static_cast<int32_t>(blocks.size());
    if (need > max_blocks) {  // widen every row of the table
      std::vector<int32_t> wider(static_cast<size_t>(s) * need, -1);
      for (int32_t r = 0; r < s; ++r)
        std::copy_n(block_tables.begin() + static_cast<int64_t>(r) * max_blocks, max_blocks,
                    wider.begin() + static_cast<int64_t>(r) * need);
      block_tables = std::move(wider);
      max_blocks = need;
    }
    block_tables.resize(static_cast<size_t>(s + 1) * max_blocks, -1);
    std::copy(blocks.begin(), blocks.end(), block_tables.begin() + static_cast<int64_t>(s) * max_blocks);
    for (int32_t i = 0; i < n; ++i) {
      const int32_t pos = first_position + i;
      if (logits == Logits::all || (logits == Logits::last && i == n - 1))
        logit_rows.push_back(static_cast<int32_t>(tokens.size()));
      tokens.push_back(new_tokens[i]);
      positions.push_back(pos);
      token_seq.push_back(s);
      slot_mapping.push_back(static_cast<int64_t>(blocks[pos / block_size]) * block_size + pos % block_size);
    }
    context_lens.push_back(end);
    state_slots.push_back(state_slot);
    query_start.push_back(static_cast<int32_t>(tokens.size()));
  }

  // One sequence's tokens (a prefill chunk, or one decode token).
  static ForwardBatch for_sequence(std::span<const int32_t> new_tokens, int32_t first_position,
                                   std::span<const int32_t> blocks, int32_t block_size,
                                   Logits logits = Logits::last) {
    ForwardBatch b;
    b.block_size = block_size;
    b.add_sequence(new_tokens, first_position, blocks, logits);
    return b;
  }
};

}  // namespace moat
