// The options every command that runs a local model shares (--model, --backend, --threads,
// --no-mmap), and the one way they turn into a loaded model.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "models/deepseek_v3.h"

namespace moat::cli {

struct ModelOptions {
  std::string model;  // empty: default_model_dir()
  std::string backend = "cpu";
  int threads = 0;    // 0: all cores
  bool no_mmap = false;
  bool exact = false;  // ops::set_exact_activations

  std::string dir() const;
  void add_to(CLI::App& sub);
  // Sizes the thread pool, then loads. Errors name the flag or the file at fault.
  Result<std::unique_ptr<DeepseekModel>> load(int64_t max_context) const;
};

}  // namespace moat::cli
