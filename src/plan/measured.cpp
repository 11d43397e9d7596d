#include "plan/measured.h"

#include <cmath>
#include <fstream>

namespace moat::plan {

using nlohmann::json;

Result<MeasuredRow> measured_row(const MeasuredSetup& s) {
  if (s.gpus <= 0) return make_error("--gpus: expected a positive GPU count for {}, got {}", s.hardware, s.gpus);
  if (!(s.price_per_gpu_hour > 0) || !std::isfinite(s.price_per_gpu_hour))
    return make_error("--price-per-gpu-hour: expected a positive USD price for {}, got {}", s.hardware,
                      s.price_per_gpu_hour);
  if (!(s.aggregate_tps > 0) || !std::isfinite(s.aggregate_tps))
    return make_error("--aggregate-tps: expected a positive tok/s for {}, got {}", s.hardware, s.aggregate_tps);
  if (!(s.per_stream_tps >= 0) || !std::isfinite(s.per_stream_tps))
    return make_error("--per-stream-tps: expected a non-negative tok/s for {}, got {}", s.hardware, s.per_stream_tps);
  MeasuredRow r;
  r.setup = s;
  r.tps_per_gpu_hour_dollar = s.aggregate_tps / (s.gpus * s.price_per_gpu_hour);
  r.usd_per_mtok = s.gpus * s.price_per_gpu_hour / 3600 / s.aggregate_tps * 1e6;
  return r;
}

Result<MeasuredSetup> setup_from_bench_json(const json& records, const std::string& origin,
                                            const std::string& hardware, int64_t gpus, double price) {
  if (!records.is_array() || records.empty())
    return make_error("--measured {}: expected a non-empty JSON array of `moat bench` records", origin);
  MeasuredSetup s;
  s.hardware = hardware.empty() ? "measured" : hardware;
  s.gpus = gpus;
  s.price_per_gpu_hour = price;
  int64_t lowest_concurrency = -1;
  for (size_t i = 0; i < records.size(); ++i) {
    const json& r = records[i];
    for (const char* f : {"output_tps", "per_stream_tps"})
      if (!r.is_object() || !r.contains(f) || !r[f].is_number())
        return make_error("--measured {}: record {} has no numeric '{}'", origin, i, f);
    // concurrency 0 (or absent) means unlimited in `moat bench`: rank it above every finite one.
    int64_t c = r.contains("concurrency") && r["concurrency"].is_number_integer() ? r["concurrency"].get<int64_t>() : 0;
    const int64_t rank = c > 0 ? c : INT64_MAX;
    const double out_tps = r["output_tps"].get<double>();
    if (out_tps > s.aggregate_tps) {
      s.aggregate_tps = out_tps;
      s.peak_concurrency = c;
    }
    if (lowest_concurrency < 0 || rank < lowest_concurrency) {
      lowest_concurrency = rank;
      s.per_stream_tps = r["per_stream_tps"].get<double>();
    }
    if (s.gpus == 0 && r.contains("gpus") && r["gpus"].is_number_integer()) s.gpus = r["gpus"].get<int64_t>();
    if (s.price_per_gpu_hour == 0 && r.contains("price_per_gpu_hour") && r["price_per_gpu_hour"].is_number())
      s.price_per_gpu_hour = r["price_per_gpu_hour"].get<double>();
  }
  if (s.gpus == 0) return make_error("--measured {}: the records have no 'gpus'; pass --gpus", origin);
  if (s.price_per_gpu_hour == 0)
    return make_error("--measured {}: the records have no 'price_per_gpu_hour'; pass --price-per-gpu-hour or --hardware",
                      origin);
  return s;
}

Result<MeasuredSetup> load_bench_json(const std::filesystem::path& file, const std::string& hardware, int64_t gpus,
                                      double price) {
  std::ifstream in(file);
  if (!in) return make_error("--measured {}: cannot open", file.string());
  json j = json::parse(in, nullptr, false);
  if (j.is_discarded()) return make_error("--measured {}: not valid JSON", file.string());
  return setup_from_bench_json(j, file.string(), hardware, gpus, price);
}

void print_measured(std::FILE* out, const std::vector<MeasuredRow>& rows) {
  fmt::print(out, "{:<10} {:>5} {:>9} {:>16} {:>18} {:>20} {:>8}\n", "setup", "GPUs", "$/GPU-h",
             "decode tok/s/str", "peak agg tok/s", "tok/s per GPU-h $", "$/Mtok");
  // per_stream_tps 0: not measured (numbers given without --per-stream-tps).
  for (const MeasuredRow& r : rows)
    fmt::print(out, "{:<10} {:>5} {:>9.2f} {:>16} {:>18.1f} {:>15.1f} (~{:.0f}) {:>8.2f}\n", r.setup.hardware,
               r.setup.gpus, r.setup.price_per_gpu_hour,
               r.setup.per_stream_tps > 0 ? fmt::format("{:.1f}", r.setup.per_stream_tps) : "-", r.setup.aggregate_tps,
               r.tps_per_gpu_hour_dollar, r.tps_per_gpu_hour_dollar, r.usd_per_mtok);
  fmt::print(out, "tok/s per GPU-hour dollar = peak aggregate tok/s / (GPUs x $/GPU-h); "
                  "$/Mtok = GPUs x $/GPU-h / 3600 / aggregate tok/s x 1e6\n");
}

json measured_to_json(const std::vector<MeasuredRow>& rows) {
  json arr = json::array();
  for (const MeasuredRow& r : rows) {
    json j;
    j["hardware"] = r.setup.hardware;
    j["gpus"] = r.setup.gpus;
    j["price_per_gpu_hour"] = r.setup.price_per_gpu_hour;
    j["per_stream_tps"] = r.setup.per_stream_tps > 0 ? json(r.setup.per_stream_tps) : json(nullptr);
    j["aggregate_tps"] = r.setup.aggregate_tps;
    j["peak_concurrency"] = r.setup.peak_concurrency > 0 ? json(r.setup.peak_concurrency) : json(nullptr);
    j["tps_per_gpu_hour_dollar"] = r.tps_per_gpu_hour_dollar;
    j["usd_per_mtok"] = r.usd_per_mtok;
    arr.push_back(j);
  }
  return arr;
}

}  // namespace moat::plan
