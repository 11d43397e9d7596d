// The hot CPU loops must keep their accumulators in vector registers, whatever the optimization
// level: at -O2 GCC 12 did not unroll the small row/token loops of the matmul tiles nor the
// probes' chains, so every vdpbf16ps loaded and stored its accumulator from a stack array (issue
// 12: 2.5-4.5x slower prefill and probes on Zen 5) and every test still passed. This test
// disassembles the binary it runs in (the very code the other tests checked) with objdump and
// fails when, inside a named hot function, a loop that does dot products / FMAs / adds stores a
// zmm register to memory (those loops store no vectors at all when allocated well; a stored
// accumulator is how a spill shows), or such an instruction reads its operand from the stack;
// also when a probe has fewer independent chains than it should, or a decode tile lost its
// prefetches.
//
// MOAT_NO_SPILL_BINARY=path checks another binary or object file instead (e.g. one built at
// another -O level, or an old revision's matmul_avx512bf16.cpp.o to see this test fail);
// MOAT_NO_SPILL_MATCH=text checks the functions whose demangled names contain text instead
// (e.g. "cpu_avx512::mla_span", to look at a kernel before adding it to the list below).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "../../bench/roofline.h"

namespace {

struct Insn {
  uint64_t addr;
  std::string mnemonic, operands;
};

struct Function {
  std::string name;  // demangled
  std::vector<Insn> insns;
};

// objdump -d -C of `path`, split into functions.
std::vector<Function> disassemble(const std::string& path, std::string& error) {
  const std::string cmd = "objdump -d -C -w --no-show-raw-insn '" + path + "' 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  std::vector<Function> out;
  if (!p) {
    error = "cannot run objdump";
    return out;
  }
  static const std::regex header(R"(^[0-9a-f]+ <(.*)>:$)");
  static const std::regex insn(R"(^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$)");
  char buf[8192];
  std::smatch m;
  while (fgets(buf, sizeof buf, p.get())) {
    std::string line(buf);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    if (std::regex_match(line, m, header)) {
      out.push_back({m[1].str(), {}});
    } else if (!out.empty() && std::regex_match(line, m, insn)) {
      out.back().insns.push_back({std::stoull(m[1].str(), nullptr, 16), m[2].str(), m[3].str()});
    }
  }
  if (out.empty()) error = "objdump printed no functions for " + path;
  return out;
}

// The problems found in f: each a line of the disassembly and why. min_in_loop > 0: some loop
// must also hold that many accumulating instructions (a probe's independent chains; GCC merges
// chains that compute the same values into one, which then measures latency, not throughput).
// prefetch: a loop with accumulating instructions must also issue prefetcht0 (the decode tiles;
// GCC once deleted their prefetches, taking an out-of-line helper for free of side effects).
// outer_stores_ok: vector stores count only in loops that hold no other loop (a tile whose k
// loop is clean but which spills one accumulator around its per-block fold: a store and a load
// per 128 columns against ~100 instructions of the k loop's body).
std::vector<std::string> spills(const Function& f, int min_in_loop, bool prefetch, bool ymm, bool outer_stores_ok) {
  static const std::regex accumulate(R"(^(vdpbf16ps|vfn?m(add|sub)\d*[ps][sd]|vaddps)$)");
  static const std::regex stack_operand(R"(\(%(rsp|rbp)\b)");
  static const std::regex zmm_store(R"(^%zmm\d+,.*\()");  // AT&T: source register first
  static const std::regex ymm_store(R"(^%[yz]mm\d+,.*\()");
  static const std::regex branch_target(R"(^([0-9a-f]+)\b)");
  std::vector<std::string> found;
  auto show = [](const Insn& i) {
    char a[32];
    std::snprintf(a, sizeof a, "%llx", static_cast<unsigned long long>(i.addr));
    return std::string(a) + ": " + i.mnemonic + " " + i.operands;
  };
  // Control flow between instructions (direct branches only; an indirect jump ends a path).
  const size_t n = f.insns.size();
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < n; ++i) index[f.insns[i].addr] = i;
  std::vector<std::vector<size_t>> succ(n), pred(n);
  std::smatch m;
  for (size_t i = 0; i < n; ++i) {
    const Insn& in = f.insns[i];
    const bool jump = in.mnemonic[0] == 'j', uncond = in.mnemonic == "jmp";
    if (jump && std::regex_search(in.operands, m, branch_target)) {
      const auto t = index.find(std::stoull(m[1].str(), nullptr, 16));
      if (t != index.end()) succ[i].push_back(t->second);
    }
    if (!uncond && in.mnemonic.rfind("ret", 0) != 0 && in.mnemonic != "ud2" && i + 1 < n) succ[i].push_back(i + 1);
  }
  for (size_t i = 0; i < n; ++i)
    for (size_t j : succ[i]) pred[j].push_back(i);
  // Every instruction reachable from `from` along `edges`, not walking on past `stop` (the loop's
  // head: a path back through it is an enclosing loop's, not this one's).
  auto reach = [&](size_t from, const std::vector<std::vector<size_t>>& edges, size_t stop) {
    std::vector<char> seen(n, 0);
    std::vector<size_t> todo{from};
    seen[from] = 1;
    while (!todo.empty()) {
      const size_t i = todo.back();
      todo.pop_back();
      if (i == stop && i != from) continue;
      for (size_t j : edges[i])
        if (!seen[j]) seen[j] = 1, todo.push_back(j);
    }
    return seen;
  };
  // Each backward branch b -> t that closes a cycle: the loop is every instruction on a path from
  // t to b that does not pass through t again (a backward jump to shared code, e.g. an epilogue,
  // closes none and is no loop).
  int most_in_loop = 0;
  bool prefetches = false;
  std::map<size_t, std::string> bad;  // by instruction, once however many loops hold it
  std::vector<std::pair<size_t, size_t>> loops;  // (target, backward branch)
  for (size_t b = 0; b < n; ++b)
    for (size_t t : succ[b])
      if (t <= b) loops.emplace_back(t, b);
  auto holds_another = [&](size_t t, size_t b) {
    return std::any_of(loops.begin(), loops.end(), [&](const auto& l) {
      return l != std::pair<size_t, size_t>{t, b} && l.first >= t && l.second <= b;
    });
  };
  for (size_t b = 0; b < n; ++b)
    for (size_t t : succ[b]) {
      if (t > b) continue;
      const bool check_stores = !outer_stores_ok || !holds_another(t, b);
      const std::vector<char> from_t = reach(t, succ, n), to_b = reach(b, pred, t);
      int accumulates = 0;
      bool prefetch_here = false;
      std::map<size_t, std::string> here;
      for (size_t i = 0; i < n; ++i) {
        if (!from_t[i] || !to_b[i]) continue;
        const Insn& in = f.insns[i];
        const bool acc = std::regex_match(in.mnemonic, accumulate);
        accumulates += acc;
        prefetch_here |= in.mnemonic == "prefetcht0";
        if (acc && std::regex_search(in.operands, stack_operand))
          here[i] = show(in) + "  (operand on the stack, in the loop closed at " + show(f.insns[b]) + ")";
        else if (check_stores && in.mnemonic.rfind("vmov", 0) == 0 &&
                 std::regex_search(in.operands, ymm ? ymm_store : zmm_store))
          here[i] = show(in) + "  (vector stored in the loop closed at " + show(f.insns[b]) + ")";
      }
      if (accumulates) bad.insert(here.begin(), here.end());
      prefetches |= accumulates && prefetch_here;
      most_in_loop = std::max(most_in_loop, accumulates);
    }
  for (const auto& [i, why] : bad) found.push_back(why);
  if (prefetch && !prefetches) found.push_back("no prefetcht0 in the loops that accumulate");
  if (most_in_loop < min_in_loop)
    found.push_back("at most " + std::to_string(most_in_loop) + " accumulating instructions in a loop, want " +
                    std::to_string(min_in_loop) + " independent chains");
  return found;
}

struct Hot {
  const char* pattern;  // a piece of the demangled name
  int min_functions;    // how many must be found (a renamed or vanished kernel fails loudly)
  int min_in_loop = 0;     // see spills()
  bool prefetch = false;  // see spills()
  bool ymm = false;       // AVX2 code: a stored ymm register is a spill too
  bool outer_stores_ok = false;  // see spills()
};

void check(const std::string& path, const std::vector<Hot>& hot) {
  std::string error;
  const std::vector<Function> fns = disassemble(path, error);
  ASSERT_TRUE(error.empty()) << error;
  std::map<std::string, int> seen;
  int bad = 0;
  for (const Function& f : fns) {
    for (const Hot& h : hot) {
      if (f.name.find(h.pattern) == std::string::npos) continue;
      ++seen[h.pattern];
      const auto problems = spills(f, h.min_in_loop, h.prefetch, h.ymm, h.outer_stores_ok);
      for (const auto& p : problems) ADD_FAILURE() << f.name << "\n  " << p;
      bad += !problems.empty();
    }
  }
  for (const Hot& h : hot)
    EXPECT_GE(seen[h.pattern], h.min_functions) << "hot functions matching '" << h.pattern << "' in " << path;
  EXPECT_EQ(bad, 0) << bad << " hot function(s) failed: see above";
}

}  // namespace

TEST(NoSpill, HotKernelsKeepAccumulatorsInRegisters) {
#ifndef __OPTIMIZE__
  GTEST_SKIP() << "unoptimized build: everything lives on the stack";
#else
  // Out-of-line copies of the roofline probes (inline functions of bench/roofline.h), compiled
  // here with the same flags as bench/: taking their addresses makes the compiler emit them.
  for (const void* probe : {reinterpret_cast<const void*>(&moat::bench::dpbf16_loop),
                            reinterpret_cast<const void*>(&moat::bench::fma_loop),
                            reinterpret_cast<const void*>(&moat::bench::fma_loop_avx2),
                            static_cast<const void*>(moat::bench::kReadPatterns),
                            static_cast<const void*>(moat::bench::kReadPatternsAvx2)})
    asm volatile("" : : "r"(probe));
  // 46 bf16 tiles (4 row counts x 4 token counts x split or not; the wide ones of batched decode:
  // 1-4 rows x 5-6 tokens, 1-3 rows x 7-8), the 14 + 16 fp8 ones, the 24 4-bit ones and the 6 packed
  // outer-product tiles (1..6 tokens x 64 rows: 24 accumulators, the most registers of any).
  std::vector<Hot> hot = {{"cpu_avx512bf16::(anonymous namespace)::tile_bf16<", 46},
                          {"cpu_avx512bf16::(anonymous namespace)::tile_packed<", 6},
                          {"cpu_avx512bf16::(anonymous namespace)::tile_fp8<", 14, 0, true},
                          // fp8 batched decode on x scaled per row block: 1-4 rows x 1-4 tokens
                          {"cpu_avx512bf16::(anonymous namespace)::tile_fp8_wide<", 16, 0, true},
                          // 4-bit decode tiles: int16 activations (1-4 rows x 1-2 tokens) and exact
                          // mode's split (1-4 rows x 1 token), two scale kinds each
                          {"cpu_avx512bf16::(anonymous namespace)::tile_q4_i16<", 16, 0, true},
                          {"cpu_avx512bf16::(anonymous namespace)::tile_q4_split<", 8, 0, true},
                          // the decode-sized bf16 tiles (1-4 tokens: batched decode streams its rows
                          // from memory too) prefetch their rows
                          {"cpu_avx512bf16::(anonymous namespace)::tile_bf16<4, 1, ", 2, 0, true},
                          {"cpu_avx512bf16::(anonymous namespace)::tile_bf16<4, 2, ", 2, 0, true},
                          {"cpu_avx512bf16::(anonymous namespace)::tile_bf16<4, 3, ", 2, 0, true},
                          {"cpu_avx512bf16::(anonymous namespace)::tile_bf16<4, 4, ", 2, 0, true},
                          {"cpu_avx512bf16::(anonymous namespace)::tile_bf16<4, 6, ", 1, 0, true},
                          {"cpu_avx512bf16::(anonymous namespace)::tile_bf16<3, 8, ", 1, 0, true},
                          // AVX2 (matmul_avx2.cpp): the register-decoding tiles (bf16, f16, f32 and
                          // fp8 through F16C: 1-4 rows x 1-2 tokens) prefetch their rows; the packed
                          // 6 x 16 micro-kernels
                          {"cpu_avx2_fma::(anonymous namespace)::tile_direct<", 32, 0, true, true},
                          {"cpu_avx2_fma::(anonymous namespace)::micro_kernel<", 6, 0, false, true},
                          // and their 512-bit twins: 1-12 tokens x 16 or 32 columns (up to 24 accumulators)
                          {"cpu_avx2_fma::(anonymous namespace)::micro_kernel_wide<", 24},
                          // fp8 through F16C and 4-bit int16 tiles on 512-bit vectors
                          // (cpu.matmul_avx512fma), 1-4 rows
                          {"cpu_avx2_fma::(anonymous namespace)::tile_fp8_f16c_wide<", 4, 0, true},
                          {"cpu_avx2_fma::(anonymous namespace)::tile_q4_i16_wide<", 8, 0, true},
                          // MXFP4 and INT4_G32 decode tiles, 1-4 rows: fp32 (exact) and int16 activations
                          {"cpu_avx2_fma::(anonymous namespace)::tile_q4<", 8, 0, true, true},
                          {"cpu_avx2_fma::(anonymous namespace)::tile_q4_i16<", 8, 0, true, true},
                          // fp8 on the exponent route (AMD), 1-4 rows x 1-2 tokens
                          {"cpu_avx2_fma::(anonymous namespace)::tile_fp8_exponent<", 8, 0, true, true},
                          // MLA decode attention on bf16 dot products: the score pass (G = 4 or 8 heads,
                          // D % 32 == 0 or not) and the P . V pass; the loops around their inner ones
                          // store scores and outputs by design
                          {"cpu_avx512bf16::(anonymous namespace)::score_rows<", 4, 32},
                          {"cpu_avx512bf16::(anonymous namespace)::output_chunk<", 2, 16, false, false, true},
                          {"moat::bench::dpbf16_loop", 1, 16},
                          {"moat::bench::fma_loop(", 1, 16},
                          {"moat::bench::fma_loop_avx2(", 1, 12, false, true},
                          {"moat::bench::sum_range<", 2},
                          {"moat::bench::sum_streams<", 3},
                          {"moat::bench::sum_range_avx2<", 2, 0, false, true},
                          {"moat::bench::sum_streams_avx2<", 3, 0, false, true}};
  if (const char* match = std::getenv("MOAT_NO_SPILL_MATCH")) hot = {{match, 1}};
  if (const char* other = std::getenv("MOAT_NO_SPILL_BINARY")) {
    for (Hot& h : hot) h.min_functions = 0;  // a lone object file holds only some of them
    check(other, hot);
    return;
  }
  // resolved here: objdump's own /proc/self/exe is objdump
  check(std::filesystem::read_symlink("/proc/self/exe").string(), hot);
#endif
}

// The KDA kernels (kda_cpu.inc) index their vector accumulators through unroll<N>(lambda): only
// when every lambda call is inlined do the arrays become registers. A helper compiled outside the
// ISA's target region cannot inline the AVX lambdas, and each f(i) became an out-of-line function
// taking its vectors through memory (the AVX2 chunk kernel ran at 9% of the FMA peak, every test
// passing). Their stores of the state in the loop keep them out of the spill check above, so this
// one looks for any such lambda left as a function of its own.
TEST(NoSpill, KdaUnrolledLambdasAreInlined) {
#ifndef __OPTIMIZE__
  GTEST_SKIP() << "unoptimized build: nothing is inlined";
#else
  std::string error;
  const std::vector<Function> fns = disassemble(std::filesystem::read_symlink("/proc/self/exe").string(), error);
  ASSERT_TRUE(error.empty()) << error;
  int kda_functions = 0;
  for (const Function& f : fns) {
    if (f.name.find("kda_avx2::") == std::string::npos && f.name.find("kda_avx512::") == std::string::npos) continue;
    ++kda_functions;
    EXPECT_EQ(f.name.find("::operator()<std::integral_constant<int"), std::string::npos)
        << "an unroll<> lambda was not inlined: " << f.name;
  }
  EXPECT_GT(kda_functions, 0) << "no KDA kernel functions found in the binary";
#endif
}
