// Tensor parallelism over MPI: run under `mpirun -np N test_dist` (ctest does, at N = 2 and 4).
// Every rank runs every test in the same order; in each, rank 0 drives the model (forward, the
// engine) and checks the results, while ranks 1.. load their share of the same checkpoint and run
// rank 0's steps in run_tp_worker() until rank 0's model is destroyed. Run alone (one process)
// the tests skip.
//
// Checked: logits at TP N against the PyTorch reference's golden logits (the golden tolerance,
// tests/golden/README.md) and against this build's TP 1 logits, for a full prefill and for decode
// steps over the paged latent cache, on every DeepSeek-layout fixture and both shipped models; the
// engine's greedy tokens at TP N equal TP 1's for batched requests; the shapes TP cannot split
// (fp8 scale blocks cut in half, KDA layers) are refused with the tensor named.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <span>

#include "dist/communicator.h"
#include "engine/engine.h"
#include "loader/safetensors.h"
#include "models/deepseek_v3.h"
#include "models/op_needs.h"
#include "../engine/run_engine.h"
#include "../models/golden_compare.h"
#include "plan/model_size.h"
#include "../engine/wrong_in_turn_proposer.h"

namespace moat {
namespace {

const std::filesystem::path kRoot = MOAT_SOURCE_DIR;

std::shared_ptr<Communicator> world() {
  auto w = mpi_world();
  return w.ok() ? *w : nullptr;
}

bool multi_rank() {
  auto w = world();
  return w && w->size() > 1;
}

using testing::expect_logits_match;
using testing::Golden;
using testing::read_golden;
std::filesystem::path model_dir_for(const std::string& name) { return testing::golden_model_dir(name); }

// As the golden tests: exact activations and an fp32 latent cache, so only the order of the
// partial sums differs from the reference.
DeepseekModel::Options golden_options(std::shared_ptr<Communicator> comm, bool expert_parallel = false) {
  return {.backend = ops::Backend::cpu, .max_context = 256, .exact_activations = true, .kv_dtype = DType::F32,
          .threads = 1, .comm = std::move(comm), .expert_parallel = expert_parallel};
}

// (fixture, expert parallelism)
class TensorParallelGolden : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(TensorParallelGolden, PrefillAndDecodeMatchReferenceAndOneRank) {
  if (!multi_rank()) GTEST_SKIP() << "run under mpirun -np 2 (or more)";
  const auto& [name, ep] = GetParam();
  const auto golden_file = kRoot / "tests/golden" / name / "golden.safetensors";
  if (!std::filesystem::exists(golden_file) || !std::filesystem::exists(model_dir_for(name) / "config.json"))
    GTEST_SKIP() << "no fixture for " << name;  // the same answer on every rank
  auto comm = world();
  auto loaded = DeepseekModel::load(model_dir_for(name), golden_options(comm, ep));
  if (!loaded.ok() && (name == "tiny_k3" || name == "k3_nano_draft") && !ep && comm->size() == 4) {
    // their MXFP4 experts' intermediate width 64 is 16 columns per rank at TP 4, half a scale
    // group: refused (every rank alike), and EP runs it
    EXPECT_NE(loaded.error().message.find("scale groups"), std::string::npos) << loaded.error().message;
    return;
  }
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  DeepseekModel& m = **loaded;
  // KDA state: each rank holds its heads' share
  EXPECT_EQ(m.state_bytes_per_request() * comm->size(), m.config().state_bytes_per_request());
  EXPECT_EQ(m.tp_size(), comm->size());
  EXPECT_EQ(m.heads_per_rank() * comm->size(), m.config().num_attention_heads);
  const auto [first, last] = m.experts_of_rank();
  const int64_t E = m.config().n_routed_experts;
  EXPECT_EQ(last - first, ep ? E / comm->size() : E);
  // `moat plan`'s weights per GPU at this TP degree are what this rank holds (bf16 checkpoints;
  // the replicated tensors whole, the rest split): within the norms' rounding.
  if (m.config().quantization == std::nullopt && m.config().torch_dtype == DType::BF16) {
    auto size = plan::size_from_config(m.config(), name, name);
    ASSERT_TRUE(size.ok()) << size.error().message;
    const int i = static_cast<int>(plan::Precision::bf16);
    const double planned = size->replicated_bytes[i] + (size->weight_bytes[i] - size->replicated_bytes[i]) / comm->size();
    EXPECT_NEAR(static_cast<double>(m.weight_bytes_on_rank()) / planned, 1.0, 0.01)
        << name << ": rank holds " << m.weight_bytes_on_rank() << " B, plan says " << planned;
  }
  // Each rank resolved its ops exactly as `moat doctor --tp N` predicts (OpTable::plan over the same
  // needs): the MLA kernel's heads per rank, zero-padded where the kernel wants 4, 8 or 16k heads
  // (k3-nano's 12 heads: 6 per rank at TP 2 -> 8, 3 at TP 4 -> 4).
  auto needs = model_op_needs(m.config(), comm->size(), DType::F32);
  ASSERT_TRUE(needs.ok()) << needs.error().message;
  const auto predicted = ops::OpTable::plan(ops::Backend::cpu, *needs);
  ASSERT_EQ(predicted.size(), m.ops().resolved().size());
  for (size_t i = 0; i < predicted.size(); ++i) {
    EXPECT_EQ(predicted[i].use, m.ops().resolved()[i].use);
    EXPECT_EQ(predicted[i].resolution.describe(), m.ops().resolved()[i].resolution.describe()) << predicted[i].use;
    if (predicted[i].op == ops::OpId::mla_attention && m.config().num_attention_heads == 12) {
      EXPECT_EQ(predicted[i].resolution.pad_to, comm->size() == 2 ? 8 : comm->size() == 4 ? 4 : predicted[i].resolution.pad_to);
    }
  }
  if (comm->rank() > 0) {
    m.run_tp_worker();
    return;
  }
  const Golden g = read_golden(golden_file);
  const int64_t T = static_cast<int64_t>(g.ids.size()), V = m.config().vocab_size;
  ASSERT_EQ(static_cast<int64_t>(g.logits.size()), T * V);
  auto one = DeepseekModel::load(model_dir_for(name), golden_options(nullptr));
  ASSERT_TRUE(one.ok()) << one.error().message;

  // Full prefill, logits at every position.
  std::vector<float> logits(static_cast<size_t>(T * V)), logits_one(logits.size());
  {
    auto cache = m.new_sequence_cache(T);
    m.forward(cache, g.ids, 0, logits.data(), ForwardBatch::Logits::all);
    auto cache_one = (*one)->new_sequence_cache(T);
    (*one)->forward(cache_one, g.ids, 0, logits_one.data(), ForwardBatch::Logits::all);
  }
  for (int64_t t = 0; t < T; ++t) {
    const std::string where = name + " tp " + std::to_string(comm->size()) + " prefill position " + std::to_string(t);
    expect_logits_match(&logits[t * V], &g.logits[t * V], V, where + " vs reference");
    expect_logits_match(&logits[t * V], &logits_one[t * V], V, where + " vs tp 1");
  }
  // Half the prompt, then one token per step over a cache of 4-row blocks (the absorbed decode path).
  auto cache = m.new_sequence_cache(T, 4);
  const int64_t prefill = T / 2;
  std::vector<float> step(static_cast<size_t>(V));
  const std::span<const int32_t> ids(g.ids);
  m.forward(cache, ids.first(prefill), 0, step.data());
  expect_logits_match(step.data(), &g.logits[(prefill - 1) * V], V, name + " prefill last");
  for (int64_t t = prefill; t < T; ++t) {
    m.forward(cache, ids.subspan(t, 1), static_cast<int32_t>(t), step.data());
    expect_logits_match(step.data(), &g.logits[t * V], V, name + " decode position " + std::to_string(t));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TensorParallelGolden,
                         ::testing::Combine(::testing::Values("tiny_qlora", "tiny_v2lite", "k3_nano", "k3_nano_draft",
                                                              "tiny_kimi_linear", "tiny_k3"),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) + (std::get<1>(info.param) ? "_ep" : "_tp");
                         });

// What TP cannot split is refused at load, on every rank alike, naming the tensor: an fp8 matrix
// whose per-rank rows or columns would cut a 128 x 128 scale block (tiny_fp8's q_b_proj: 12 heads
// x 32 rows = 384, 192 per rank at TP 2).
TEST(TensorParallel, RefusesSplitsItCannotMake) {
  if (!multi_rank()) GTEST_SKIP() << "run under mpirun -np 2 (or more)";
  auto fp8 = DeepseekModel::load(kRoot / "tests/golden/tiny_fp8", golden_options(world()));
  ASSERT_FALSE(fp8.ok());
  EXPECT_NE(fp8.error().message.find("fp8 scale blocks"), std::string::npos) << fp8.error().message;
  EXPECT_NE(fp8.error().message.find("model.layers."), std::string::npos) << fp8.error().message;
}

// Every prompt through one engine on `model` (greedy, max_tokens each), the tokens in prompt order.
// With truth (each prompt's expected output), a proposer guesses it wrong at each position in
// turn (k = 3): some guesses must be accepted and some rejected.
std::vector<std::vector<int32_t>> generate_all(DeepseekModel& model, const EngineConfig& config,
                                               const std::vector<std::vector<int32_t>>& prompts, int64_t max_tokens,
                                               const std::vector<std::vector<int32_t>>* truth = nullptr) {
  auto e = Engine::create(model, config, nullptr);
  EXPECT_TRUE(e.ok()) << e.error().message;
  std::vector<std::vector<int32_t>> out;
  if (!e.ok()) return out;
  std::vector<uint64_t> ids;
  std::map<uint64_t, std::vector<int32_t>> by_id;
  for (size_t i = 0; i < prompts.size(); ++i) {
    ids.push_back(*(*e)->add_request(testing::greedy(prompts[i], max_tokens)));
    if (truth) by_id[ids.back()] = (*truth)[i];
  }
  if (truth)
    (*e)->set_proposer(std::make_unique<testing::WrongInTurnProposer>(by_id, static_cast<int32_t>(model.config().vocab_size)), 3);
  auto done = testing::run_to_completion(**e);
  for (uint64_t id : ids) out.push_back(done[id].tokens);
  if (truth) {
    EXPECT_GT((*e)->stats().accepted_tokens, 0);
    EXPECT_LT((*e)->stats().accepted_tokens, (*e)->stats().draft_tokens);
  }
  return out;
}

// The engine on rank 0 over the shipped model at TP N: requests batched together, with chunked
// prefill (a small token budget per step) and a shared prefix, generate exactly TP 1's greedy tokens.
class TensorParallelEngine : public ::testing::TestWithParam<bool> {};

TEST_P(TensorParallelEngine, GreedyTokensEqualOneRank) {
  if (!multi_rank()) GTEST_SKIP() << "run under mpirun -np 2 (or more)";
  auto comm = world();
  DeepseekModel::Options options{.backend = ops::Backend::cpu, .max_context = 512, .threads = 1, .comm = comm,
                                 .expert_parallel = GetParam()};
  auto loaded = DeepseekModel::load(kRoot / "models/k3-nano", options);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message;
  if (comm->rank() > 0) {
    (*loaded)->run_tp_worker();
    return;
  }
  options.comm = nullptr;
  options.expert_parallel = false;
  auto one = DeepseekModel::load(kRoot / "models/k3-nano", options);
  ASSERT_TRUE(one.ok()) << one.error().message;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> p = {1, 300, 301, 302, 303, 304, 305, 306};  // a shared prefix (prefix cache)
    for (int j = 0; j < 5 + 23 * i; ++j) p.push_back((97 * i + 13 * j + 7) % 4000 + 5);
    prompts.push_back(p);
  }
  EngineConfig c;
  c.max_model_len = 256;
  c.kv_memory_bytes = 16 << 20;
  c.block_size = 16;
  c.max_num_batched_tokens = 64;
  const auto tp = generate_all(**loaded, c, prompts, 24);
  const auto single = generate_all(**one, c, prompts, 24);
  ASSERT_EQ(tp.size(), single.size());
  for (size_t i = 0; i < tp.size(); ++i) {
    EXPECT_EQ(tp[i].size(), 24u) << "request " << i;
    EXPECT_EQ(tp[i], single[i]) << "request " << i << " at tp " << comm->size();
  }
}

// tiny_kimi_linear at TP N and, on rank 0, at TP 1 too. The other ranks serve rank 0's steps
// until it shuts the model down, and get nullopt.
std::optional<std::pair<std::unique_ptr<DeepseekModel>, std::unique_ptr<DeepseekModel>>> hybrid_at_tp_and_one_rank(
    const std::shared_ptr<Communicator>& comm) {
  const auto dir = kRoot / "tests/golden/tiny_kimi_linear";
  DeepseekModel::Options options = golden_options(comm);
  auto tp = DeepseekModel::load(dir, options);
  if (!tp.ok()) {
    ADD_FAILURE() << tp.error().message;
    return std::nullopt;
  }
  if (comm->rank() > 0) {
    (*tp)->run_tp_worker();
    return std::nullopt;
  }
  options.comm = nullptr;
  auto one = DeepseekModel::load(dir, options);
  if (!one.ok()) {
    ADD_FAILURE() << one.error().message;
    return std::nullopt;
  }
  return std::make_pair(std::move(tp).value(), std::move(one).value());
}

// Kimi Linear at TP N: each rank keeps its KDA heads' state in its own mirror of rank 0's state
// pool; batched, chunked requests, and speculation wrong at each position in turn (every rank
// rewinds its share of the state), generate TP 1's greedy tokens.
TEST(TensorParallel, HybridEngineWithSpeculationEqualsOneRank) {
  if (!multi_rank()) GTEST_SKIP() << "run under mpirun -np 2 (or more)";
  auto comm = world();
  auto models = hybrid_at_tp_and_one_rank(comm);
  if (!models) return;  // a worker rank, done serving rank 0's steps (or the load failed)
  auto& [loaded, one] = *models;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 5; ++i) {
    std::vector<int32_t> p;
    for (int j = 0; j < 4 + 11 * i; ++j) p.push_back((37 * i + 11 * j + 5) % 500);
    prompts.push_back(p);
  }
  EngineConfig c;
  c.max_model_len = 128;
  c.kv_memory_bytes = 8 << 20;
  c.block_size = 16;
  c.max_num_batched_tokens = 32;
  const auto single = generate_all(*one, c, prompts, 20);
  const auto tp = generate_all(*loaded, c, prompts, 20);
  const auto tp_speculative = generate_all(*loaded, c, prompts, 20, &single);
  ASSERT_EQ(tp.size(), single.size());
  ASSERT_EQ(tp_speculative.size(), single.size());
  for (size_t i = 0; i < tp.size(); ++i) {
    EXPECT_EQ(tp[i], single[i]) << "request " << i << " at tp " << comm->size();
    EXPECT_EQ(tp_speculative[i], single[i]) << "request " << i << " at tp " << comm->size() << ", speculative";
  }
}

// Hybrid prefix caching at TP N: rank 0's scheduler snapshots and restores states, and every
// worker does the same to its heads' share in a mirror of the snapshot cache (evicting alike: a
// cache of 3 snapshots is far too small for these requests). Repeated and extended prompts take
// hits and still generate TP 1's greedy tokens.
TEST(TensorParallel, HybridPrefixHitsRestoreEveryRanksShareOfTheState) {
  if (!multi_rank()) GTEST_SKIP() << "run under mpirun -np 2 (or more)";
  auto comm = world();
  auto models = hybrid_at_tp_and_one_rank(comm);
  if (!models) return;  // a worker rank, done serving rank 0's steps (or the load failed)
  auto& [loaded, one] = *models;
  std::vector<int32_t> base;
  for (int j = 0; j < 37; ++j) base.push_back((11 * j + 5) % 500);
  std::vector<std::vector<int32_t>> rounds[2];
  for (int i = 0; i < 4; ++i) {
    auto p = base;
    for (int j = 0; j <= i; ++j) p.push_back(100 + 13 * i + j);
    rounds[0].push_back(p);
    rounds[1].push_back(i % 2 ? p : base);  // repeats and the shared prefix alone
  }
  EngineConfig c;
  c.max_model_len = 128;
  c.kv_memory_bytes = 8 << 20;
  c.block_size = 8;
  c.max_num_batched_tokens = 24;
  c.prefix_state_snapshots = 3;
  EngineConfig uncached = c;
  uncached.enable_prefix_caching = false;
  auto e = Engine::create(*loaded, c, nullptr);
  ASSERT_TRUE(e.ok()) << e.error().message;
  int64_t cached = 0;
  for (const auto& prompts : rounds) {
    const auto single = generate_all(*one, uncached, prompts, 12);
    ASSERT_EQ(single.size(), prompts.size());
    std::vector<uint64_t> ids;
    for (const auto& p : prompts) ids.push_back(*(*e)->add_request(testing::greedy(p, 12)));
    auto done = testing::run_to_completion(**e);
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(done[ids[i]].tokens, single[i]) << "request " << i << " at tp " << comm->size();
      cached += done[ids[i]].last.cached_tokens;
    }
  }
  EXPECT_GT(cached, 0);
  EXPECT_GT((*e)->scheduler().state_snapshots().counters().restores, 0);
  EXPECT_GT((*e)->scheduler().state_snapshots().counters().evictions, 0);
}

INSTANTIATE_TEST_SUITE_P(Experts, TensorParallelEngine, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "ep" : "tp"); });

}  // namespace
}  // namespace moat

// Only rank 0 prints gtest's results; every rank's exit status counts (mpirun fails if any fails).
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (moat::launched_by_mpi()) {
    auto w = moat::mpi_world();
    if (!w.ok()) {
      std::fprintf(stderr, "%s\n", w.error().message.c_str());
      return 1;
    }
    if ((*w)->rank() > 0) delete ::testing::UnitTest::GetInstance()->listeners().Release(
        ::testing::UnitTest::GetInstance()->listeners().default_result_printer());
  }
  return RUN_ALL_TESTS();
}
