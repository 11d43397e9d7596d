// A stand-in OpenAI-compatible server with known timing, to try `moat bench` (and to measure its
// client overhead) without a model server: every request streams max_tokens tokens (16 when the
// request sets none), the first after --first-ms, then one every --gap-ms.
//
//   fake_openai_server [--port 8000] [--first-ms 50] [--gap-ms 10]
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "../tests/bench/fake_server.h"

int main(int argc, char** argv) {
  moat::bench::testing::FakeOptions options;
  options.port = 8000;
  options.first_ms = 50;
  options.gap_ms = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--port") options.port = value;
    else if (flag == "--first-ms") options.first_ms = value;
    else if (flag == "--gap-ms") options.gap_ms = value;
    else {
      std::fprintf(stderr, "usage: fake_openai_server [--port 8000] [--first-ms 50] [--gap-ms 10]\n");
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
  std::printf("serving %s (first token after %d ms, then every %d ms); Ctrl-C stops\n", server.url().c_str(),
              options.first_ms, options.gap_ms);
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  return 0;
}
