// A stand-in OpenAI-compatible server with known timing, to try `moat bench` (and to measure its
// client overhead) without a model server: every request streams max_tokens tokens (16 when the
// request sets none), the first after --first-ms, then one every --gap-ms.
//
//   fake_openai_server [--port 8000] [--first-ms 50] [--gap-ms 10] [--close-after-ms N]
//                      [--tokens-per-word X] [--prompt-overhead N] [--tokenize]
//
// --close-after-ms N behaves like llama-server: it advertises keep-alive, then closes every
// connection after its response, at the latest N ms later and at once when the next request
// arrives on it (that request is never answered). --tokens-per-word X reports usage.prompt_tokens
// as X per word of the prompt plus --prompt-overhead (BOS, chat template); --tokenize also serves
// POST /tokenize with the same count, without the overhead.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "../tests/bench/fake_server.h"

namespace {

constexpr const char* kUsage =
    "usage: fake_openai_server [--port 8000] [--first-ms 50] [--gap-ms 10] [--close-after-ms N]\n"
    "                          [--tokens-per-word X] [--prompt-overhead N] [--tokenize]\n";

// The flag's value as a number, or exits naming the flag.
double number(int argc, char** argv, int& i) {
  if (i + 1 >= argc) {
    std::fprintf(stderr, "fake_openai_server: %s needs a value\n%s", argv[i], kUsage);
    std::exit(2);
  }
  char* end = nullptr;
  double v = std::strtod(argv[i + 1], &end);
  if (*argv[i + 1] == '\0' || *end != '\0' || v < 0) {
    std::fprintf(stderr, "fake_openai_server: %s %s: expected a non-negative number\n", argv[i],
                 argv[i + 1]);
    std::exit(2);
  }
  ++i;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  moat::bench::testing::FakeOptions options;
  options.port = 8000;
  options.first_ms = 50;
  options.gap_ms = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--port") options.port = static_cast<int>(number(argc, argv, i));
    else if (flag == "--first-ms") options.first_ms = static_cast<int>(number(argc, argv, i));
    else if (flag == "--gap-ms") options.gap_ms = static_cast<int>(number(argc, argv, i));
    else if (flag == "--close-after-ms") options.close_after_ms = static_cast<int>(number(argc, argv, i));
    else if (flag == "--tokens-per-word") options.tokens_per_word = number(argc, argv, i);
    else if (flag == "--prompt-overhead") options.prompt_overhead_tokens = static_cast<int>(number(argc, argv, i));
    else if (flag == "--tokenize") options.tokenize_endpoint = true;
    else {
      std::fprintf(stderr, "fake_openai_server: unknown flag %s\n%s", flag.c_str(), kUsage);
      return 2;
    }
  }
  // Block SIGINT/SIGTERM in every thread (the server's inherit the mask) and wait for them here.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  moat::bench::testing::FakeServer server(options);
  if (server.url().find(":-1") != std::string::npos) {
    std::fprintf(stderr, "fake_openai_server: cannot listen on 127.0.0.1:%d\n", options.port);
    return 1;
  }
  std::printf("serving %s (first token after %d ms, then every %d ms", server.url().c_str(),
              options.first_ms, options.gap_ms);
  if (options.close_after_ms >= 0)
    std::printf("; closes each connection after its response, within %d ms", options.close_after_ms);
  if (options.tokens_per_word > 0)
    std::printf("; %.2f prompt tokens per word + %d", options.tokens_per_word,
                options.prompt_overhead_tokens);
  std::printf("); Ctrl-C stops\n");
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  return 0;
}
