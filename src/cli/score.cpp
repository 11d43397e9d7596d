// moat score: the top-k logits at the last position for given token ids (no BOS added), so other
// implementations can be compared with moat token for token.
#include <algorithm>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <numeric>

#include "cli/command.h"
#include "cli/model_options.h"

namespace moat::cli {
namespace {

struct ScoreArgs {
  ModelOptions model;
  std::vector<int32_t> tokens;
  int64_t top = 5;
  bool json = false;
};

int run_score(const ScoreArgs& a) {
  if (a.tokens.empty()) {
    fmt::print(stderr, "error: --tokens needs at least one id\n");
    return 2;
  }
  const int64_t T = static_cast<int64_t>(a.tokens.size());
  auto model = a.model.load(std::max<int64_t>(T, 16));
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
  auto cache = m.new_sequence_cache(T);
  std::vector<float> logits(static_cast<size_t>(V));
  m.forward(cache, a.tokens, 0, logits.data());

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
  args->model.add_to(sub);
  sub.add_option("--tokens", args->tokens, "comma-separated token ids, no BOS added")->delimiter(',')->required();
  sub.add_option("--top", args->top, "how many of the highest logits to print");
  sub.add_flag("--json", args->json, "print {\"tokens\": [...], \"top\": [{\"id\", \"logit\"}, ...]}");
  sub.callback([args, &exit_code] { exit_code = run_score(*args); });
}

CommandRegistrar registrar("score", "Print the top logits at the last position for token ids", setup);

}  // namespace
}  // namespace moat::cli
