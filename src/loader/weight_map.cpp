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

Result<WeightMatrix> matrix(const Checkpoint& ckpt, const std::string& name, int64_t out,
                            int64_t in, const ModelConfig& config, bool allow_fp8) {
  const int64_t shape[2] = {out, in};
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
