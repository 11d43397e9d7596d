// Reading the golden fixtures of tests/golden (tools/make_golden.py) and the comparison the
// golden tests hold moat to (tests/golden/README.md): the argmax identical and max |moat - ref|
// <= 1e-3 x max |ref|. Shared by the golden, Kimi Linear and tensor-parallel tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "loader/safetensors.h"

namespace moat::testing {

inline constexpr double kGoldenRelTolerance = 1e-3;

struct Golden {
  std::vector<int32_t> ids;
  std::vector<float> logits;                     // [T, vocab]
  std::map<int64_t, std::vector<float>> hidden;  // layer -> [T, hidden]
};

inline Golden read_golden(const std::filesystem::path& file) {
  auto st = SafetensorsFile::open(file);
  EXPECT_TRUE(st.ok()) << (st.ok() ? "" : st.error().message);
  Golden g;
  if (!st.ok()) return g;
  for (const TensorInfo& t : (*st)->tensors()) {
    if (t.name == "input_ids") {
      g.ids.assign(reinterpret_cast<const int32_t*>(t.data), reinterpret_cast<const int32_t*>(t.data) + t.numel());
    } else if (t.name == "logits") {
      g.logits.assign(reinterpret_cast<const float*>(t.data), reinterpret_cast<const float*>(t.data) + t.numel());
    } else if (t.name.rfind("hidden.layer", 0) == 0) {
      g.hidden[std::stoll(t.name.substr(12))].assign(reinterpret_cast<const float*>(t.data),
                                                     reinterpret_cast<const float*>(t.data) + t.numel());
    }
  }
  return g;
}

// max |got - ref| / max |ref| over n values
inline double rel_error(const float* got, const float* ref, size_t n) {
  double diff = 0.0, scale = 1e-30;
  for (size_t i = 0; i < n; ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(got[i] - ref[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(ref[i])));
  }
  return diff / scale;
}

inline void expect_logits_match(const float* got, const float* ref, int64_t vocab, const std::string& where) {
  EXPECT_LE(rel_error(got, ref, static_cast<size_t>(vocab)), kGoldenRelTolerance) << where;
  EXPECT_EQ(std::max_element(got, got + vocab) - got, std::max_element(ref, ref + vocab) - ref)
      << where << ": top-1 differs";
}

// The model directory of a fixture: the shipped models' fixtures point at models/.
inline std::filesystem::path golden_model_dir(const std::string& name) {
  const std::filesystem::path root = MOAT_SOURCE_DIR;
  if (name == "k3_nano") return root / "models/k3-nano";
  if (name == "k3_nano_draft") return root / "models/k3-nano-draft";
  return root / "tests/golden" / name;
}

}  // namespace moat::testing
