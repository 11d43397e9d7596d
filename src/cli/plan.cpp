// `moat plan`: will a model fit on a GPU type, in which tensor-parallel layout, and what would it
// cost per token. Two modes:
//   moat plan --model NAME|DIR [--context N] [--concurrency N] [--hardware b200,b300] ...
//       capacity and roofline estimates from data/hardware.json and data/models.json;
//   moat plan --measured FILE | --aggregate-tps X --gpus N --price-per-gpu-hour P ...
//       the seeds' cost table from measured throughput (a `moat bench` JSON result).
#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "plan/catalog.h"
#include "plan/chart.h"
#include "plan/measured.h"
#include "plan/planner.h"

namespace moat::cli {
namespace {

struct PlanArgs {
  std::string model, context, precision, kv_dtype = "bf16", hardware, chart, hardware_file, model_file;
  int64_t concurrency = 1;
  int64_t prefix_state_snapshots = 0;
  CLI::Option* prefix_state_snapshots_flag = nullptr;  // count() 0: not given, the engine's default
  std::vector<std::string> prices;
  bool json = false, all = false;
  double headroom = 0.1, efficiency = 0.6;
  // Measured mode; comma-separated lists, one value per setup (or one value for all).
  std::vector<std::string> measured;
  std::string gpus, aggregate_tps, per_stream_tps, price_per_gpu_hour;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  size_t start = 0;
  while (true) {
    size_t end = s.find(',', start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

Result<double> parse_number(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (...) {
  }
  return make_error("{}: expected a number, got '{}'", flag, text);
}

// Token counts accept k/K (x1024) and m/M (x1048576) suffixes, as context lengths are quoted
// ("128k" = 131072, "1M" = 1048576).
Result<int64_t> parse_tokens(const std::string& text) {
  if (text.empty()) return make_error("--context: expected a token count such as 131072, 128k or 1M");
  double scale = 1;
  std::string digits = text;
  const char last = text.back();
  if (last == 'k' || last == 'K') scale = 1024, digits.pop_back();
  if (last == 'm' || last == 'M') scale = 1024 * 1024, digits.pop_back();
  auto v = parse_number("--context", digits);
  if (!v) return make_error("--context: expected a token count such as 131072, 128k or 1M, got '{}'", text);
  const double tokens = *v * scale;
  if (!(tokens >= 1)) return make_error("--context: expected a positive number of tokens, got '{}'", text);
  return static_cast<int64_t>(tokens);
}

// "b200=4.25" -> {"b200", 4.25}.
Result<std::pair<std::string, double>> parse_price(const std::string& text) {
  const size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    return make_error("--price: expected GPU=USD (for example b200=4.25), got '{}'", text);
  MOAT_ASSIGN_OR_RETURN(double usd, parse_number("--price " + text.substr(0, eq), text.substr(eq + 1)));
  if (usd < 0) return make_error("--price {}: expected a non-negative USD price per GPU-hour, got {}", text, usd);
  return std::make_pair(text.substr(0, eq), usd);
}

Result<std::vector<plan::HardwareSpec>> load_hardware(const PlanArgs& a) {
  const auto dir = plan::data_dir(MOAT_SOURCE_DIR);
  MOAT_ASSIGN_OR_RETURN(auto hw, plan::load_hardware_catalog(dir / "hardware.json"));
  if (!a.hardware_file.empty()) {
    auto extra = plan::load_hardware_catalog(a.hardware_file);
    if (!extra) return make_error("--hardware-file: {}", extra.error().message);
    plan::merge_hardware(hw, std::move(extra).value());
  }
  return hw;
}

Status run_estimate(const PlanArgs& a) {
  MOAT_ASSIGN_OR_RETURN(auto all_hw, load_hardware(a));
  MOAT_ASSIGN_OR_RETURN(auto hw, plan::select_hardware(all_hw, a.hardware));
  MOAT_ASSIGN_OR_RETURN(auto models, plan::load_model_catalog(plan::data_dir(MOAT_SOURCE_DIR) / "models.json"));
  if (!a.model_file.empty()) {
    auto extra = plan::load_model_catalog(a.model_file);
    if (!extra) return make_error("--model-file: {}", extra.error().message);
    plan::merge_models(models, std::move(extra).value());
  }
  MOAT_ASSIGN_OR_RETURN(plan::ModelSize model, plan::resolve_model(models, a.model));

  plan::PlanOptions o;
  if (!a.context.empty()) {
    MOAT_ASSIGN_OR_RETURN(o.context, parse_tokens(a.context));
  } else {
    o.context = model.max_context > 0 ? model.max_context : 4096;  // the model's full window
  }
  o.concurrency = a.concurrency;
  if (!a.precision.empty()) {
    MOAT_ASSIGN_OR_RETURN(plan::Precision p, plan::parse_precision(a.precision));
    o.precision = p;
  }
  o.kv_dtype = a.kv_dtype;
  if (a.prefix_state_snapshots_flag->count() > 0) o.prefix_state_snapshots = a.prefix_state_snapshots;
  o.headroom = a.headroom;
  o.efficiency = a.efficiency;
  for (const std::string& p : a.prices) {
    MOAT_ASSIGN_OR_RETURN(auto price, parse_price(p));
    o.prices[price.first] = price.second;
  }
  o.backend = plan::default_plan_backend();
  MOAT_ASSIGN_OR_RETURN(plan::Plan result, plan::make_plan(model, hw, o));
  const auto shown = a.all ? result.rows : plan::smallest_fitting(result.rows);
  if (!a.chart.empty()) {
    const auto title = fmt::format("{} at {}: memory per GPU, context {} x {}", model.name,
                                   plan::precision_name(result.precision), o.context, o.concurrency);
    MOAT_TRY(plan::draw_memory_chart(a.chart, plan::chart_rows(result.rows, hw), title));
  }
  if (a.json) {
    std::printf("%s\n", plan::plan_to_json(shown).dump(2).c_str());
  } else {
    plan::print_plan(stdout, result, shown, a.all);
    if (!a.chart.empty()) std::printf("chart: %s\n", a.chart.c_str());
  }
  return ok_status();
}

// The i-th value of a comma list with n entries: one value serves every setup.
Result<std::string> nth(const std::vector<std::string>& list, size_t i, size_t n, const char* flag) {
  if (list.empty()) return std::string();
  if (list.size() == 1) return list[0];
  if (list.size() != n) return make_error("{}: expected 1 or {} comma-separated values, got {}", flag, n, list.size());
  return list[i];
}

Status run_measured(const PlanArgs& a) {
  const auto hardware = split(a.hardware), gpus = split(a.gpus), agg = split(a.aggregate_tps),
             per_stream = split(a.per_stream_tps), price = split(a.price_per_gpu_hour);
  if (!a.measured.empty() && !agg.empty())
    return make_error("--measured and --aggregate-tps: give a bench JSON file or the numbers, not both");
  const size_t n = a.measured.empty() ? std::max({agg.size(), gpus.size(), hardware.size()}) : a.measured.size();
  if (n == 0) return make_error("--aggregate-tps: expected the measured aggregate tok/s (or --measured FILE)");
  std::vector<plan::HardwareSpec> catalog;
  if (!hardware.empty() || !a.prices.empty()) {
    MOAT_ASSIGN_OR_RETURN(catalog, load_hardware(a));
  }
  std::map<std::string, double> overrides;
  for (const std::string& p : a.prices) {
    MOAT_ASSIGN_OR_RETURN(auto kv, parse_price(p));
    MOAT_TRY(plan::find_hardware(catalog, kv.first));
    overrides[kv.first] = kv.second;
  }
  std::vector<plan::MeasuredRow> rows;
  for (size_t i = 0; i < n; ++i) {
    MOAT_ASSIGN_OR_RETURN(std::string hw_name, nth(hardware, i, n, "--hardware"));
    MOAT_ASSIGN_OR_RETURN(std::string gpus_text, nth(gpus, i, n, "--gpus"));
    MOAT_ASSIGN_OR_RETURN(std::string price_text, nth(price, i, n, "--price-per-gpu-hour"));
    std::string label = hw_name.empty() ? fmt::format("setup {}", i + 1) : hw_name;
    double usd = 0;
    if (!hw_name.empty()) {
      MOAT_ASSIGN_OR_RETURN(plan::HardwareSpec h, plan::find_hardware(catalog, hw_name));
      label = h.name;
      usd = h.price_per_gpu_hour;
      for (const auto& [gpu, v] : overrides)
        if (plan::find_hardware({h}, gpu).ok()) usd = v;
    }
    if (!price_text.empty()) {
      MOAT_ASSIGN_OR_RETURN(usd, parse_number("--price-per-gpu-hour", price_text));
    }
    int64_t gpu_count = 0;
    if (!gpus_text.empty()) {
      MOAT_ASSIGN_OR_RETURN(double g, parse_number("--gpus", gpus_text));
      if (g != static_cast<int64_t>(g) || g <= 0)
        return make_error("--gpus: expected a positive whole number of GPUs, got '{}'", gpus_text);
      gpu_count = static_cast<int64_t>(g);
    }
    plan::MeasuredSetup setup;
    if (!a.measured.empty()) {
      MOAT_ASSIGN_OR_RETURN(setup, plan::load_bench_json(a.measured[i], label, gpu_count, usd));
      if (hw_name.empty() && n == 1) setup.hardware = "measured";
    } else {
      setup.hardware = label;
      setup.gpus = gpu_count;
      setup.price_per_gpu_hour = usd;
      MOAT_ASSIGN_OR_RETURN(std::string agg_text, nth(agg, i, n, "--aggregate-tps"));
      MOAT_ASSIGN_OR_RETURN(std::string ps_text, nth(per_stream, i, n, "--per-stream-tps"));
      if (agg_text.empty()) return make_error("--aggregate-tps: missing for {}", label);
      MOAT_ASSIGN_OR_RETURN(setup.aggregate_tps, parse_number("--aggregate-tps", agg_text));
      if (!ps_text.empty()) {
        MOAT_ASSIGN_OR_RETURN(setup.per_stream_tps, parse_number("--per-stream-tps", ps_text));
      }
    }
    MOAT_ASSIGN_OR_RETURN(plan::MeasuredRow row, plan::measured_row(setup));
    rows.push_back(std::move(row));
  }
  if (a.json) std::printf("%s\n", plan::measured_to_json(rows).dump(2).c_str());
  else plan::print_measured(stdout, rows);
  return ok_status();
}

void setup(CLI::App& sub, int& exit_code) {
  auto args = std::make_shared<PlanArgs>();
  PlanArgs& a = *args;
  sub.add_option("--model", a.model, "Catalog model (kimi-k3, kimi-k2, deepseek-v3) or HF model directory / config.json");
  sub.add_option("--context", a.context, "Tokens per request (128k = 131072, 1M = 1048576); default: the model's maximum");
  sub.add_option("--concurrency", a.concurrency, "Requests resident at once (the decode batch)")->capture_default_str();
  sub.add_option("--precision", a.precision, "Weight storage: bf16, fp8, mxfp4, int4; default: the model's own");
  sub.add_option("--kv-dtype", a.kv_dtype, "KV cache dtype: bf16, fp8, fp32")->capture_default_str();
  sub.add_option("--hardware", a.hardware, "Comma-separated GPUs (h100,h200,b200,b300,mi300x,mi325x,mi355x); default: all");
  sub.add_option("--price", a.prices, "Override a GPU's price: GPU=USD per GPU-hour (repeatable)");
  sub.add_flag("--json", a.json, "Print one JSON array of rows");
  sub.add_flag("--all", a.all, "Show every TP layout, not only the smallest that fits");
  sub.add_option("--chart", a.chart, "Write a memory chart (.png or .svg)");
  sub.add_option("--hardware-file", a.hardware_file, "Extra GPUs (same schema as data/hardware.json)");
  sub.add_option("--model-file", a.model_file, "Extra models (same schema as data/models.json)");
  a.prefix_state_snapshots_flag = sub.add_option("--prefix-state-snapshots", a.prefix_state_snapshots,
                 "Hybrid models: prefix-cache state snapshots per GPU, as the engine's flag; default: the engine's "
                 "(2 x concurrency, at most a quarter of the memory left after the KV cache)");
  sub.add_option("--headroom", a.headroom, "Fraction of HBM kept for activations and runtime")->capture_default_str();
  sub.add_option("--efficiency", a.efficiency, "Fraction of HBM bandwidth decode achieves")->capture_default_str();
  sub.add_option("--measured", a.measured, "`moat bench` JSON result(s): print the measured cost table");
  sub.add_option("--gpus", a.gpus, "Measured mode: GPUs per setup (comma-separated)");
  sub.add_option("--aggregate-tps", a.aggregate_tps, "Measured mode: peak aggregate output tok/s (comma-separated)");
  sub.add_option("--per-stream-tps", a.per_stream_tps, "Measured mode: decode tok/s per stream (comma-separated)");
  sub.add_option("--price-per-gpu-hour", a.price_per_gpu_hour, "Measured mode: USD per GPU-hour (comma-separated)");
  sub.callback([args, &exit_code] {
    const PlanArgs& a = *args;
    const bool measured = !a.measured.empty() || !a.aggregate_tps.empty();
    Status s = measured ? run_measured(a)
               : a.model.empty() ? Status(make_error("--model: required (a catalog name or an HF model directory), or use --measured"))
                                 : run_estimate(a);
    if (!s.ok()) {
      std::fprintf(stderr, "moat plan: %s\n", s.error().message.c_str());
      exit_code = 2;
    }
  });
}

CommandRegistrar reg("plan", "Will the model fit, and at what cost (capacity, roofline and $/Mtok)", setup);

}  // namespace
}  // namespace moat::cli
