#include "config/quantization_config.h"

#include <fmt/format.h>

namespace moat {

namespace {

using nlohmann::json;

// The value at `key` when present and not null.
const json* field(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

Status read_string(const json& obj, const char* key, std::string* out, const std::string& where) {
  const json* v = field(obj, key);
  if (!v) return ok_status();
  if (!v->is_string())
    return make_error("config field '{}{}': expected a string, got {}", where, key, v->dump());
  *out = v->get<std::string>();
  return ok_status();
}

// The weight dtype one config group describes.
Result<DType> group_weight_dtype(const std::string& group, const json& g, const std::string& top_format) {
  const std::string where = fmt::format("quantization_config.config_groups.{}.", group);
  if (!g.is_object()) return make_error("config field '{}': expected an object, got {}", where, g.dump());
  std::string format = top_format;
  MOAT_TRY(read_string(g, "format", &format, where));
  for (const char* act : {"input_activations", "output_activations"})
    if (const json* a = field(g, act))
      return make_error(
          "config field '{}{}': activation quantization is not supported (got {}); moat runs these "
          "checkpoints weight-only (W4A16): expected null",
          where, act, a->dump());
  const json* w = field(g, "weights");
  if (!w || !w->is_object())
    return make_error("config field '{}weights': expected an object describing the weight quantization, got {}",
                      where, w ? w->dump() : "nothing");
  const std::string wh = where + "weights.";
  const json* bits = field(*w, "num_bits");
  if (!bits || !bits->is_number_integer() || bits->get<int64_t>() != 4)
    return make_error("config field '{}num_bits': expected 4 (MXFP4 or INT4), got {}", wh,
                      bits ? bits->dump() : "nothing");
  std::string type = "int", strategy;
  MOAT_TRY(read_string(*w, "type", &type, wh));
  MOAT_TRY(read_string(*w, "strategy", &strategy, wh));
  if (strategy != "group")
    return make_error("config field '{}strategy': expected \"group\" (one scale per 32 elements), got \"{}\"", wh,
                      strategy);
  const json* gs = field(*w, "group_size");
  if (!gs || !gs->is_number_integer() || gs->get<int64_t>() != 32)
    return make_error("config field '{}group_size': expected 32, got {}", wh, gs ? gs->dump() : "nothing");
  if (const json* s = field(*w, "symmetric"); s && !(s->is_boolean() && s->get<bool>()))
    return make_error("config field '{}symmetric': expected true (asymmetric weights carry zero points moat "
                      "does not read), got {}",
                      wh, s->dump());
  if (const json* d = field(*w, "dynamic"); d && !(d->is_boolean() && !d->get<bool>()))
    return make_error("config field '{}dynamic': expected false (weights quantized ahead of time), got {}", wh,
                      d->dump());
  // Activation ordering "group" (and "dynamic") stores a permutation (weight_g_idx) moat does not apply.
  if (const json* a = field(*w, "actorder");
      a && !(a->is_string() && (a->get<std::string>() == "static" || a->get<std::string>() == "weight")))
    return make_error("config field '{}actorder': expected null, \"static\" or \"weight\", got {}", wh, a->dump());
  if (type == "float") {
    if (format != "mxfp4-pack-quantized")
      return make_error("config field '{}format': 4-bit float weights need the format \"mxfp4-pack-quantized\", "
                        "got \"{}\"",
                        where, format);
    return DType::MXFP4;
  }
  if (type == "int") {
    if (format != "pack-quantized")
      return make_error("config field '{}format': 4-bit int weights need the format \"pack-quantized\", got \"{}\"",
                        where, format);
    return DType::INT4_G32;
  }
  return make_error("config field '{}type': expected \"float\" (MXFP4) or \"int\" (INT4), got \"{}\"", wh, type);
}

}  // namespace

Result<QuantizationConfig> parse_compressed_tensors_quantization(const json& j) {
  QuantizationConfig q;
  q.quant_method = "compressed-tensors";
  q.activation_scheme = "none";  // weight-only
  std::string top_format;
  MOAT_TRY(read_string(j, "format", &top_format, "quantization_config."));
  std::string status;
  MOAT_TRY(read_string(j, "quantization_status", &status, "quantization_config."));
  if (!status.empty() && status != "compressed")
    return make_error("config field 'quantization_config.quantization_status': expected \"compressed\" (packed "
                      "weights on disk), got \"{}\"",
                      status);
  const json* groups = field(j, "config_groups");
  if (!groups || !groups->is_object() || groups->empty())
    return make_error("config field 'quantization_config.config_groups': expected a non-empty object of "
                      "quantization schemes, got {}",
                      groups ? groups->dump() : "nothing");
  bool first = true;
  for (auto it = groups->begin(); it != groups->end(); ++it) {
    MOAT_ASSIGN_OR_RETURN(DType d, group_weight_dtype(it.key(), it.value(), top_format));
    if (!first && d != q.weight_dtype)
      return make_error("config field 'quantization_config.config_groups': groups disagree ({} and {}); moat "
                        "supports one 4-bit scheme per checkpoint",
                        dtype_name(q.weight_dtype), dtype_name(d));
    q.weight_dtype = d;
    first = false;
  }
  q.fmt = q.weight_dtype == DType::MXFP4 ? "mxfp4-pack-quantized" : "pack-quantized";
  if (const json* ig = field(j, "ignore")) {
    if (!ig->is_array())
      return make_error("config field 'quantization_config.ignore': expected a list of module names, got {}",
                        ig->dump());
    for (const json& e : *ig) {
      if (!e.is_string())
        return make_error("config field 'quantization_config.ignore': expected strings, got {}", e.dump());
      q.ignore.push_back(e.get<std::string>());
    }
  }
  return q;
}

}  // namespace moat
