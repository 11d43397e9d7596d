// What a model asks of the kernel registry at a tensor-parallel degree: `moat doctor`, `moat plan`
// and the engine's load-time dispatch all derive it here, so they cannot disagree.
#pragma once

#include "config/model_config.h"
#include "ops/dispatch.h"

namespace moat {

// Under plain TP each rank holds num_attention_heads / tp heads; the MLA latent (kv_lora + rope
// values per token) is replicated on every rank. Errors when tp does not divide the heads.
// kv_dtype: the element type of the paged latent cache (--kv-dtype).
Result<ops::ModelOpNeeds> model_op_needs(const ModelConfig& config, int64_t tp = 1, DType kv_dtype = DType::BF16);

}  // namespace moat
