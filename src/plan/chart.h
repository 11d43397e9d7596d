// The planner's memory chart: one stacked bar per plan row (per GPU: weights, KV cache at the
// requested context x concurrency, headroom) with that GPU's HBM drawn across it. cairo; the file
// extension picks the format (.png or .svg).
#pragma once

#include <string>
#include <vector>

#include "base/status.h"
#include "plan/planner.h"

namespace moat::plan {

Status draw_memory_chart(const std::string& path, const std::vector<PlanRow>& rows, const std::string& title);

}  // namespace moat::plan
