// The options every command that runs a local model shares (--model, --backend, --threads,
// --no-mmap), and the one way they turn into a loaded model.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "engine/engine.h"
#include "models/deepseek_v3.h"

namespace moat::cli {

struct ModelOptions {
  std::string model;  // empty: default_model_dir()
  std::string backend = "cpu";
  int threads = 0;    // 0: all cores
  bool no_mmap = false;
  bool exact = false;  // OpTable::set_exact_activations
  std::string kv_dtype = "bf16";

  std::string dir() const;
  // The model directory, or an error saying it does not exist or is not a directory.
  Status check_dir() const;
  void add_to(CLI::App& sub);
  // Loads the model (with its own pool of --threads). Errors name the flag or the file at fault.
  Result<std::unique_ptr<DeepseekModel>> load(int64_t max_context) const;
  // Another checkpoint with the same settings (a speculative draft).
  Result<std::unique_ptr<DeepseekModel>> load(const std::string& dir, int64_t max_context, bool mtp = false) const;
};

// The engine's sizing flags (vLLM's names), shared by every command that runs the engine.
struct EngineOptions {
  int32_t block_size = 64;
  double kv_memory_gib = 0;  // 0: room for max_num_seqs full contexts, at most half the free memory
  int32_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 512;
  bool no_prefix_caching = false;
  std::string speculative;  // "", "ngram" or "draft:DIR"
  int32_t num_speculative_tokens = 4;

  void add_to(CLI::App& sub);
  // The draft model --speculative draft:DIR names (loaded like the target), or null.
  Result<std::unique_ptr<DeepseekModel>> load_draft(const ModelOptions& target, int64_t max_context) const;
  // draft: load_draft's model, kept alive by the caller as long as the engine.
  EngineConfig config(int64_t max_model_len, DeepseekModel* draft = nullptr) const;
};

}  // namespace moat::cli
