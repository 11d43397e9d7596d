// moat serve: the OpenAI-compatible server (src/server/) on the engine, for one local model.
//
// Start-up binds the port first and answers /health with 503 while the model loads, then 200;
// a port that is taken fails at once instead of after a long load. SIGTERM / SIGINT: new
// requests get 503, requests in flight finish (AsyncEngine::shutdown(true)) for up to
// --shutdown-timeout seconds and are aborted after that, the listener closes, exit 0.
#include <signal.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include <fmt/format.h>

#include "base/log.h"
#include "base/thread_pool.h"
#include "cli/command.h"
#include "cli/model_options.h"
#include "config/model_config.h"
#include "engine/async_engine.h"
#include "server/server.h"

namespace moat::cli {
namespace {

struct ServeArgs {
  ModelOptions model;
  EngineOptions engine;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string served_model_name;
  std::string api_key;
  int64_t max_queue = 256;
  int64_t max_context = 0;  // 0: the model's max_position_embeddings
  int http_threads = 0;     // 0: max-num-seqs + max-queue + 32
  int64_t max_body_bytes = 8 << 20;
  double shutdown_timeout_s = 30;
  bool no_access_log = false;
};

int fail(const std::string& message) {
  fmt::print(stderr, "error: {}\n", message);
  return 1;
}

int run_serve(const ServeArgs& a) {
  if (auto ok = a.model.check_dir(); !ok) return fail(ok.error().message);
  const std::string dir = a.model.dir();
  std::filesystem::path normal = std::filesystem::path(dir).lexically_normal();
  if (normal.filename().empty()) normal = normal.parent_path();  // "models/k3-nano/"
  const std::string dir_name = normal.filename().string();
  std::string api_key = a.api_key;
  if (api_key.empty())
    if (const char* env = std::getenv("MOAT_API_KEY")) api_key = env;
  auto config = load_model_config(dir);
  if (!config) return fail(config.error().message);
  const int64_t max_context = a.max_context > 0 ? a.max_context : config->max_position_embeddings;

  // Every thread started from here on inherits this mask, so the signals reach only sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  server::ServerOptions so;
  so.host = a.host;
  so.port = a.port;
  so.served_model_name = a.served_model_name.empty() ? dir_name : a.served_model_name;
  if (so.served_model_name != dir_name) so.model_aliases.push_back(dir_name);
  so.api_key = api_key;
  so.max_body_bytes = static_cast<size_t>(a.max_body_bytes);
  // Every running or waiting request holds a worker for its whole response; the rest serve
  // /health, /metrics and the requests the queue turns away.
  so.http_threads = a.http_threads > 0 ? a.http_threads
                                       : static_cast<int>(std::min<int64_t>(a.engine.max_num_seqs + a.max_queue + 32, 1000));
  so.access_log = !a.no_access_log;
  // Ranks 1.. of `mpirun -np N moat serve --tp N` serve no HTTP: they load their share of the
  // model and run rank 0's steps until it shuts down (load does not return there).
  if (auto rank = a.model.tp_rank(); !rank) {
    return fail(rank.error().message);
  } else if (*rank > 0) {
    auto worker = a.model.load(max_context);
    return fail(worker ? "tensor-parallel worker returned" : worker.error().message);
  }
  server::OpenAIServer http(so);
  if (auto ok = http.bind(); !ok) return fail(ok.error().message);
  std::thread listener([&] { http.serve(); });
  MOAT_LOG(info, "moat serve: listening on http://{}:{} (model `{}` loading; /health is 503 until it is ready)", a.host,
           http.port(), so.served_model_name);

  std::atomic<bool> ready{false}, finished{false};
  std::mutex mu;
  std::condition_variable stop_cv;
  bool stop_requested = false;
  // The first signal starts a graceful shutdown; a second one aborts what is still in flight.
  std::thread signal_waiter([&] {
    const timespec poll{0, 200 * 1000 * 1000};
    int received = 0;
    while (!finished.load()) {
      const int sig = sigtimedwait(&signals, nullptr, &poll);
      if (sig < 0) continue;
      if (!ready.load()) {
        // Nothing is in flight before the model is attached; a load cannot be interrupted midway.
        MOAT_LOG(info, "moat serve: signal {} during load, exiting", sig);
        std::_Exit(0);
      }
      if (++received == 1) {
        MOAT_LOG(info, "moat serve: signal {}, shutting down (finishing requests in flight; again to abort them)", sig);
        std::lock_guard lock(mu);
        stop_requested = true;
        stop_cv.notify_all();
      } else {
        MOAT_LOG(warn, "moat serve: signal {} again, aborting {} responses in flight", sig, http.in_flight());
        http.abort_all();
      }
    }
  });

  auto give_up = [&](const std::string& message) {
    http.stop();
    listener.join();
    finished = true;
    signal_waiter.join();
    return fail(message);
  };
  auto tokenizer = Tokenizer::load(dir);
  if (!tokenizer) return give_up(tokenizer.error().message);
  std::optional<ChatTemplate> chat_template;
  if (!tokenizer->chat_template().empty()) {
    auto parsed = ChatTemplate::parse(tokenizer->chat_template());
    if (!parsed) MOAT_LOG(warn, "chat template does not parse ({}); /v1/chat/completions is refused", parsed.error().message);
    else chat_template = std::move(parsed).value();
  }
  auto model = a.model.load(max_context);
  if (!model) return give_up(model.error().message);
  auto draft = a.engine.load_draft(a.model, max_context);
  if (!draft) return give_up(draft.error().message);
  auto engine = Engine::create(**model, a.engine.config(max_context, draft->get()), &*tokenizer);
  if (!engine) return give_up(engine.error().message);
  AsyncEngine async(std::move(engine).value(), {.max_waiting = a.max_queue});

  server::ServedModel served;
  served.engine = &async;
  served.root = dir;
  served.info.tokenizer = &*tokenizer;
  served.info.chat_template = chat_template ? &*chat_template : nullptr;
  if (tokenizer->eos_id()) served.info.eos_token_ids.push_back(*tokenizer->eos_id());
  for (int64_t id : (*model)->config().eos_token_ids)
    if (std::find(served.info.eos_token_ids.begin(), served.info.eos_token_ids.end(), id) == served.info.eos_token_ids.end())
      served.info.eos_token_ids.push_back(static_cast<int32_t>(id));
  served.info.max_model_len = async.engine().config().max_model_len;
  served.info.vocab_size = (*model)->config().vocab_size;
  const EngineSnapshot snap = async.snapshot();
  http.attach(served);
  ready = true;
  MOAT_LOG(info, "moat serve: ready: model `{}` ({}), context {} tokens, KV cache {} blocks of {} tokens, {} threads, "
           "max {} running + {} waiting requests{}",
           so.served_model_name, dir, served.info.max_model_len, snap.kv_blocks_total, snap.block_size,
           (*model)->thread_pool().num_threads(), a.engine.max_num_seqs, a.max_queue, api_key.empty() ? "" : ", API key required");

  {
    std::unique_lock lock(mu);
    stop_cv.wait(lock, [&] { return stop_requested; });
  }
  http.begin_shutdown();
  // shutdown(true) returns when the last request has finished; past the timeout, in-flight
  // requests are aborted, which lets it return.
  std::thread drainer([&] { async.shutdown(true); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(a.shutdown_timeout_s);
  bool drained = false;
  while (std::chrono::steady_clock::now() < deadline) {
    if (http.wait_idle(std::chrono::milliseconds(100))) {
      drained = true;
      break;
    }
  }
  if (!drained) {
    MOAT_LOG(warn, "moat serve: {} responses still in flight after {} s; aborting them", http.in_flight(),
             a.shutdown_timeout_s);
    http.abort_all();
  }
  drainer.join();
  http.wait_idle(std::chrono::seconds(5));  // the last chunks of finished streams
  http.stop();
  listener.join();
  finished = true;
  signal_waiter.join();
  MOAT_LOG(info, "moat serve: stopped");
  return 0;
}

void setup(CLI::App& sub, int& exit_code) {
  auto args = std::make_shared<ServeArgs>();
  args->model.add_to(sub);
  args->engine.add_to(sub);
  sub.add_option("--host", args->host, "address to bind (default 127.0.0.1: this machine only)");
  sub.add_option("--port", args->port, "port to bind (default 8000; 0: any free port)")->check(CLI::Range(0, 65535));
  sub.add_option("--served-model-name", args->served_model_name,
                 "the model id clients send and /v1/models lists (default: the model directory's name, which is "
                 "always accepted too)");
  sub.add_option("--api-key", args->api_key,
                 "require \"Authorization: Bearer KEY\" on every route but /health and /metrics (default: $MOAT_API_KEY)");
  sub.add_option("--max-queue", args->max_queue, "requests waiting to run beyond which new ones get 429 (default 256)")
      ->check(CLI::NonNegativeNumber);
  sub.add_option("--max-context", args->max_context,
                 "prompt + output tokens per request (default: the model's max_position_embeddings)")
      ->check(CLI::NonNegativeNumber);
  sub.add_option("--http-threads", args->http_threads,
                 "HTTP worker threads: concurrent connections (default: max-num-seqs + max-queue + 32, at most 1000)")
      ->check(CLI::NonNegativeNumber);
  sub.add_option("--max-body-bytes", args->max_body_bytes, "largest request body; larger ones get 413 (default 8 MiB)")
      ->check(CLI::PositiveNumber);
  sub.add_option("--shutdown-timeout", args->shutdown_timeout_s,
                 "seconds in-flight requests may take to finish after SIGTERM before they are aborted (default 30)")
      ->check(CLI::NonNegativeNumber);
  sub.add_flag("--no-access-log", args->no_access_log, "no per-request log line on stderr");
  sub.callback([args, &exit_code] { exit_code = run_serve(*args); });
}

CommandRegistrar registrar("serve", "OpenAI-compatible HTTP server for a local model", setup);

}  // namespace
}  // namespace moat::cli
