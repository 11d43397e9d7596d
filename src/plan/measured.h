// `moat plan --measured`: turns measured throughput into the seeds' cost table. Per setup:
// decode tok/s per stream, peak aggregate tok/s, tok/s per GPU-hour dollar
// (= aggregate / (GPUs x price), DESIGN.md "Benchmark metrics") and $/Mtok.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "base/status.h"

namespace moat::plan {

struct MeasuredSetup {
  std::string hardware;  // label, e.g. "MI355X"
  int64_t gpus = 0;
  double price_per_gpu_hour = 0;
  double per_stream_tps = 0;  // decode tok/s per stream (1 / TPOT)
  double aggregate_tps = 0;   // peak output tok/s
  int64_t peak_concurrency = 0;  // 0 when unknown (numbers from the command line)
};

struct MeasuredRow {
  MeasuredSetup setup;
  double tps_per_gpu_hour_dollar = 0;
  double usd_per_mtok = 0;
};

// Errors name the flag: --gpus, --price-per-gpu-hour, --aggregate-tps, --per-stream-tps.
Result<MeasuredRow> measured_row(const MeasuredSetup& setup);

// Reads a `moat bench` JSON result (an array of records with concurrency, output_tps,
// per_stream_tps, ...). Peak aggregate = the largest output_tps; per-stream = the per_stream_tps
// of the lowest concurrency (the best single-stream decode speed). gpus and price come from the
// caller, or from the records' gpus / price_per_gpu_hour when the caller passes 0.
Result<MeasuredSetup> setup_from_bench_json(const nlohmann::json& records, const std::string& origin,
                                            const std::string& hardware, int64_t gpus, double price);
Result<MeasuredSetup> load_bench_json(const std::filesystem::path& file, const std::string& hardware,
                                      int64_t gpus, double price);

void print_measured(std::FILE* out, const std::vector<MeasuredRow>& rows);
nlohmann::json measured_to_json(const std::vector<MeasuredRow>& rows);

}  // namespace moat::plan
