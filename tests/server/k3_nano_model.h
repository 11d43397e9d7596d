// The shipped k3-nano loaded for the server tests: model (exact activations, so greedy outputs
// are the same in any batch), tokenizer and parsed chat template.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <optional>

#include "models/deepseek_v3.h"
#include "tokenizer/chat_template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moat::server::testing {

inline const std::filesystem::path kK3NanoDir = std::filesystem::path(MOAT_SOURCE_DIR) / "models/k3-nano";

struct Model {
  std::unique_ptr<DeepseekModel> model;
  Tokenizer tokenizer;
  std::optional<ChatTemplate> tmpl;
};

inline std::unique_ptr<Model> load_k3_nano(int64_t context) {
  auto m = std::make_unique<Model>();
  auto loaded =
      DeepseekModel::load(kK3NanoDir, {.backend = ops::Backend::cpu, .max_context = context, .exact_activations = true});
  EXPECT_TRUE(loaded.ok()) << (loaded.ok() ? "" : loaded.error().message);
  m->model = std::move(loaded).value();
  auto t = Tokenizer::load(kK3NanoDir);
  EXPECT_TRUE(t.ok());
  m->tokenizer = std::move(t).value();
  auto p = ChatTemplate::parse(m->tokenizer.chat_template());
  EXPECT_TRUE(p.ok());
  m->tmpl = std::move(p).value();
  return m;
}

}  // namespace moat::server::testing
