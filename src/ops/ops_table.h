// docs/ops.md, generated from the registry (`moat doctor --ops-table`): op x backend x kernel x
// constraints x priority, and per backend whether it has been checked on real hardware.
#pragma once

#include <string>

#include "ops/registry.h"

namespace moat::ops {

// Whether a backend's kernels have been run against the reference on real hardware, in words.
// Update the cuda line when tests/ops/cuda_ops_test.cpp has passed on a GPU.
std::string backend_hardware_status(Backend backend);

std::string ops_table_markdown(const Registry& registry);

}  // namespace moat::ops
