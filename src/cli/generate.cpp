// moat generate: stream a completion of --prompt from a local checkpoint through the engine core
// (the same scheduler, paged cache and sampler a server uses), then report prefill and decode
// speed on stderr. stdout holds only the prompt and the completion.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <fmt/format.h>

#include "base/log.h"
#include "base/thread_pool.h"
#include "cli/command.h"
#include "cli/model_options.h"
#include "engine/engine.h"
#include "tokenizer/chat_template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moat::cli {
namespace {

struct GenerateArgs {
  ModelOptions model;
  std::string prompt;
  int64_t max_tokens = 64;
  float temperature = 0.7f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;
  int64_t max_context = 4096;
  bool no_bos = false;
  bool ignore_eos = false;
  bool chat = false;
  std::string system;
  std::vector<std::string> stop;
  EngineOptions engine{.max_num_seqs = 1};
};

// The prompt as the model's chat template renders a one-turn conversation (tokenizer_config.json
// "chat_template", rendered like transformers' apply_chat_template with add_generation_prompt).
Result<std::string> render_chat_prompt(const Tokenizer& tokenizer, const std::string& system, const std::string& user) {
  if (tokenizer.chat_template().empty())
    return make_error("--chat: the model's tokenizer_config.json has no chat_template");
  MOAT_ASSIGN_OR_RETURN(ChatTemplate tmpl, ChatTemplate::parse(tokenizer.chat_template()));
  nlohmann::ordered_json context;
  context["messages"] = nlohmann::ordered_json::array();
  if (!system.empty()) context["messages"].push_back({{"role", "system"}, {"content", system}});
  context["messages"].push_back({{"role", "user"}, {"content", user}});
  context["add_generation_prompt"] = true;
  context["bos_token"] = tokenizer.bos_id() ? tokenizer.token_bytes(*tokenizer.bos_id()) : "";
  context["eos_token"] = tokenizer.eos_id() ? tokenizer.token_bytes(*tokenizer.eos_id()) : "";
  return tmpl.render(context);
}

int fail(const std::string& message) {
  fmt::print(stderr, "error: {}\n", message);
  return 1;
}

int run_generate(const GenerateArgs& a) {
  using Clock = std::chrono::steady_clock;
  if (auto ok = a.model.check_dir(); !ok) return fail(ok.error().message);
  auto tokenizer = Tokenizer::load(a.model.dir());
  if (!tokenizer) return fail(tokenizer.error().message);
  auto model = a.model.load(a.max_context);
  if (!model) return fail(model.error().message);
  std::vector<int32_t> prompt;
  if (a.chat) {
    // The template writes BOS itself when the model wants one; special tokens in the rendered
    // text are matched by encode().
    auto text = render_chat_prompt(*tokenizer, a.system, a.prompt);
    if (!text) return fail(text.error().message);
    prompt = tokenizer->encode(*text);
  } else {
    if (!a.no_bos && tokenizer->bos_id()) prompt.push_back(*tokenizer->bos_id());
    const auto body = tokenizer->encode(a.prompt);
    prompt.insert(prompt.end(), body.begin(), body.end());
  }

  auto draft = a.engine.load_draft(a.model, a.max_context);
  if (!draft) return fail(draft.error().message);
  auto engine = Engine::create(**model, a.engine.config(a.max_context, draft->get()), &*tokenizer);
  if (!engine) return fail(engine.error().message);
  GenerateRequest request;
  request.prompt = prompt;
  request.sampling = {.temperature = a.temperature, .top_k = a.top_k, .top_p = a.top_p, .min_p = a.min_p, .seed = a.seed};
  request.stop.max_tokens = a.max_tokens;
  request.stop.ignore_eos = a.ignore_eos;
  if (tokenizer->eos_id()) request.stop.eos_token_ids.push_back(*tokenizer->eos_id());
  for (int64_t id : (*model)->config().eos_token_ids) request.stop.eos_token_ids.push_back(static_cast<int32_t>(id));
  request.stop.stop_strings = a.stop;
  // Refused requests are reported before anything is printed, so stdout only ever holds text.
  auto id = (*engine)->add_request(std::move(request));
  if (!id) return fail(id.error().message);

  if (!a.chat) fmt::print("{}", a.prompt);  // a chat reply stands alone
  std::fflush(stdout);
  const auto start = Clock::now();
  std::optional<Clock::time_point> first_token;
  RequestOutput last;
  while ((*engine)->has_work()) {
    for (RequestOutput& out : (*engine)->step()) {
      if (!first_token && !out.new_tokens.empty()) first_token = Clock::now();
      fmt::print("{}", out.text);
      std::fflush(stdout);
      if (out.finished) last = std::move(out);
    }
  }
  fmt::print("\n");
  std::fflush(stdout);
  const auto end = Clock::now();
  const double prefill_s = std::chrono::duration<double>(first_token.value_or(end) - start).count();
  const double decode_s = std::chrono::duration<double>(end - first_token.value_or(end)).count();
  const int64_t generated = last.output_tokens;
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  fmt::print(stderr,
             "prompt {} tokens, prefill {:.1f} tok/s ({:.3f} s); generated {} tokens ({}), decode {:.2f} tok/s; "
             "{} threads, {} backend, {} KV cache, peak RSS {:.1f} MiB\n",
             last.prompt_tokens, prefill_s > 0 ? last.prompt_tokens / prefill_s : 0.0, prefill_s, generated,
             finish_reason_name(last.finish_reason), generated > 1 && decode_s > 0 ? (generated - 1) / decode_s : 0.0,
             (*model)->thread_pool().num_threads(), ops::backend_name((*model)->ops().backend()),
             dtype_name((*model)->cache_shape().dtype), usage.ru_maxrss / 1024.0);
  if (const Communicator* comm = (*model)->communicator()) {
    const CommStats s = comm->stats();
    fmt::print(stderr, "tp {} ({}{}): rank 0 made {} collectives, {:.2f} MB, {:.3f} s in them ({:.1f}% of the run)\n",
               comm->size(), comm->name(), a.model.ep ? ", experts split by expert" : "", s.calls, s.bytes / 1e6,
               s.seconds, 100.0 * s.seconds / std::max(1e-9, prefill_s + decode_s));
  }
  if (!a.engine.speculative.empty())
    fmt::print(stderr, "speculative {}: {} guessed, {} accepted ({:.1f}%), {:.2f} tokens per verification step\n",
               a.engine.speculative, last.draft_tokens, last.accepted_tokens,
               last.draft_tokens ? 100.0 * last.accepted_tokens / last.draft_tokens : 0.0,
               last.spec_steps ? static_cast<double>(last.accepted_tokens + last.spec_steps) / last.spec_steps : 0.0);
  return 0;
}

void setup(CLI::App& sub, int& exit_code) {
  auto args = std::make_shared<GenerateArgs>();
  args->model.add_to(sub);
  args->engine.add_to(sub);
  sub.add_option("--prompt,-p", args->prompt, "prompt text")->required();
  sub.add_option("--max-tokens,-n", args->max_tokens, "tokens to generate")->check(CLI::NonNegativeNumber);
  sub.add_option("--temperature", args->temperature, "0 = greedy");
  sub.add_option("--top-k", args->top_k, "keep the k most likely tokens (0 = off)");
  sub.add_option("--top-p", args->top_p, "nucleus sampling mass (1 = off)");
  sub.add_option("--min-p", args->min_p, "drop tokens below min_p * max prob (0 = off)");
  sub.add_option("--seed", args->seed, "sampling seed");
  sub.add_option("--max-context", args->max_context, "context length to allocate");
  sub.add_flag("--no-bos", args->no_bos, "do not prepend the BOS token");
  sub.add_flag("--ignore-eos", args->ignore_eos, "keep generating past end-of-sequence");
  sub.add_flag("--chat", args->chat, "wrap the prompt in the model's chat template as a user turn");
  sub.add_option("--system", args->system, "system message for --chat");
  sub.add_option("--stop", args->stop, "stop when the text contains this string (repeatable; not printed)");
  sub.callback([args, &exit_code] { exit_code = run_generate(*args); });
}

CommandRegistrar registrar("generate", "Generate text from a prompt with a local model", setup);

}  // namespace
}  // namespace moat::cli
