#include "cli/model_options.h"

#include "base/thread_pool.h"
#include "cli/command.h"

namespace moat::cli {

std::string ModelOptions::dir() const { return model.empty() ? default_model_dir() : model; }

void ModelOptions::add_to(CLI::App& sub) {
  sub.add_option("--model,-m", model,
                 "model directory (config.json, safetensors, tokenizer); default models/k3-nano");
  sub.add_option("--backend", backend, "cpu | reference");
  sub.add_option("--threads,-t", threads, "threads (default: all cores)");
  sub.add_flag("--no-mmap", no_mmap,
               "read weights into anonymous memory instead of mapping them (same RSS)");
  sub.add_flag("--exact", exact,
               "fp32-accurate activations in every matmul (default: bf16 in prefill and against fp8 weights, "
               "like GPU engines; exact costs ~2x prefill time and ~1.3x fp8 decode time)");
}

Result<std::unique_ptr<DeepseekModel>> ModelOptions::load(int64_t max_context) const {
  if (threads > 0) set_num_threads(threads);
  MOAT_ASSIGN_OR_RETURN(ops::Backend parsed, ops::parse_backend(backend));
  return DeepseekModel::load(dir(), {.backend = parsed,
                                     .max_context = max_context,
                                     .exact_activations = exact,
                                     .weights = no_mmap ? WeightPlacement::memory : WeightPlacement::mmap});
}

}  // namespace moat::cli
