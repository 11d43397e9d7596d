#include "loader/weight_map.h"

#include <cstring>
#include <filesystem>

#include "base/check.h"

namespace moat {

namespace {

std::string file_of(const TensorInfo& t) {
  return std::filesystem::path(t.file).filename().string();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool is_float_dtype(DType d) { return d == DType::BF16 || d == DType::F16 || d == DType::F32; }

Result<const TensorInfo*> find_with_shape(const Checkpoint& ckpt, const std::string& name,
                                          std::span<const int64_t> shape_span) {
  const std::vector<int64_t> shape(shape_span.begin(), shape_span.end());
  const TensorInfo* t = ckpt.find(name);
  if (!t)
    return make_error("{}: missing from the checkpoint (expected shape {})", name,
                      shape_str(shape));
  if (t->shape != shape)
    return make_error("{}: expected shape {}, got {} (in {})", name, shape_str(shape),
                      shape_str(t->shape), file_of(*t));
  return t;
}

// A tensor that must be present with exactly this dtype and shape; `what` says what it is for.
Result<const TensorInfo*> find_exact(const Checkpoint& ckpt, const std::string& name, DType dtype,
                                     const std::vector<int64_t>& shape, const std::string& what) {
  const TensorInfo* t = ckpt.find(name);
  if (!t) return make_error("{}: missing from the checkpoint ({}: {} {})", name, what, dtype_name(dtype), shape_str(shape));
  if (t->shape != shape)
    return make_error("{}: expected shape {} ({}), got {} (in {})", name, shape_str(shape), what, shape_str(t->shape),
                      file_of(*t));
  if (t->dtype != dtype)
    return make_error("{}: expected dtype {} ({}), got {} (in {})", name, dtype_name(dtype), what,
                      dtype_name(t->dtype), file_of(*t));
  return t;
}

// Refuses scales that decode to NaN or infinity: e8m0 255, or a bf16 with an all-ones exponent.
// One such scale turns its 32 weights, and every output after them, into NaN. rows x groups scales;
// rows_per_expert > 0: the rows are experts' rows one expert after another (gpt-oss).
Status check_group_scales(const TensorInfo& s, GroupScaleKind kind, int64_t rows, int64_t groups,
                          int64_t rows_per_expert = 0) {
  const int64_t n = rows * groups;
  int64_t bad = -1;
  if (kind == GroupScaleKind::e8m0) {
    const void* hit = std::memchr(s.data, 0xff, static_cast<size_t>(n));
    if (hit) bad = static_cast<const std::byte*>(hit) - s.data;
  } else {
    for (int64_t i = 0; i < n && bad < 0; ++i) {
      uint16_t bits;
      std::memcpy(&bits, s.data + 2 * i, 2);
      if ((bits & 0x7f80u) == 0x7f80u) bad = i;
    }
  }
  if (bad < 0) return ok_status();
  const int64_t row = bad / groups;
  const std::string where = rows_per_expert > 0 ? fmt::format("expert {}, row {}", row / rows_per_expert, row % rows_per_expert)
                                                : fmt::format("row {}", row);
  if (kind == GroupScaleKind::e8m0)
    return make_error("{}: the e8m0 scale of {}, group {} is 255 (NaN); every scale must be finite (in {})", s.name,
                      where, bad % groups, file_of(s));
  uint16_t bits;
  std::memcpy(&bits, s.data + 2 * bad, 2);
  return make_error("{}: the bf16 scale of {}, group {} is {}; every scale must be finite (in {})", s.name, where,
                    bad % groups, bf16_to_f32(bits), file_of(s));
}

// X.weight of a compressed-tensors checkpoint stored as X.weight_packed + X.weight_scale
// (+ X.weight_shape): MXFP4 (U8 [out, in/2] codes, U8 [out, in/32] e8m0 scales) or INT4_G32
// (I32 [out, in/8] words holding 8 codes each, low nibble first: the same bytes as [out, in/2];
// BF16 [out, in/32] scales; weight_shape I32/I64 [2] = [out, in], required).
Result<WeightMatrix> packed_matrix(const Checkpoint& ckpt, const std::string& name, int64_t out, int64_t in,
                                   DType dtype) {
  const int64_t group = WeightMatrix::kGroupSize;
  const bool mx = dtype == DType::MXFP4;
  const std::string fmt_name = mx ? "MXFP4" : "INT4";
  if (in % group != 0)
    return make_error("{}: in_features {} is not a multiple of {}, the {} group size (packed as {}_packed)", name, in,
                      group, fmt_name, name);
  const std::string packed_name = name + "_packed", scale_name = name + "_scale", shape_name = name + "_shape";
  // weight_shape records [out, in] for packed formats, where the packed shape alone cannot.
  if (const TensorInfo* sh = ckpt.find(shape_name)) {
    if ((sh->dtype != DType::I32 && sh->dtype != DType::I64) || sh->shape != std::vector<int64_t>{2})
      return make_error("{}: expected an I32 or I64 tensor of shape [2], got {} {} (in {})", shape_name,
                        dtype_name(sh->dtype), shape_str(sh->shape), file_of(*sh));
    int64_t v[2];
    for (int i = 0; i < 2; ++i) {
      if (sh->dtype == DType::I64) {
        std::memcpy(&v[i], sh->data + 8 * i, 8);
      } else {
        int32_t x;
        std::memcpy(&x, sh->data + 4 * i, 4);
        v[i] = x;
      }
    }
    if (v[0] != out || v[1] != in)
      return make_error("{}: says the unpacked weight is [{}, {}], the model expects [{}, {}] for {} (in {})", shape_name,
                        v[0], v[1], out, in, name, file_of(*sh));
  } else if (!mx) {
    return make_error("{}: missing from the checkpoint (pack-quantized INT4 weights record their [out, in] = [{}, {}] "
                      "there)",
                      shape_name, out, in);
  }
  const TensorInfo* p = nullptr;
  if (mx) {
    MOAT_ASSIGN_OR_RETURN(p, find_exact(ckpt, packed_name, DType::U8, {out, in / 2},
                                        fmt::format("MXFP4 codes [out, in/2] of {} [{}, {}]", name, out, in)));
  } else {
    MOAT_ASSIGN_OR_RETURN(p, find_exact(ckpt, packed_name, DType::I32, {out, in / 8},
                                        fmt::format("INT4 codes [out, in/8] of {} [{}, {}]", name, out, in)));
  }
  MOAT_ASSIGN_OR_RETURN(const TensorInfo* s,
                        find_exact(ckpt, scale_name, mx ? DType::U8 : DType::BF16, {out, in / group},
                                   fmt::format("{} scales [out, in/{}] of {} [{}, {}]", mx ? "e8m0" : "bf16", group,
                                               name, out, in)));
  WeightMatrix w = WeightMatrix::packed_4bit(dtype, p->data, s->data, out, in);
  MOAT_TRY(check_group_scales(*s, w.group_scale_kind, out, in / group));
  return w;
}

Result<WeightMatrix> matrix(const Checkpoint& ckpt, const std::string& name, int64_t out,
                            int64_t in, const ModelConfig& config, bool allow_fp8) {
  const int64_t shape[2] = {out, in};
  // compressed-tensors: decided per tensor by what the checkpoint holds (../shared/K3.md: the
  // config's ignore list cannot be trusted).
  if (config.quantization && config.quantization->quant_method == "compressed-tensors") {
    if (const TensorInfo* packed = ckpt.find(name + "_packed")) {
      if (!allow_fp8)
        return make_error("{}_packed: {} must stay BF16, F16 or F32 (embeddings, lm_head, router), but the checkpoint "
                          "holds it packed (in {})",
                          name, name, file_of(*packed));
      if (ckpt.find(name))
        return make_error("{}: present both unpacked and as {}_packed; expected one of them (in {})", name, name,
                          file_of(*packed));
      return packed_matrix(ckpt, name, out, in, config.quantization->weight_dtype);
    }
  } else if (!ckpt.find(name)) {
    if (const TensorInfo* packed = ckpt.find(name + "_packed"))
      return make_error("{}: missing from the checkpoint; {}_packed is there (in {}), but config.json has no "
                        "compressed-tensors quantization_config to say how it is packed",
                        name, name, file_of(*packed));
  }
  MOAT_ASSIGN_OR_RETURN(const TensorInfo* t, find_with_shape(ckpt, name, shape));
  WeightMatrix w;
  w.dtype = t->dtype;
  w.data = t->data;
  w.out_features = out;
  w.in_features = in;
  if (is_float_dtype(t->dtype)) return w;
  if (t->dtype != DType::F8_E4M3 || !allow_fp8)
    return make_error("{}: expected dtype BF16, F16 or F32{}, got {} (in {})", name,
                      allow_fp8 ? " or F8_E4M3 (fp8 checkpoints)" : "", dtype_name(t->dtype),
                      file_of(*t));
  if (!config.quantization)
    return make_error("{}: dtype F8_E4M3, but config.json has no quantization_config (in {})",
                      name, file_of(*t));
  if (config.quantization->quant_method != "fp8")
    return make_error("{}: dtype F8_E4M3, but config.json's quantization_config is {} (in {})", name,
                      config.quantization->quant_method, file_of(*t));
  w.block_out = config.quantization->block_out;
  w.block_in = config.quantization->block_in;
  const std::string scale_name = name + "_scale_inv";
  const std::vector<int64_t> scale_shape = {ceil_div(out, w.block_out), ceil_div(in, w.block_in)};
  const TensorInfo* s = ckpt.find(scale_name);
  if (!s)
    return make_error("{}: missing from the checkpoint (the F8_E4M3 weight {} needs its block "
                      "scales, shape {})",
                      scale_name, name, shape_str(scale_shape));
  if (s->shape != scale_shape)
    return make_error("{}: expected shape {} (blocks of {}x{} over [{}, {}]), got {} (in {})",
                      scale_name, shape_str(scale_shape), w.block_out, w.block_in, out, in,
                      shape_str(s->shape), file_of(*s));
  if (s->dtype != DType::F32)
    return make_error("{}: expected dtype F32, got {} (in {})", scale_name, dtype_name(s->dtype),
                      file_of(*s));
  w.scale_inv = reinterpret_cast<const float*>(s->data);
  return w;
}

Status check_vector(const Checkpoint& ckpt, const std::string& name, std::span<const int64_t> shape) {
  MOAT_ASSIGN_OR_RETURN(const TensorInfo* t, find_with_shape(ckpt, name, shape));
  if (!is_float_dtype(t->dtype))
    return make_error("{}: expected dtype BF16, F16 or F32, got {} (in {})", name,
                      dtype_name(t->dtype), file_of(*t));
  return ok_status();
}

}  // namespace

Result<WeightMatrix> get_matrix(const Checkpoint& ckpt, const std::string& name, int64_t out,
                                int64_t in, const ModelConfig& config, bool allow_fp8) {
  return matrix(ckpt, name, out, in, config, allow_fp8);
}

Result<std::vector<WeightMatrix>> get_gpt_oss_mxfp4_experts(const Checkpoint& ckpt, const std::string& prefix,
                                                             int64_t num_experts, int64_t out, int64_t in) {
  const int64_t group = WeightMatrix::kGroupSize;
  if (in % group != 0)
    return make_error("{}: in_features {} is not a multiple of {}, the MXFP4 group size", prefix, in, group);
  const int64_t groups = in / group;
  MOAT_ASSIGN_OR_RETURN(const TensorInfo* b,
                        find_exact(ckpt, prefix + "_blocks", DType::U8, {num_experts, out, groups, 16},
                                   fmt::format("MXFP4 codes [experts, out, in/32, 16] of {} experts [{}, {}]",
                                               num_experts, out, in)));
  MOAT_ASSIGN_OR_RETURN(const TensorInfo* s,
                        find_exact(ckpt, prefix + "_scales", DType::U8, {num_experts, out, groups},
                                   fmt::format("e8m0 scales [experts, out, in/32] of {} experts [{}, {}]",
                                               num_experts, out, in)));
  MOAT_TRY(check_group_scales(*s, GroupScaleKind::e8m0, num_experts * out, groups, out));
  // One expert's [out, in/32, 16] blocks are its [out, in/2] codes, row after row.
  std::vector<WeightMatrix> experts;
  for (int64_t e = 0; e < num_experts; ++e)
    experts.push_back(WeightMatrix::packed_4bit(DType::MXFP4, b->data + e * out * (in / 2), s->data + e * out * groups,
                                                out, in));
  return experts;
}

Result<std::vector<float>> get_vector_f32(const Checkpoint& ckpt, const std::string& name,
                                          int64_t n) {
  const int64_t shape[1] = {n};
  return get_vector_f32(ckpt, name, shape);
}

Result<std::vector<float>> get_vector_f32(const Checkpoint& ckpt, const std::string& name,
                                          std::span<const int64_t> shape) {
  MOAT_TRY(check_vector(ckpt, name, shape));
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const TensorInfo* t = ckpt.find(name);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    switch (t->dtype) {
      case DType::F32: std::memcpy(&v[i], t->data + 4 * i, 4); break;
      case DType::BF16:
      case DType::F16: {
        uint16_t bits;
        std::memcpy(&bits, t->data + 2 * i, 2);
        v[i] = t->dtype == DType::BF16 ? bf16_to_f32(bits) : f16_to_f32(bits);
        break;
      }
      default: break;  // excluded by check_vector
    }
  }
  return v;
}

Status check_tensor(const Checkpoint& ckpt, const std::string& name, std::span<const int64_t> shape,
                    TensorStorage storage, const ModelConfig& config) {
  if (storage == TensorStorage::vector) return check_vector(ckpt, name, shape);
  MOAT_CHECK(shape.size() == 2, "{}: a matrix spec needs two dimensions, got {}", name, shape.size());
  auto w = matrix(ckpt, name, shape[0], shape[1], config,
                  /*allow_fp8=*/storage == TensorStorage::matrix);
  if (!w.ok()) return w.take_error();
  return ok_status();
}

}  // namespace moat
