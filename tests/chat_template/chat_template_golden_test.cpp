// Renders every golden case in shared/testdata/chat_templates/cases.json (made with Python jinja2
// in transformers' environment) and compares byte for byte.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>

#include "tokenizer/chat_template/chat_template.h"

namespace moat {
namespace {

using json = nlohmann::ordered_json;

const std::string kDir = MOAT_SOURCE_DIR "/../shared/testdata/chat_templates";

bool read_file(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::stringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return true;
}

// The render context the README prescribes: messages, tools (null when absent), documents (null),
// add_generation_prompt, bos_token, eos_token, then every key of extra_context.
json context_for(const json& c) {
  json ctx = json::object();
  ctx["messages"] = c["messages"];
  ctx["tools"] = c.contains("tools") ? c["tools"] : json(nullptr);
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = c["add_generation_prompt"];
  ctx["bos_token"] = c["bos_token"];
  ctx["eos_token"] = c["eos_token"];
  for (const auto& [k, v] : c["extra_context"].items()) ctx[k] = v;
  return ctx;
}

std::string first_difference(const std::string& want, const std::string& got) {
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  size_t from = i > 60 ? i - 60 : 0;
  std::ostringstream os;
  os << "first difference at byte " << i << " (expected " << want.size() << " bytes, got " << got.size()
     << ")\n  expected: ..." << json(want.substr(from, 140)).dump() << "\n  got:      ..."
     << json(got.substr(from, 140)).dump();
  return os.str();
}

TEST(ChatTemplateGolden, AllCasesByteForByte) {
  std::string cases_text;
  if (!read_file(kDir + "/cases.json", &cases_text)) {
    GTEST_SKIP() << "golden data not found at " << kDir << " (shared/testdata is a sibling checkout)";
  }
  json cases = json::parse(cases_text);
  std::map<std::string, ChatTemplate> templates;
  int passed = 0;
  for (const auto& c : cases) {
    std::string name = c["template"].get<std::string>();
    if (!templates.count(name)) {
      std::string source;
      ASSERT_TRUE(read_file(kDir + "/" + name, &source)) << name;
      auto t = ChatTemplate::parse(source);
      ASSERT_TRUE(t.ok()) << name << ": " << t.error().message;
      templates.emplace(name, std::move(t).value());
    }
    std::string label = name + " / " + c["conversation"].get<std::string>() +
                        " / add_generation_prompt=" + c["add_generation_prompt"].dump() +
                        " / extra_context=" + c["extra_context"].dump();
    auto out = templates.at(name).render(context_for(c));
    if (!out.ok()) {
      ADD_FAILURE() << label << ": render failed: " << out.error().message;
      continue;
    }
    std::string want = c["expected"].get<std::string>();
    if (*out == want) {
      ++passed;
    } else {
      ADD_FAILURE() << label << ": " << first_difference(want, *out);
    }
  }
  std::printf("chat template golden cases: %d/%zu passed\n", passed, cases.size());
  EXPECT_EQ(passed, static_cast<int>(cases.size()));
}

// The renders jinja2 cannot do (skipped.json) must fail here too: Kimi-K2-Instruct calls
// list.append, which transformers' immutable sandbox forbids.
TEST(ChatTemplateGolden, SkippedCasesFailLikeTheSandbox) {
  std::string cases_text, skipped_text;
  if (!read_file(kDir + "/cases.json", &cases_text) || !read_file(kDir + "/skipped.json", &skipped_text)) {
    GTEST_SKIP() << "golden data not found at " << kDir;
  }
  json cases = json::parse(cases_text);
  json skipped = json::parse(skipped_text);
  ASSERT_FALSE(skipped.empty());
  for (const auto& s : skipped) {
    // skipped.json names the conversation; take its messages and tools from any rendered case.
    const json* conv = nullptr;
    for (const auto& c : cases) {
      if (c["conversation"] == s["conversation"]) conv = &c;
    }
    ASSERT_NE(conv, nullptr);
    json c = *conv;
    c["add_generation_prompt"] = s["add_generation_prompt"];
    c["extra_context"] = s["extra_context"];
    c["bos_token"] = nullptr;
    c["eos_token"] = nullptr;
    std::string source;
    ASSERT_TRUE(read_file(kDir + "/" + s["template"].get<std::string>(), &source));
    auto t = ChatTemplate::parse(source);
    ASSERT_TRUE(t.ok()) << t.error().message;
    auto out = t->render(context_for(c));
    ASSERT_FALSE(out.ok());
    EXPECT_NE(out.error().message.find("access to attribute 'append' of 'list' object is unsafe"),
              std::string::npos)
        << out.error().message;
  }
}

}  // namespace
}  // namespace moat
