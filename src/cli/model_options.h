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
  int tp = 1;  // tensor-parallel degree: mpirun -np tp, one rank per process
  bool ep = false;  // routed experts split by expert across the tp ranks

  std::string dir() const;
  // Under --tp > 1 (mpirun): the MPI world, checked to have tp ranks; null at --tp 1.
  Result<std::shared_ptr<Communicator>> communicator() const;
  // This process's rank: 0 runs the command; ranks 1.. only step the model (load() runs them).
  Result<int> tp_rank() const;
  // The model directory, or an error saying it does not exist or is not a directory.
  Status check_dir() const;
  void add_to(CLI::App& sub);
  // Loads the model (with its own pool of --threads). Errors name the flag or the file at fault.
  // At --tp > 1 each rank loads its share; on ranks 1.. this never returns: they run rank 0's
  // steps (DeepseekModel::run_tp_worker) until rank 0's model is destroyed, then exit 0.
  Result<std::unique_ptr<DeepseekModel>> load(int64_t max_context) const;
  // Another checkpoint with the same settings (a speculative draft, an MTP head), whole on rank 0.
  Result<std::unique_ptr<DeepseekModel>> load(const std::string& dir, int64_t max_context, bool mtp = false,
                                              std::shared_ptr<Communicator> comm = nullptr) const;
};

// The engine's sizing flags (vLLM's names), shared by every command that runs the engine.
struct EngineOptions {
  int32_t block_size = 64;
  double kv_memory_gib = 0;  // 0: room for max_num_seqs full contexts, at most half the free memory
  int32_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 512;
  bool no_prefix_caching = false;
  int32_t prefix_state_snapshots = -1;
  std::string speculative;  // "", "ngram" or "draft:DIR"
  int32_t num_speculative_tokens = 4;

  void add_to(CLI::App& sub);
  // The draft model --speculative draft:DIR names (loaded like the target), or null.
  Result<std::unique_ptr<DeepseekModel>> load_draft(const ModelOptions& target, int64_t max_context) const;
  // draft: load_draft's model, kept alive by the caller as long as the engine.
  EngineConfig config(int64_t max_model_len, DeepseekModel* draft = nullptr) const;
};

}  // namespace moat::cli
