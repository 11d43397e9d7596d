// Load-time dispatch: every op a model will run is resolved once, before the first request, into
// an OpTable of function pointers. Model, sampling and speculative code call ops only through it.
#pragma once

#include <array>
#include <chrono>
#include <initializer_list>
#include <vector>

#include "base/check.h"
#include "base/status.h"
#include "ops/kernel_types.h"
#include "ops/registry.h"

namespace moat::ops {

// What a loaded model needs from the backend, at its tensor-parallel degree.
struct ModelOpNeeds {
  std::vector<DType> matmul_dtypes;  // every weight dtype the model's linear layers use
  DType embedding_dtype = DType::BF16;
  int64_t heads_per_rank = 0;        // num_attention_heads / tp
  int64_t attention_head_dim = 0;    // kv_lora_rank + qk_rope_head_dim
  DType kv_dtype = DType::BF16;      // the paged latent cache's element type (--kv-dtype)
  int64_t num_experts = 0;           // 0 for dense models
  int64_t top_k = 0;
  DType expert_dtype = DType::BF16;  // the routed experts' weights (moe_experts)
  // Hybrid models with Kimi Delta Attention layers (Kimi Linear, Kimi K3): KDA heads on this rank
  // and their head dim (K = V). 0: no KDA layers, and the five KDA ops are not resolved.
  int64_t kda_heads_per_rank = 0;
  int64_t kda_head_dim = 0;
  // Kimi K3: situ_mul, sigmoid_mul and attn_res_mix are resolved (and shown by `moat doctor`)
  // only when set.
  bool k3_ops = false;
};

struct ResolvedOp {
  OpId op;
  std::string use;  // "matmul[BF16]", "mla_attention", ...
  OpShape shape;
  Resolution resolution;
};

// Where a forward's time goes, by kind of op, with the weight bytes each kind streamed, so a
// matmul's bandwidth inside the model can be set against the machine's probe (model_bench
// --profile). Filled only while attached to an OpTable (set_profile); detached, each op pays one
// null-pointer test. Times are wall time on the calling thread, pool work included.
struct OpProfile {
  enum Kind { matmul, routed_experts, head_matmul, attention, kda, kNumKinds };
  static constexpr std::array<const char*, kNumKinds> kNames = {"matmul", "routed experts", "per-head matmul",
                                                                "MLA attention", "KDA"};
  struct Bucket {
    double seconds = 0, weight_bytes = 0;
    int64_t calls = 0;
  };
  std::array<Bucket, kNumKinds> buckets{};
  double seconds() const {
    double s = 0;
    for (const Bucket& b : buckets) s += b.seconds;
    return s;
  }
};

// Adds the enclosing op's wall time (and weight bytes) to a profile, when there is one.
class OpProfileScope {
 public:
  OpProfileScope(OpProfile* profile, OpProfile::Kind kind, double weight_bytes = 0)
      : profile_(profile), kind_(kind), weight_bytes_(weight_bytes) {
    if (profile_) start_ = std::chrono::steady_clock::now();
  }
  ~OpProfileScope() {
    if (!profile_) return;
    OpProfile::Bucket& b = profile_->buckets[kind_];
    b.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    b.weight_bytes += weight_bytes_;
    ++b.calls;
  }
  OpProfileScope(const OpProfileScope&) = delete;
  OpProfileScope& operator=(const OpProfileScope&) = delete;

 private:
  OpProfile* profile_;
  OpProfile::Kind kind_;
  double weight_bytes_;
  std::chrono::steady_clock::time_point start_;
};

// The bytes of the distinct routed experts a moe_experts call reads (each streams once per call).
double routed_expert_bytes(const MoeExpertsArgs& args);

// One weight of an OpTable::matmul_group and where its product goes.
struct MatmulOut {
  const WeightMatrix* w;
  float* y;
};

class OpTable {
 public:
  // Resolves every op (including every sampling op). Fails, naming each unsupported op, backend,
  // shape and reason, when any op cannot run.
  static Result<OpTable> resolve(Backend backend, const ModelOpNeeds& needs);
  // The same resolution without failing, for `moat doctor`.
  static std::vector<ResolvedOp> plan(Backend backend, const ModelOpNeeds& needs);

  Backend backend() const { return backend_; }
  const std::vector<ResolvedOp>& resolved() const { return resolved_; }

  void embedding(const WeightMatrix& table, const int32_t* ids, int64_t T, float* out) const {
    embedding_(table, ids, T, out);
  }
  void matmul(const float* x, int64_t T, const WeightMatrix& w, float* y) const {
    MatmulFn fn = matmul_[static_cast<int>(w.dtype)];
    MOAT_CHECK(fn != nullptr, "matmul for {} was not resolved at load time", dtype_name(w.dtype));
    OpProfileScope scope(profile_, OpProfile::matmul, profile_ ? static_cast<double>(w.bytes()) : 0);
    fn(x, T, w, y, precision_);
  }
  // y_i = x . W_i^T for weights that read one x (MatmulGroupFn): one call to the resolved kernel's
  // group entry when they share a dtype and it has one (one pool dispatch), else a matmul each.
  // Results are the same either way. At most kMaxMatmulGroup weights.
  void matmul_group(const float* x, int64_t T, const MatmulOut* outs, int64_t count) const;
  void matmul_group(const float* x, int64_t T, std::initializer_list<MatmulOut> outs) const {
    matmul_group(x, T, outs.begin(), static_cast<int64_t>(outs.size()));
  }
  // Attaches a profile every op of this table adds to (nullptr: none). Not thread-safe: one
  // forward at a time, as a model runs them.
  void set_profile(OpProfile* profile) { profile_ = profile; }
  // Default: activations rounded to bf16 for the bf16 dot products (W16A16, W8A16, W4A16), as
  // llama.cpp and GPU engines run. Exact: fp32-accurate everywhere (hi + lo split), what the golden
  // tests hold to 1e-3 against the reference; ~2x the prefill time, ~1.05x bf16 and ~1.3x fp8 decode.
  void set_exact_activations(bool exact) {
    precision_ = exact ? MatmulPrecision::exact() : MatmulPrecision{};
    exact_attention_ = exact;
  }
  const MatmulPrecision& matmul_precision() const { return precision_; }
  void rms_norm(const float* x, const float* w, int64_t T, int64_t dim, float eps, float* y) const {
    rms_norm_(x, w, T, dim, eps, y);
  }
  void rope(const RopeArgs& args) const { rope_(args); }
  void silu_mul(const float* gate, const float* up, int64_t T, int64_t n, float* y) const {
    silu_mul_(gate, up, T, n, y);
  }
  void add_scaled(float* y, const float* x, float alpha, int64_t n) const { add_scaled_(y, x, alpha, n); }
  void store_latent(const StoreLatentArgs& args) const {
    OpProfileScope scope(profile_, OpProfile::attention);
    store_latent_(args);
  }
  // Zero-pads heads to the kernel's supported count when the resolution says PadHeads.
  void mla_attention(const MlaAttentionArgs& args) const;
  void moe_route(const MoeRouteArgs& args) const { moe_route_(args); }
  void moe_experts(const MoeExpertsArgs& args) const {
    MOAT_CHECK(moe_experts_ != nullptr, "moe_experts was not resolved at load time");
    MOAT_CHECK(args.activation != GatedActivation::situ || situ_mul_ != nullptr,
               "moe_experts with the SiTU activation needs situ_mul, resolved only with ModelOpNeeds::k3_ops");
    OpProfileScope scope(profile_, OpProfile::routed_experts, profile_ ? routed_expert_bytes(args) : 0);
    moe_experts_(args, inner_ops());
  }
  // Resolved per weight dtype, like matmul (heads' weights are the absorbed copies' dtype).
  void head_matmul(const HeadMatmulArgs& args) const {
    const DType d = args.num_heads > 0 ? args.weights[0].dtype : DType::F32;
    HeadMatmulFn fn = head_matmul_[static_cast<int>(d)];
    MOAT_CHECK(fn != nullptr, "head_matmul for {} was not resolved at load time", dtype_name(d));
    OpProfileScope scope(profile_, OpProfile::head_matmul,
                         profile_ && args.num_heads > 0 ? static_cast<double>(args.num_heads * args.weights[0].bytes()) : 0);
    fn(args, inner_ops());
  }
  // The KDA layer's ops (kernel_types.h), resolved only for models with KDA layers.
  void short_conv(const ShortConvArgs& args) const {
    MOAT_CHECK(short_conv_ != nullptr, "short_conv was not resolved at load time (a model without KDA layers)");
    OpProfileScope scope(profile_, OpProfile::kda);
    short_conv_(args);
  }
  void kda_gate(const KdaGateArgs& args) const {
    MOAT_CHECK(kda_gate_ != nullptr, "kda_gate was not resolved at load time (a model without KDA layers)");
    OpProfileScope scope(profile_, OpProfile::kda);
    kda_gate_(args);
  }
  // Decode: one step per token.
  void kda_recurrent(const KdaArgs& args) const {
    MOAT_CHECK(kda_recurrent_ != nullptr, "kda_recurrent was not resolved at load time (a model without KDA layers)");
    OpProfileScope scope(profile_, OpProfile::kda);
    kda_recurrent_(args);
  }
  // Prefill: the same result in chunks of tokens.
  void kda_chunked(const KdaArgs& args) const {
    MOAT_CHECK(kda_chunked_ != nullptr, "kda_chunked was not resolved at load time (a model without KDA layers)");
    OpProfileScope scope(profile_, OpProfile::kda);
    kda_chunked_(args);
  }
  void gated_rms_norm(const GatedRmsNormArgs& args) const {
    MOAT_CHECK(gated_rms_norm_ != nullptr, "gated_rms_norm was not resolved at load time (a model without KDA layers)");
    OpProfileScope scope(profile_, OpProfile::kda);
    gated_rms_norm_(args);
  }
  // What composite ops run inside (kernel_types.h InnerOps): this table's own kernels.
  InnerOps inner_ops() const { return {matmul_.data(), precision_, silu_mul_, add_scaled_, situ_mul_}; }
  void softmax(const float* x, int64_t T, int64_t n, float temperature, float* probs) const {
    softmax_(x, T, n, temperature, probs);
  }
  void top_k_renorm_prob(float* p, int64_t T, int64_t n, const int32_t* k) const { top_k_(p, T, n, k); }
  void top_p_renorm_prob(float* p, int64_t T, int64_t n, const float* top_p) const { top_p_(p, T, n, top_p); }
  void min_p_renorm_prob(float* p, int64_t T, int64_t n, const float* min_p) const { min_p_(p, T, n, min_p); }
  void sample_from_probs(const float* p, int64_t T, int64_t n, const float* u, int32_t* out) const {
    sample_(p, T, n, u, out);
  }
  void argmax(const float* x, int64_t T, int64_t n, int32_t* out) const { argmax_(x, T, n, out); }

  // ---- Kimi K3 (kernel_types.h; resolved only with ModelOpNeeds::k3_ops) ----
  void situ_mul(const float* gate, const float* up, int64_t T, int64_t n, float beta, float linear_beta,
                float* y) const {
    MOAT_CHECK(situ_mul_ != nullptr, "situ_mul was not resolved at load time (ModelOpNeeds::k3_ops)");
    situ_mul_(gate, up, T, n, beta, linear_beta, y);
  }
  void sigmoid_mul(const float* x, const float* gate, int64_t n, float* y) const {
    MOAT_CHECK(sigmoid_mul_ != nullptr, "sigmoid_mul was not resolved at load time (ModelOpNeeds::k3_ops)");
    sigmoid_mul_(x, gate, n, y);
  }
  void attn_res_mix(const AttnResMixArgs& args) const {
    MOAT_CHECK(attn_res_mix_ != nullptr, "attn_res_mix was not resolved at load time (ModelOpNeeds::k3_ops)");
    attn_res_mix_(args);
  }

 private:
  Backend backend_ = Backend::reference;
  MatmulPrecision precision_;
  bool exact_attention_ = false;  // MlaAttentionArgs::exact of every mla_attention call
  std::vector<ResolvedOp> resolved_;
  EmbeddingFn embedding_ = nullptr;
  std::array<MatmulFn, 16> matmul_{};
  std::array<MatmulGroupFn, 16> matmul_group_{};  // nullptr where the resolved kernel has no group entry
  RmsNormFn rms_norm_ = nullptr;
  RopeFn rope_ = nullptr;
  SiluMulFn silu_mul_ = nullptr;
  AddScaledFn add_scaled_ = nullptr;
  StoreLatentFn store_latent_ = nullptr;
  MlaAttentionFn mla_attention_ = nullptr;
  int64_t mla_pad_to_ = 0;  // 0: no padding
  MoeRouteFn moe_route_ = nullptr;
  MoeExpertsFn moe_experts_ = nullptr;
  std::array<HeadMatmulFn, 16> head_matmul_{};
  ShortConvFn short_conv_ = nullptr;
  KdaGateFn kda_gate_ = nullptr;
  KdaFn kda_recurrent_ = nullptr;
  KdaFn kda_chunked_ = nullptr;
  GatedRmsNormFn gated_rms_norm_ = nullptr;
  SoftmaxFn softmax_ = nullptr;
  TopKRenormFn top_k_ = nullptr;
  TopPRenormFn top_p_ = nullptr;
  MinPRenormFn min_p_ = nullptr;
  SampleFromProbsFn sample_ = nullptr;
  ArgmaxFn argmax_ = nullptr;
  // Kimi K3
  SituMulFn situ_mul_ = nullptr;
  SigmoidMulFn sigmoid_mul_ = nullptr;
  AttnResMixFn attn_res_mix_ = nullptr;
  OpProfile* profile_ = nullptr;  // not owned
};

// Parses "reference" / "cpu" / "cuda".
Result<Backend> parse_backend(std::string_view name);

}  // namespace moat::ops
