// moat score: the top-k logits at the last position for given token ids (no BOS added), so other
// implementations can be compared with moat token for token.
#include <algorithm>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <numeric>

#include "base/thread_pool.h"
#include "cli/command.h"
#include "models/deepseek_v3.h"

namespace moat::cli {
namespace {

struct ScoreArgs {
  std::string model;
  std::vector<int32_t> tokens;
  int64_t top = 5;
  bool json = false;
  std::string backend = "cpu";
  int threads = 0;
  bool no_mmap = false;
};

int run_score(const ScoreArgs& a) {
  if (a.threads > 0) set_num_threads(a.threads);
  if (a.tokens.empty()) {
    fmt::print(stderr, "error: --tokens needs at least one id\n");
    return 2;
  }
  auto backend = ops::parse_backend(a.backend);
  if (!backend) {
    fmt::print(stderr, "error: {}\n", backend.error().message);
    return 2;
  }
  const std::string dir = a.model.empty() ? default_model_dir() : a.model;
  const int64_t T = static_cast<int64_t>(a.tokens.size());
  auto model = DeepseekModel::load(dir, {.backend = *backend, .max_context = std::max<int64_t>(T, 16),
                                         .weights = a.no_mmap ? WeightPlacement::memory : WeightPlacement::mmap});
  if (!model) {
    fmt::print(stderr, "error: {}\n", model.error().message);
    return 1;
  }
  DeepseekModel& m = **model;
  const int64_t V = m.config().vocab_size;
  for (int32_t id : a.tokens)
    if (id < 0 || id >= V) {
      fmt::print(stderr, "error: token id {} outside the vocabulary of {}\n", id, V);
      return 2;
    }
  auto cache = m.new_cache(T);
  const ForwardBatch batch = ForwardBatch::for_sequence(a.tokens, 0, cache.get());
  std::vector<float> logits(static_cast<size_t>(V));
  m.forward(batch, logits.data());

  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  const int64_t k = std::clamp<int64_t>(a.top, 1, V);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t x, int32_t y) {
    return logits[x] > logits[y] || (logits[x] == logits[y] && x < y);
  });
  if (a.json) {
    nlohmann::ordered_json out;
    out["tokens"] = a.tokens;
    out["top"] = nlohmann::json::array();
    for (int64_t i = 0; i < k; ++i) out["top"].push_back({{"id", order[i]}, {"logit", logits[order[i]]}});
    fmt::print("{}\n", out.dump());
  } else {
    for (int64_t i = 0; i < k; ++i) fmt::print("{:>8} {:.6f}\n", order[i], logits[order[i]]);
  }
  return 0;
}

void setup(CLI::App& sub, int& exit_code) {
  auto args = std::make_shared<ScoreArgs>();
  sub.add_option("--model,-m", args->model, "model directory; default models/k3-nano");
  sub.add_option("--tokens", args->tokens, "comma-separated token ids, no BOS added")->delimiter(',')->required();
  sub.add_option("--top", args->top, "how many of the highest logits to print");
  sub.add_flag("--json", args->json, "print {\"tokens\": [...], \"top\": [{\"id\", \"logit\"}, ...]}");
  sub.add_option("--backend", args->backend, "cpu | reference");
  sub.add_option("--threads,-t", args->threads, "threads (default: all cores)");
  sub.add_flag("--no-mmap", args->no_mmap,
               "read weights into memory instead of mapping them (same RSS; faster decode where page-cache reads are slow)");
  sub.callback([args, &exit_code] { exit_code = run_score(*args); });
}

CommandRegistrar registrar("score", "Print the top logits at the last position for token ids", setup);

}  // namespace
}  // namespace moat::cli
