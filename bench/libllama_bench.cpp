// A llama-bench stand-in over libllama's public C API, for bench/llama_cpp_peer.sh where a llama.cpp
// tree has the library but not the llama-bench tool (the npm copies of llama.cpp ship src/, ggml/ and
// include/ without tools/). Our own code: it reads no llama.cpp source, only calls llama.h.
//
// It measures what llama-bench's pp / tg tests measure, the same way: a fresh context of
// n_depth + n_prompt + n_gen cells per load mode, one warm-up run, then for each repetition the cache
// cleared, n_depth random tokens decoded untimed (llama-bench's -d), and the clock around
// llama_decode + llama_synchronize only.
//   pp: n_prompt tokens (BOS then random ids, BOS only at depth 0) decoded in n_batch-sized calls;
//   tg: n_gen single-token calls after the n_depth cached tokens, each on a random id.
// It prints llama-bench's `-o json` fields that the peer script reads (n_prompt, n_gen, samples_ts,
// n_depth, load_mode, cpu_info, backends, n_batch, n_ubatch, flash_attn, type_k, build_commit).
//
// Built by bench/llama_cpp_peer.sh:
//   g++ -O2 -std=c++17 bench/libllama_bench.cpp -I$LLAMA_CPP_DIR/include -I$LLAMA_CPP_DIR/ggml/include \
//     -L$LLAMA_CPP_DIR/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$LLAMA_CPP_DIR/build/bin
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "llama.h"

namespace {

struct Options {
  std::string model;
  int n_prompt = 512;
  int n_gen = 128;
  int n_depth = 0;  // tokens in the cache before each test (llama-bench -d)
  int reps = 5;
  int threads = 1;
  int n_batch = 2048;
  int n_ubatch = 512;
  std::vector<std::string> load_modes{"mmap"};
  std::vector<std::pair<std::string, std::string>> tensor_bufts;  // -ot REGEX=BUFFER_TYPE
  std::string build = "unknown";
  bool verbose = false;
  bool no_repack = false;  // -nr 1: no extra buffer types (AMX, CPU_REPACK), as llama.cpp's --no-repack
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "libllama_bench: %s\n"
               "usage: libllama_bench -m MODEL.gguf [-p N_PROMPT] [-n N_GEN] [-d N_DEPTH] [-r REPS] [-t THREADS]\n"
               "       [-b N_BATCH] [-ub N_UBATCH] [-lm mmap,none,...] [-ot REGEX=BUFFER_TYPE,...] [-nr 0|1] [-o json]\n"
               "       [--build TEXT] [--verbose 1]\n",
               why);
  std::exit(2);
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, ',');) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

int parse_int(const char* flag, const char* text, int minimum) {
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < minimum) {
    std::string why = std::string(flag) + " needs an integer >= " + std::to_string(minimum) + ", got '" + text + "'";
    usage(why.c_str());
  }
  return static_cast<int>(value);
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + flag).c_str());
    const char* value = argv[++i];
    if (flag == "-m") options.model = value;
    else if (flag == "-p") options.n_prompt = parse_int("-p", value, 0);
    else if (flag == "-n") options.n_gen = parse_int("-n", value, 0);
    else if (flag == "-d") options.n_depth = parse_int("-d", value, 0);
    else if (flag == "-r") options.reps = parse_int("-r", value, 1);
    else if (flag == "-t") options.threads = parse_int("-t", value, 1);
    else if (flag == "-b") options.n_batch = parse_int("-b", value, 1);
    else if (flag == "-ub") options.n_ubatch = parse_int("-ub", value, 1);
    else if (flag == "-lm") options.load_modes = split_commas(value);
    else if (flag == "--build") options.build = value;
    else if (flag == "--verbose") options.verbose = std::string(value) != "0";
    else if (flag == "-nr") options.no_repack = std::string(value) != "0";
    else if (flag == "-ot") {
      for (const std::string& item : split_commas(value)) {
        const size_t eq = item.rfind('=');
        if (eq == std::string::npos) usage("-ot takes REGEX=BUFFER_TYPE items");
        options.tensor_bufts.emplace_back(item.substr(0, eq), item.substr(eq + 1));
      }
    }
    else if (flag == "-o") {
      if (std::string(value) != "json") usage("only -o json is written");
    } else {
      usage(("unknown flag " + flag).c_str());
    }
  }
  if (options.model.empty()) usage("-m is required");
  if (options.n_prompt == 0 && options.n_gen == 0) usage("nothing to measure: -p 0 and -n 0");
  if (options.load_modes.empty()) usage("-lm lists no load mode");
  return options;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void decode_or_die(llama_context* context, std::vector<llama_token>& tokens) {
  const int status = llama_decode(context, llama_batch_get_one(tokens.data(), static_cast<int32_t>(tokens.size())));
  if (status != 0) {
    std::fprintf(stderr, "libllama_bench: llama_decode returned %d\n", status);
    std::exit(1);
  }
}

struct Bench {
  llama_context* context;
  const llama_vocab* vocab;
  const Options& options;
  std::mt19937 random{1234};

  llama_token random_token() {
    return std::uniform_int_distribution<llama_token>(0, llama_vocab_n_tokens(vocab) - 1)(random);
  }

  // n_prompt tokens after `first` cached ones (BOS leads only a prompt from an empty cache)
  void run_prompt(int n_prompt, int first = 0) {
    for (int done = 0; done < n_prompt;) {
      const int n = std::min(options.n_batch, n_prompt - done);
      std::vector<llama_token> tokens(n);
      for (int i = 0; i < n; ++i) {
        tokens[i] = (first + done + i == 0 && llama_vocab_get_add_bos(vocab)) ? llama_vocab_bos(vocab) : random_token();
      }
      decode_or_die(context, tokens);
      done += n;
    }
    llama_synchronize(context);
  }

  void run_gen(int n_gen) {
    std::vector<llama_token> token{options.n_depth == 0 && llama_vocab_get_add_bos(vocab) ? llama_vocab_bos(vocab)
                                                                                          : random_token()};
    for (int i = 0; i < n_gen; ++i) {
      decode_or_die(context, token);
      llama_synchronize(context);
      token[0] = random_token();
    }
  }

  // an empty cache, then the depth's tokens (untimed)
  void clear() {
    llama_memory_clear(llama_get_memory(context), false);
    if (options.n_depth > 0) run_prompt(options.n_depth);
  }

  // tokens per second of each repetition after one warm-up
  std::vector<double> measure(int n_prompt, int n_gen) {
    clear();
    if (n_prompt > 0) run_prompt(n_prompt, options.n_depth);
    else run_gen(1);
    std::vector<double> samples;
    for (int rep = 0; rep < options.reps; ++rep) {
      clear();
      const auto start = std::chrono::steady_clock::now();
      if (n_prompt > 0) run_prompt(n_prompt, options.n_depth);
      else run_gen(n_gen);
      samples.push_back((n_prompt > 0 ? n_prompt : n_gen) / seconds_since(start));
    }
    return samples;
  }
};

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out + "\"";
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse(argc, argv);
  llama_backend_init();
  if (!options.verbose) llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
  // -ot as llama-bench's: weights whose name matches REGEX go to the CPU device's buffer type of
  // that name (CPU, or an extra one: AMX, CPU_REPACK); a NULL-pattern-terminated list
  ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
  std::vector<ggml_backend_buffer_type_t> bufts{ggml_backend_dev_buffer_type(cpu)};
  auto extra_bufts = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
      ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts"));
  for (ggml_backend_buffer_type_t* b = extra_bufts ? extra_bufts(cpu) : nullptr; b && *b; ++b) bufts.push_back(*b);
  std::vector<llama_model_tensor_buft_override> overrides;
  for (const auto& [pattern, name] : options.tensor_bufts) {
    ggml_backend_buffer_type_t found = nullptr;
    for (ggml_backend_buffer_type_t b : bufts)
      if (name == ggml_backend_buft_name(b)) found = b;
    if (found == nullptr) {
      std::string names;
      for (ggml_backend_buffer_type_t b : bufts) names += std::string(" ") + ggml_backend_buft_name(b);
      std::fprintf(stderr, "libllama_bench: -ot: no buffer type %s (this CPU device has:%s)\n", name.c_str(), names.c_str());
      return 2;
    }
    overrides.push_back({pattern.c_str(), found});
  }
  overrides.push_back({nullptr, nullptr});

  const std::string cpu_info = cpu ? ggml_backend_dev_description(cpu) : "?";

  std::vector<std::string> rows;
  for (const std::string& mode_name : options.load_modes) {
    llama_model_params model_params = llama_model_default_params();
    model_params.n_gpu_layers = 0;
    model_params.load_mode = llama_load_mode_from_str(mode_name.c_str());
    if (!options.tensor_bufts.empty()) model_params.tensor_buft_overrides = overrides.data();
    if (options.no_repack) model_params.use_extra_bufts = false;
    llama_model* model = llama_model_load_from_file(options.model.c_str(), model_params);
    if (model == nullptr) {
      std::fprintf(stderr, "libllama_bench: cannot load %s (load mode %s)\n", options.model.c_str(), mode_name.c_str());
      return 1;
    }
    llama_context_params context_params = llama_context_default_params();
    context_params.n_ctx = static_cast<uint32_t>(options.n_depth + options.n_prompt + options.n_gen);
    context_params.n_batch = static_cast<uint32_t>(options.n_batch);
    context_params.n_ubatch = static_cast<uint32_t>(options.n_ubatch);
    context_params.n_threads = options.threads;
    context_params.n_threads_batch = options.threads;
    llama_context* context = llama_init_from_model(model, context_params);
    if (context == nullptr) {
      std::fprintf(stderr, "libllama_bench: cannot create a context for %s\n", options.model.c_str());
      return 1;
    }
    Bench bench{context, llama_model_get_vocab(model), options};
    const auto row = [&](int n_prompt, int n_gen) {
      const std::vector<double> samples = bench.measure(n_prompt, n_gen);
      double sum = 0;
      std::string list;
      for (double s : samples) {
        sum += s;
        list += (list.empty() ? "" : ", ") + std::to_string(s);
      }
      std::fprintf(stderr, "libllama_bench: %s pp%d tg%d: %.2f tok/s\n", mode_name.c_str(), n_prompt, n_gen,
                   sum / samples.size());
      rows.push_back("{\"build_commit\": " + json_string(options.build) + ", \"build_number\": 0, \"cpu_info\": " +
                     json_string(cpu_info) + ", \"backends\": \"CPU\", \"n_threads\": " + std::to_string(options.threads) +
                     ", \"n_batch\": " + std::to_string(options.n_batch) + ", \"n_ubatch\": " + std::to_string(options.n_ubatch) +
                     ", \"flash_attn\": " + std::to_string(static_cast<int>(context_params.flash_attn_type)) +
                     ", \"type_k\": \"f16\", \"load_mode\": " + json_string(mode_name) + ", \"n_prompt\": " +
                     std::to_string(n_prompt) + ", \"n_gen\": " + std::to_string(n_gen) + ", \"n_depth\": " + std::to_string(options.n_depth) + ", \"avg_ts\": " +
                     std::to_string(sum / samples.size()) + ", \"samples_ts\": [" + list + "]}");
    };
    if (options.n_prompt > 0) row(options.n_prompt, 0);
    if (options.n_gen > 0) row(0, options.n_gen);
    llama_free(context);
    llama_model_free(model);
  }
  std::printf("[\n");
  for (size_t i = 0; i < rows.size(); ++i) std::printf("  %s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
  std::printf("]\n");
  llama_backend_free();
  return 0;
}
