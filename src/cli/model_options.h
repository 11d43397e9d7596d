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
  // Sizes the thread pool, then loads. Errors name the flag or the file at fault.
  Result<std::unique_ptr<DeepseekModel>> load(int64_t max_context) const;
};

// The engine's sizing flags (vLLM's names), shared by every command that runs the engine.
struct EngineOptions {
  int32_t block_size = 64;
  double kv_memory_gib = 0;  // 0: room for max_num_seqs full contexts, at most half the free memory
  int32_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 512;
  bool no_prefix_caching = false;

  void add_to(CLI::App& sub);
  EngineConfig config(int64_t max_model_len) const;
};

}  // namespace moat::cli
