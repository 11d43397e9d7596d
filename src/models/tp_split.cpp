// Whether a weight table splits over tp ranks, decided from the table alone (moat doctor --tp), by
// the same rules DeepseekModel's load applies to the bound tensors.
#include <set>

#include "models/weight_spec.h"

namespace moat {

std::vector<std::string> tp_split_problems(const WeightSpec& spec, int tp, bool expert_parallel) {
  std::vector<std::string> problems;
  if (tp <= 1) return problems;
  const ModelConfig& c = spec.config;
  if (expert_parallel && c.n_routed_experts > 0 && c.n_routed_experts < tp)
    problems.push_back(fmt::format("--ep over {} ranks: the model has only {} routed experts", tp, c.n_routed_experts));
  const bool fp8 = c.quantization && c.quantization->weight_dtype == DType::F8_E4M3;
  const bool four_bit = c.quantization && (c.quantization->weight_dtype == DType::MXFP4 ||
                                           c.quantization->weight_dtype == DType::INT4_G32);
  const int64_t block_out = fp8 ? c.quantization->block_out : 1, block_in = fp8 ? c.quantization->block_in : 1;
  // one report per kind of tensor: every layer's (and expert's) copy fails alike
  std::set<std::pair<Part, Role>> reported;
  for (const TensorSpec& t : spec.tensors) {
    TpSplit split = t.split;
    if (split == TpSplit::expert) {
      if (expert_parallel) continue;
      split = t.role == Role::down_proj ? TpSplit::row : TpSplit::column;
    }
    if (split != TpSplit::column && split != TpSplit::row) continue;
    const bool rows = split == TpSplit::column;
    const int64_t n = rows ? t.shape[0] : t.shape[1], per = n / tp;
    std::string why;
    if (n % (tp * t.split_unit) != 0) {
      why = fmt::format("{} {} do not split into {} equal parts of whole {}-wide units", n, rows ? "rows" : "columns", tp,
                        t.split_unit);
    } else if (t.is_matrix() && fp8 && t.storage == TensorStorage::matrix && per % (rows ? block_out : block_in) != 0) {
      why = fmt::format("{} {} per rank cut through the fp8 scale blocks of {} {}", per, rows ? "rows" : "columns",
                        rows ? block_out : block_in, rows ? "rows" : "columns");
    } else if (t.is_matrix() && four_bit && t.part == Part::routed_expert && !rows &&
               per % WeightMatrix::kGroupSize != 0) {
      why = fmt::format("{} columns per rank cut through the {}-column scale groups of {}", per, WeightMatrix::kGroupSize,
                        dtype_name(c.quantization->weight_dtype));
    }
    if (!why.empty() && reported.insert({t.part, t.role}).second)
      problems.push_back(fmt::format("{} at --tp {}: {}", t.name, tp, why));
  }
  return problems;
}

}  // namespace moat
