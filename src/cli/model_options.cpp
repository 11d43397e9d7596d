#include "cli/model_options.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "base/log.h"

#include "cli/command.h"

namespace moat::cli {

std::string ModelOptions::dir() const { return model.empty() ? default_model_dir() : model; }

Status ModelOptions::check_dir() const {
  std::error_code ec;
  const std::string d = dir();
  if (!std::filesystem::exists(d, ec)) return make_error("--model {}: no such directory", d);
  if (!std::filesystem::is_directory(d, ec)) return make_error("--model {}: not a directory", d);
  return ok_status();
}

void ModelOptions::add_to(CLI::App& sub) {
  sub.add_option("--model,-m", model,
                 "model directory (config.json, safetensors, tokenizer); default models/k3-nano");
  sub.add_option("--backend", backend, "cpu | reference");
  sub.add_option("--threads,-t", threads, "threads (default: all cores; under mpirun, the cores over the ranks on this machine)");
  sub.add_flag("--no-mmap", no_mmap,
               "read weights into anonymous memory instead of mapping them (same RSS)");
  sub.add_flag("--exact", exact,
               "fp32-accurate activations in every matmul (default: bf16 in prefill and against fp8 weights, "
               "like GPU engines; exact costs ~1.7x prefill time without AMX, more with it, and ~1.3x fp8 decode time)");
  sub.add_option("--kv-dtype", kv_dtype, "latent KV cache element type: bf16 (default), fp8 (e4m3 + row scale), fp32");
  sub.add_option("--tp", tp,
                 "tensor-parallel degree: run as `mpirun -np N moat ... --tp N` (one rank per process, heads and "
                 "MLP widths split across ranks; rank 0 runs the command)")
      ->check(CLI::Range(1, 1024));
  sub.add_flag("--ep,--enable-expert-parallel", ep,
               "with --tp: split the routed experts by expert across the ranks (each holds whole experts) instead of "
               "splitting every expert's intermediate width");
}

Result<std::shared_ptr<Communicator>> ModelOptions::communicator() const {
  if (tp == 1 && !launched_by_mpi()) return std::shared_ptr<Communicator>();
  MOAT_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> world, mpi_world());
  if (world->size() != tp)
    return make_error("--tp {} but mpirun started {} process{}: run `mpirun -np {} moat ... --tp {}`", tp, world->size(),
                      world->size() == 1 ? "" : "es", tp, tp);
  if (tp == 1) return std::shared_ptr<Communicator>();
  return world;
}

Result<int> ModelOptions::tp_rank() const {
  MOAT_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, communicator());
  return comm ? comm->rank() : 0;
}

Result<std::unique_ptr<DeepseekModel>> ModelOptions::load(int64_t max_context) const {
  MOAT_TRY(check_dir());
  MOAT_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, communicator());
  auto model = load(dir(), max_context, /*mtp=*/false, comm);
  if (!comm) return model;
  // A rank that cannot load ends the job, so the others do not wait for it in their first step.
  if (!model) comm->abort(model.error().message);
  if (comm->rank() > 0) {
    (*model)->run_tp_worker();
    const CommStats s = comm->stats();
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    MOAT_LOG(info, "tp rank {} of {}: peak RSS {:.1f} MiB; {} collectives, {:.2f} MB, {:.3f} s in them", comm->rank(),
             comm->size(), usage.ru_maxrss / 1024.0, s.calls, s.bytes / 1e6, s.seconds);
    model->reset();
    std::exit(0);
  }
  return model;
}

Result<std::unique_ptr<DeepseekModel>> ModelOptions::load(const std::string& model_dir, int64_t max_context, bool mtp,
                                                          std::shared_ptr<Communicator> comm) const {
  MOAT_ASSIGN_OR_RETURN(ops::Backend parsed, ops::parse_backend(backend));
  MOAT_ASSIGN_OR_RETURN(DType kv, parse_kv_dtype(kv_dtype));
  // Ranks on one machine share its cores: by default each takes its share instead of all of them
  // (N ranks x all cores would oversubscribe every core N times).
  int model_threads = threads;
  if (model_threads == 0 && comm && comm->ranks_on_this_node() > 1)
    model_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / comm->ranks_on_this_node());
  return DeepseekModel::load(model_dir, {.backend = parsed,
                                     .max_context = max_context,
                                     .exact_activations = exact,
                                     .weights = no_mmap ? WeightPlacement::memory : WeightPlacement::mmap,
                                     .kv_dtype = kv,
                                     .threads = model_threads,
                                     .mtp = mtp,
                                     .comm = comm,
                                     .expert_parallel = ep && comm != nullptr});
}

void EngineOptions::add_to(CLI::App& sub) {
  sub.add_option("--block-size", block_size, "tokens per KV cache block")->check(CLI::Range(1, 4096));
  sub.add_option("--kv-memory", kv_memory_gib,
                 "latent KV cache size in GiB (default: max-num-seqs full contexts, at most half the free memory)")
      ->check(CLI::NonNegativeNumber);
  sub.add_option("--max-num-seqs", max_num_seqs, "requests running at once")->check(CLI::PositiveNumber);
  sub.add_option("--max-num-batched-tokens", max_num_batched_tokens,
                 "tokens per engine step (prompt chunks + decode tokens)")
      ->check(CLI::PositiveNumber);
  sub.add_flag("--no-prefix-caching", no_prefix_caching, "do not reuse the KV blocks of shared prompt prefixes");
  sub.add_option("--prefix-state-snapshots", prefix_state_snapshots,
                 "hybrid models (KDA layers): recurrent states kept at block boundaries so prefix caching can skip "
                 "a prefix (default: 2 x max-num-seqs, fewer if memory is short; 0: no prefix hits)")
      ->check(CLI::NonNegativeNumber);
  sub.add_option("--speculative", speculative,
                 "speculative decoding: draft:DIR (a draft model with the target's tokenizer, e.g. "
                 "draft:models/k3-nano-draft), ngram (prompt lookup: guesses copied from the context) or mtp (the "
                 "checkpoint's own multi-token-prediction head, DeepSeek-V3)");
  sub.add_option("--num-speculative-tokens", num_speculative_tokens, "tokens guessed per request and step (default 4)")
      ->check(CLI::Range(1, 64));
}

Result<std::unique_ptr<DeepseekModel>> EngineOptions::load_draft(const ModelOptions& target, int64_t max_context) const {
  if (speculative == "mtp") {  // the target checkpoint's own MTP head
    auto head = target.load(target.dir(), max_context, /*mtp=*/true);
    if (!head) return make_error("--speculative mtp: {}", head.error().message);
    return head;
  }
  if (!speculative.starts_with("draft")) return std::unique_ptr<DeepseekModel>();
  if (!speculative.starts_with("draft:") || speculative.size() == 6)
    return make_error("--speculative {}: name the draft model's directory, draft:DIR", speculative);
  const std::string dir = speculative.substr(6);
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return make_error("--speculative draft:{}: no such directory", dir);
  auto draft = target.load(dir, max_context);
  if (!draft) return make_error("--speculative draft:{}: {}", dir, draft.error().message);
  return draft;
}

EngineConfig EngineOptions::config(int64_t max_model_len, DeepseekModel* draft) const {
  EngineConfig c;
  c.block_size = block_size;
  c.kv_memory_bytes = static_cast<int64_t>(kv_memory_gib * 1024.0 * 1024.0 * 1024.0);
  c.max_model_len = max_model_len;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_num_seqs = max_num_seqs;
  c.enable_prefix_caching = !no_prefix_caching;
  c.prefix_state_snapshots = prefix_state_snapshots;
  if (!speculative.empty()) {
    c.speculative.method = speculative.starts_with("draft") ? "draft" : speculative;
    c.speculative.num_tokens = num_speculative_tokens;
    c.speculative.draft_model = draft;
  }
  return c;
}

}  // namespace moat::cli
