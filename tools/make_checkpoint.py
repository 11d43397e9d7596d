#!/usr/bin/python3
"""Random-weight checkpoints in the exact Hugging Face DeepSeek-V3 / V2 / Kimi Linear layout.

  tools/make_checkpoint.py --config cfg.json --out DIR [--seed N] [--fp8] [--shards K] [--mtp]
  tools/make_checkpoint.py --preset bench --out checkpoints/bench [--fp8]
  tools/make_checkpoint.py --preset tiny_kimi_linear --out DIR --init fanin
  tools/make_checkpoint.py --preset bench-kimi --out checkpoints/bench-kimi --shards 3

Writes DIR/config.json and DIR/model.safetensors (or model-0000k-of-0000K.safetensors +
model.safetensors.index.json). Tensors are generated one at a time (memory stays low even for the
~6 GB bench checkpoint). Init (--init, default 0.02): matrices N(0, 0.02) or N(0, 1/in) with "fanin"; norm weights 1 + 0.1 N(0,1) (so they matter);
e_score_correction_bias 0.05 N(0,1) in F32. Everything else BF16.
--fp8: every Linear weight except embed_tokens, lm_head and mlp.gate.weight becomes F8_E4M3 [out, in]
plus <name>_scale_inv F32 [ceil(out/128), ceil(in/128)] (128x128 blocks, scale = amax/448, round to
nearest even), and config gets quantization_config. The values are drawn exactly as in the bf16
variant (same seed -> same bf16 weights before quantization).
--mtp: num_nextn_predict_layers = 1 and one extra layer model.layers.{L}.* (the DeepSeek-V3 MTP
module tensors) that a loader must skip.
--mtp-over DIR (with --out): DIR's DeepSeek-V3 checkpoint plus an MTP layer, without a second copy of
its weights: DIR's shard files linked (relative symlinks, so both checkpoints share the page cache),
the MTP layer's tensors alone in model-mtp.safetensors (drawn from --seed, so not the values --mtp
would draw after the whole model), and an index over both.
Kimi Linear (config "architectures": ["KimiLinearForCausalLM"]): the KDA / NoPE-MLA / MoE tensors of
tools/reference_kimi.py; A_log, dt_bias and e_score_correction_bias are F32, the rest BF16. A_log is
log(A) with A ~ U(1, 4) per head and dt_bias the inverse softplus of dt, log-uniform in [1e-3, 0.1]
per channel (the Kimi / Mamba initialisation): with fan-in f_a/f_b the per-step decays exp(g) spread
over ~[0.4, 0.999] (1st / 50th / 99th percentile 0.42 / 0.975 / 0.999 on tiny_kimi_linear's input).
Kimi K3 (config "architectures": ["KimiK3ForConditionalGeneration"], preset tiny_k3): the text model's
tensors under "language_model." (tools/reference_kimi.py K3 section), no vision tensors. F32: A_log
(1-D [head_dim], zero padded; entry h < H is head h's log A), dt_bias, q/k/v_conv1d, o_norm and
e_score_correction_bias (as the released checkpoint stores them); routed experts MXFP4
(compressed-tensors mxfp4-pack-quantized: weight_packed U8 [out, in/2] + weight_scale U8 [out, in/32])
from fan-in fp32 masters by reference_kimi.encode_mxfp4, with a few groups forced to the e8m0 edge
exponents in K3_EDGE_GROUPS; everything else BF16. A ~ U(K3_A_RANGE), dt_bias ~ U(K3_DT_BIAS_RANGE),
chosen for the lower-bound gate so that the per-step decays spread like tiny_kimi_linear's
(1st / 50th / 99th percentile 0.46 / 0.985 / 0.99996 on tiny_k3's input).
Kimi Linear with MXFP4 routed experts (preset bench-kimi: a Kimi Linear config with tiny_k3's
compressed-tensors quantization_config): the routed experts' w1/w2/w3 are stored as in K3
(weight_packed + weight_scale, no edge groups), the rest as for Kimi Linear. Such tensors are encoded
by encode_mxfp4_fast (thresholds instead of reference_kimi.encode_mxfp4's distance table, ~30x
faster; checked equal to it on the first rows of the first matrix); preset bench-kimi defaults to
--init fanin.
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8  # noqa: E402
from safetensors_io import Entry, write_safetensors  # noqa: E402
from reference_model import Config  # noqa: E402
from reference_kimi import K3Config, KimiConfig, encode_mxfp4, is_k3_config, is_kimi_config  # noqa: E402

PRESETS = {
    # DeepSeek-V2-Lite shapes, 6 layers (issue 2's "bench" config)
    "bench": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 6, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 100000,
        "eos_token_id": 100001, "hidden_act": "silu", "attention_bias": False,
        "torch_dtype": "bfloat16",
    },
    # Kimi-Linear-48B-A3B-Instruct's config.json (same keys; values scaled down): 4 layers
    # [KDA + dense, MLA + MoE, KDA + MoE, MLA + MoE], so each kind sits both mid-stack and at an end.
    "tiny_kimi_linear": {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                     "AutoModel": "modeling_kimi.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
        "bos_token_id": 0, "dtype": "bfloat16", "eos_token_id": 1, "first_k_dense_replace": 1,
        "head_dim": 32, "hidden_act": "silu", "hidden_size": 128, "initializer_range": 0.02,
        "intermediate_size": 192, "kv_lora_rank": 32,
        "linear_attn_config": {"full_attn_layers": [2, 4], "head_dim": 32, "kda_layers": [1, 3],
                               "num_heads": 4, "short_conv_kernel_size": 4},
        "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear",
        "moe_intermediate_size": 64, "moe_layer_freq": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "num_attention_heads": 4, "num_expert_group": 1,
        "num_experts": 8, "num_experts_per_token": 2, "num_hidden_layers": 4, "num_key_value_heads": 4,
        "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 2, "q_lora_rank": None,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False,
        "topk_group": 1, "transformers_version": "4.56.0", "use_cache": True, "use_grouped_topk": True,
        "v_head_dim": 16, "vocab_size": 512,
    },
    # Kimi K3 (moonshotai/Kimi-K3 config.json shape: top-level KimiK3ForConditionalGeneration with the
    # text model under text_config, quantization_config inside text_config), scaled down: 6 layers,
    # MLA at 1-based [3, 6], KDA elsewhere, attn_res_block_size 2 (bank rows written at layers 0, 2,
    # 4), dense layer 0, latent MoE (8 experts, top 2, latent 64, expert intermediate 64: two MXFP4
    # groups per row), 2 shared experts. The key set is reconstructed from the engines' config classes
    # and published readings of the released file (not available here): like the released text_config
    # it has no rope_theta / rope_scaling / head_dim. vision_config: the keys of sglang's
    # KimiK3VisionConfig with its defaults, text_hidden_size 128; no vision tensors are written.
    "tiny_k3": {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                     "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        "bos_token_id": 0, "dtype": "bfloat16", "eos_token_id": 1, "ignore_index": -100,
        "image_placeholder": "<|kimi_image_placeholder|>", "media_placeholder_token_id": 163605,
        "model_type": "kimi_k3", "pad_token_id": 2, "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "text_config": {
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "architectures": ["KimiLinearForCausalLM"],
            "attn_res_block_size": 2,
            "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                         "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                         "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"},
            "bos_token_id": 0, "dtype": "bfloat16", "eos_token_id": 1, "first_k_dense_replace": 1,
            "hidden_act": "situ", "hidden_size": 128, "initializer_range": 0.02,
            "intermediate_size": 192, "kv_lora_rank": 32, "latent_moe_use_norm": True,
            "linear_attn_config": {"full_attn_layers": [3, 6], "gate_lower_bound": -5.0, "head_dim": 32,
                                   "kda_layers": [1, 2, 4, 5], "num_heads": 4, "short_conv_kernel_size": 4,
                                   "use_full_rank_gate": True},
            "max_position_embeddings": 1048576, "mla_use_nope": True, "mla_use_output_gate": True,
            "model_type": "kimi_linear", "moe_intermediate_size": 64, "moe_layer_freq": 1,
            "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 4,
            "num_expert_group": 1, "num_experts": 8, "num_experts_per_token": 2, "num_hidden_layers": 6,
            "num_key_value_heads": 4, "num_nextn_predict_layers": 0, "num_shared_experts": 2,
            "pad_token_id": 2, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
            "quantization_config": {
                "config_groups": {"group_0": {
                    "format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None,
                    "targets": ["Linear"],
                    "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                                "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
                                "scale_dtype": "torch.uint8", "strategy": "group", "symmetric": True,
                                "type": "float", "zp_dtype": None}}},
                "format": "mxfp4-pack-quantized", "global_compression_ratio": None,
                "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                           "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
                "kv_cache_scheme": None, "quant_method": "compressed-tensors",
                "quantization_status": "compressed"},
            "rms_norm_eps": 1e-05, "routed_expert_hidden_size": 64, "routed_scaling_factor": 1.0,
            "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
            "use_cache": True, "use_grouped_topk": True, "v_head_dim": 16, "vocab_size": 512,
        },
        "vision_config": {
            "activation_func": "gelu_pytorch_tanh", "attn_bias": False, "init_pos_emb_height": 64,
            "init_pos_emb_time": 4, "init_pos_emb_width": 64, "linear_bias": False,
            "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mlp_type": "mlp2",
            "mm_hidden_size": 1024, "mm_projector_type": "patchmergerv2", "model_type": "kimi_k3_vision",
            "norm_type": "rmsnorm", "patch_embed_proj_bias": False, "patch_size": 14,
            "pos_emb_interpolation_mode": "bilinear", "pos_emb_type": "divided_fixed",
            "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "qkv_hidden_size": 1536,
            "text_hidden_size": 128, "vt_hidden_size": 1024, "vt_intermediate_size": 4096,
            "vt_num_attention_heads": 12, "vt_num_hidden_layers": 27,
        },
    },
}

# Kimi-Linear-48B-A3B-shaped benchmark model (bench/run.sh, bench/model_bench.cpp): the 48B config's
# keys and per-layer shapes (hidden 2304, KDA 32 heads x 128 with conv 4, MLA 32 heads with kv_lora
# 512 and nope / rope / v 128 / 64 / 128, no q_lora, dense intermediate 9216, experts of 1024, top 8,
# 1 shared), but 4 layers [KDA, KDA, KDA, MLA], 64 routed experts instead of 256 and vocab 32000
# instead of 163840; routed experts in MXFP4 with tiny_k3's quantization_config, everything else
# BF16. 1.48 GB (3 shards of ~495 MB with --shards 3): routed experts 0.72 GB, embeddings + lm_head
# 0.29 GB, KDA layers 0.23 GB, the dense MLP 0.13 GB, MLA 0.06 GB, shared experts 0.04 GB; a decode
# token reads ~0.70 GB of it.
PRESETS["bench-kimi"] = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": dict(PRESETS["tiny_kimi_linear"]["auto_map"]),
    "bos_token_id": 0, "dtype": "bfloat16", "eos_token_id": 1, "first_k_dense_replace": 1,
    "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4], "head_dim": 128, "kda_layers": [1, 2, 3],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear",
    "moe_intermediate_size": 1024, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "num_attention_heads": 32, "num_expert_group": 1,
    "num_experts": 64, "num_experts_per_token": 8, "num_hidden_layers": 4, "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 2, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": json.loads(json.dumps(PRESETS["tiny_k3"]["text_config"]["quantization_config"])),
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False, "topk_group": 1, "transformers_version": "4.56.0", "use_cache": True,
    "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 32000,
}
PRESET_INIT = {"bench-kimi": "fanin"}  # --init when not given

FP8_QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": [128, 128]}


def tensor_specs(cfg, mtp=False):
    """[(name, shape, kind)] in HF order; kind: linear | embed | head | norm | gate | bias."""
    c = cfg
    D, H = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    specs = [("model.embed_tokens.weight", [c.vocab_size, D], "embed")]

    def mlp(p, inter):
        return [(p + "gate_proj.weight", [inter, D], "linear"),
                (p + "up_proj.weight", [inter, D], "linear"),
                (p + "down_proj.weight", [D, inter], "linear")]

    def layer(i):
        p = "model.layers.%d." % i
        s = [(p + "input_layernorm.weight", [D], "norm")]
        a = p + "self_attn."
        if c.q_lora_rank:
            s += [(a + "q_a_proj.weight", [c.q_lora_rank, D], "linear"),
                  (a + "q_a_layernorm.weight", [c.q_lora_rank], "norm"),
                  (a + "q_b_proj.weight", [H * qk, c.q_lora_rank], "linear")]
        else:
            s += [(a + "q_proj.weight", [H * qk, D], "linear")]
        s += [(a + "kv_a_proj_with_mqa.weight", [c.kv_lora_rank + c.qk_rope_head_dim, D], "linear"),
              (a + "kv_a_layernorm.weight", [c.kv_lora_rank], "norm"),
              (a + "kv_b_proj.weight", [H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank], "linear"),
              (a + "o_proj.weight", [D, H * c.v_head_dim], "linear"),
              (p + "post_attention_layernorm.weight", [D], "norm")]
        if c.is_moe_layer(i) or i >= c.num_hidden_layers:
            m = p + "mlp."
            s += [(m + "gate.weight", [c.n_routed_experts, D], "gate")]
            if c.topk_method == "noaux_tc":
                s += [(m + "gate.e_score_correction_bias", [c.n_routed_experts], "bias")]
            for e in range(c.n_routed_experts):
                s += mlp(m + "experts.%d." % e, c.moe_intermediate_size)
            if c.n_shared_experts:
                s += mlp(m + "shared_experts.", c.moe_intermediate_size * c.n_shared_experts)
        else:
            s += mlp(p + "mlp.", c.intermediate_size)
        return s

    for i in range(c.num_hidden_layers):
        specs += layer(i)
    specs += [("model.norm.weight", [D], "norm")]
    if not c.tie_word_embeddings:
        specs += [("lm_head.weight", [c.vocab_size, D], "head")]
    if mtp:
        L = c.num_hidden_layers
        p = "model.layers.%d." % L
        specs += [(p + "embed_tokens.weight", [c.vocab_size, D], "embed"),
                  (p + "enorm.weight", [D], "norm"), (p + "hnorm.weight", [D], "norm"),
                  (p + "eh_proj.weight", [D, 2 * D], "linear")]
        specs += layer(L)
        specs += [(p + "shared_head.norm.weight", [D], "norm"),
                  (p + "shared_head.head.weight", [c.vocab_size, D], "head")]
    return specs


def kimi_tensor_specs(cfg, mxfp4_experts=False):
    """[(name, shape, kind)] of a Kimi Linear checkpoint (HF modeling_kimi.py names) in layer order;
    kind as tensor_specs plus conv (q/k/v_conv1d [H*K, 1, W]), a_log ([1, 1, H, 1]) and dt_bias
    ([H*K]); with mxfp4_experts the routed experts' kind is mxfp4 (k3_tensor_specs)."""
    c = cfg
    D, H = c.hidden_size, c.num_attention_heads
    KH, K, W = c.kda_num_heads, c.kda_head_dim, c.conv_kernel
    P = KH * K
    specs = [("model.embed_tokens.weight", [c.vocab_size, D], "embed")]

    def mlp(p, inter, names=("gate_proj", "up_proj", "down_proj")):
        return [(p + names[0] + ".weight", [inter, D], "linear"),
                (p + names[1] + ".weight", [inter, D], "linear"),
                (p + names[2] + ".weight", [D, inter], "linear")]

    for i in range(c.num_hidden_layers):
        p = "model.layers.%d." % i
        a = p + "self_attn."
        specs += [(p + "input_layernorm.weight", [D], "norm")]
        if c.is_kda_layer(i):
            specs += [(a + "q_proj.weight", [P, D], "linear"), (a + "k_proj.weight", [P, D], "linear"),
                      (a + "v_proj.weight", [P, D], "linear"),
                      (a + "q_conv1d.weight", [P, 1, W], "conv"), (a + "k_conv1d.weight", [P, 1, W], "conv"),
                      (a + "v_conv1d.weight", [P, 1, W], "conv"),
                      (a + "A_log", [1, 1, KH, 1], "a_log"),
                      (a + "f_a_proj.weight", [K, D], "linear"), (a + "f_b_proj.weight", [P, K], "linear"),
                      (a + "dt_bias", [P], "dt_bias"),
                      (a + "b_proj.weight", [KH, D], "linear")]
            if c.use_full_rank_gate:
                specs += [(a + "g_proj.weight", [P, D], "linear")]
            else:
                specs += [(a + "g_a_proj.weight", [K, D], "linear"), (a + "g_b_proj.weight", [P, K], "linear")]
            specs += [(a + "o_norm.weight", [K], "norm"), (a + "o_proj.weight", [D, P], "linear")]
        else:
            qk = c.qk_nope_head_dim + c.qk_rope_head_dim
            specs += [(a + "q_proj.weight", [H * qk, D], "linear"),
                      (a + "kv_a_proj_with_mqa.weight", [c.kv_lora_rank + c.qk_rope_head_dim, D], "linear"),
                      (a + "kv_a_layernorm.weight", [c.kv_lora_rank], "norm"),
                      (a + "kv_b_proj.weight", [H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank], "linear"),
                      (a + "o_proj.weight", [D, H * c.v_head_dim], "linear")]
        specs += [(p + "post_attention_layernorm.weight", [D], "norm")]
        if c.is_moe_layer(i):
            m = p + "block_sparse_moe."
            specs += [(m + "gate.weight", [c.num_experts, D], "gate"),
                      (m + "gate.e_score_correction_bias", [c.num_experts], "bias")]
            for e in range(c.num_experts):
                x = m + "experts.%d." % e
                if mxfp4_experts:  # stored as weight_packed + weight_scale (k3_tensor_specs' order)
                    I = c.moe_intermediate_size
                    specs += [(x + "w1.weight", [I, D], "mxfp4"), (x + "w2.weight", [D, I], "mxfp4"),
                              (x + "w3.weight", [I, D], "mxfp4")]
                else:
                    specs += mlp(x, c.moe_intermediate_size, ("w1", "w3", "w2"))
            if c.num_shared_experts:
                specs += mlp(m + "shared_experts.", c.moe_intermediate_size * c.num_shared_experts)
        else:
            specs += mlp(p + "mlp.", c.intermediate_size)
    specs += [("model.norm.weight", [D], "norm")]
    if not c.tie_word_embeddings:
        specs += [("lm_head.weight", [c.vocab_size, D], "head")]
    return specs


def k3_tensor_specs(cfg):
    """[(name, shape, kind)] of a Kimi K3 checkpoint (text model only) in layer order. Kinds as
    kimi_tensor_specs plus a_log_k3 (1-D [head_dim]), conv_f32 / norm_f32 (stored F32), res_proj
    ([1, hidden]) and mxfp4 (a routed expert's [out, in] weight, stored as <name>_packed U8
    [out, in/2] + <name>_scale U8 [out, in/32]; the name given ends in ".weight")."""
    c = cfg
    L = "language_model."
    D, H = c.hidden_size, c.num_attention_heads
    KH, K, W = c.kda_num_heads, c.kda_head_dim, c.conv_kernel
    P, R, I = KH * K, c.routed_expert_hidden_size, c.moe_intermediate_size
    specs = [(L + "model.embed_tokens.weight", [c.vocab_size, D], "embed")]

    def mlp(p, inter):
        return [(p + "gate_proj.weight", [inter, D], "linear"), (p + "up_proj.weight", [inter, D], "linear"),
                (p + "down_proj.weight", [D, inter], "linear")]

    for i in range(c.num_hidden_layers):
        p = L + "model.layers.%d." % i
        a = p + "self_attn."
        specs += [(p + "input_layernorm.weight", [D], "norm"),
                  (p + "self_attention_res_norm.weight", [D], "norm"),
                  (p + "self_attention_res_proj.weight", [1, D], "res_proj")]
        if c.is_kda_layer(i):
            specs += [(a + "q_proj.weight", [P, D], "linear"), (a + "k_proj.weight", [P, D], "linear"),
                      (a + "v_proj.weight", [P, D], "linear"),
                      (a + "q_conv1d.weight", [P, 1, W], "conv_f32"), (a + "k_conv1d.weight", [P, 1, W], "conv_f32"),
                      (a + "v_conv1d.weight", [P, 1, W], "conv_f32"),
                      (a + "A_log", [K], "a_log_k3"),
                      (a + "f_a_proj.weight", [K, D], "linear"), (a + "f_b_proj.weight", [P, K], "linear"),
                      (a + "dt_bias", [P], "dt_bias_k3"),
                      (a + "b_proj.weight", [KH, D], "linear"),
                      (a + "g_proj.weight", [P, D], "linear"),
                      (a + "o_norm.weight", [K], "norm_f32"), (a + "o_proj.weight", [D, P], "linear")]
        else:
            qk = c.qk_nope_head_dim + c.qk_rope_head_dim
            specs += [(a + "q_a_proj.weight", [c.q_lora_rank, D], "linear"),
                      (a + "q_a_layernorm.weight", [c.q_lora_rank], "norm"),
                      (a + "q_b_proj.weight", [H * qk, c.q_lora_rank], "linear"),
                      (a + "kv_a_proj_with_mqa.weight", [c.kv_lora_rank + c.qk_rope_head_dim, D], "linear"),
                      (a + "kv_a_layernorm.weight", [c.kv_lora_rank], "norm"),
                      (a + "kv_b_proj.weight", [H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank], "linear"),
                      (a + "g_proj.weight", [H * c.v_head_dim, D], "linear"),
                      (a + "o_proj.weight", [D, H * c.v_head_dim], "linear")]
        specs += [(p + "post_attention_layernorm.weight", [D], "norm"),
                  (p + "mlp_res_norm.weight", [D], "norm"),
                  (p + "mlp_res_proj.weight", [1, D], "res_proj")]
        if c.is_moe_layer(i):
            m = p + "block_sparse_moe."
            specs += [(m + "gate.weight", [c.num_experts, D], "gate"),
                      (m + "gate.e_score_correction_bias", [c.num_experts], "bias")]
            for e in range(c.num_experts):
                x = m + "experts.%d." % e
                specs += [(x + "w1.weight", [I, R], "mxfp4"), (x + "w2.weight", [R, I], "mxfp4"),
                          (x + "w3.weight", [I, R], "mxfp4")]
            specs += mlp(m + "shared_experts.", I * c.num_shared_experts)
            specs += [(m + "routed_expert_down_proj.weight", [R, D], "linear"),
                      (m + "routed_expert_norm.weight", [R], "norm"),
                      (m + "routed_expert_up_proj.weight", [D, R], "linear")]
        else:
            specs += mlp(p + "mlp.", c.intermediate_size)
    specs += [(L + "model.norm.weight", [D], "norm"),
              (L + "model.output_attn_res_norm.weight", [D], "norm"),
              (L + "model.output_attn_res_proj.weight", [1, D], "res_proj"),
              (L + "lm_head.weight", [c.vocab_size, D], "head")]
    return specs


# Routed-expert MXFP4 groups forced to e8m0 edge exponents in the K3 presets:
# (layer, expert, "w1"/"w2"/"w3", row, group) -> e8m0 byte. The group's fp32 master values are
# rescaled so that the encoder's own exponent choice lands there (max |w| = 0.9 * 6 * 2^(s-127)).
K3_EDGE_GROUPS = {
    (1, 0, "w1", 5, 1): 140,    # 2^13: the gate saturates through SiTU's 4*tanh(g/4) clamp
    (2, 3, "w3", 10, 0): 127,   # 2^0: values up to 6, the up branch reaches 25*tanh(u/25)'s knee
    (3, 5, "w2", 7, 1): 100,    # 2^-27: near-zero weights
    (4, 6, "w1", 0, 0): 100,
}
K3_DT_BIAS_RANGE = (-5.0, -3.0)  # dt_bias ~ U(lo, hi) per channel, tuned for the lower-bound gate
K3_A_RANGE = (1.0, 2.0)         # A = exp(A_log) ~ U(lo, hi) per head: decays 1st/50th/99th pct ~0.46/0.985/0.99995


F32_KINDS = ("bias", "a_log", "dt_bias", "a_log_k3", "dt_bias_k3", "conv_f32", "norm_f32")


def draw(gen, shape, kind, init="0.02", heads=None):
    """fp32 values for one tensor (before the bf16 / fp8 storage rounding).
    init "0.02": matrices N(0, 0.02); "fanin": linear/gate/lm_head N(0, 1/in_features) so that
    attention scores and routing are far from uniform (used by the golden fixtures: a bug in RoPE
    or the softmax scale then moves the logits well past the tolerance); embeddings N(0, 1)."""
    if kind in ("norm", "norm_f32"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if kind == "a_log_k3":  # K3: 1-D [head_dim]; entry h < H is head h's log(A), A ~ U(K3_A_RANGE); the rest 0
        H = heads
        v = torch.zeros(shape)
        lo, hi = K3_A_RANGE
        v[:H] = torch.log(lo + (hi - lo) * torch.rand(H, generator=gen))
        return v
    if kind == "dt_bias_k3":
        lo, hi = K3_DT_BIAS_RANGE
        return lo + (hi - lo) * torch.rand(shape, generator=gen)
    if kind == "bias":
        return 0.05 * torch.randn(shape, generator=gen)
    if kind == "a_log":  # KDA decay rate A = exp(A_log) ~ U(1, 4) per head
        return torch.log(1.0 + 3.0 * torch.rand(shape, generator=gen))
    if kind == "dt_bias":  # inverse softplus of dt, dt log-uniform in [1e-3, 0.1] per channel
        dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(shape, generator=gen))
        return dt + torch.log(-torch.expm1(-dt))
    if init == "fanin":
        std = 1.0 if kind == "embed" else shape[-1] ** -0.5
    else:
        std = float(init)
    return std * torch.randn(shape, generator=gen)


def mxfp4_master(w, name, edge_groups=True):
    """The fp32 master of a routed expert weight (name ...layers.N.block_sparse_moe.experts.E.wK.weight)
    with the K3_EDGE_GROUPS groups rescaled to their edge exponent (edge_groups: the K3 presets)."""
    import re
    if not edge_groups:
        return w
    m = re.search(r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$", name)
    w = w.clone()
    for (layer, expert, proj, row, group), sbyte in K3_EDGE_GROUPS.items():
        if m and (int(m.group(1)), int(m.group(2)), m.group(3)) == (layer, expert, proj):
            g = w[row, 32 * group:32 * (group + 1)]
            w[row, 32 * group:32 * (group + 1)] = g * (0.9 * 6.0 * 2.0 ** (sbyte - 127) / g.abs().max())
    return w


def encode_mxfp4_fast(w):
    """reference_kimi.encode_mxfp4's result (same exponent rule; nearest e2m1 value, ties to the even
    code, sign bit kept on -0) without its [out, G, 32, 8] distance table: a / 2^e is exact in fp32
    (for groups whose a stays a normal float: all but extreme edge exponents),
    so each code is the number of midpoints 0.25 0.75 1.25 1.75 2.5 3.5 5 that a lies past, a
    midpoint counting when a exceeds it if the code below it is even, and when a reaches it if odd."""
    import numpy as np
    w = np.asarray(w, dtype=np.float32)
    out, n = w.shape
    assert n % 32 == 0
    g = w.reshape(out, n // 32, 32)
    amax = np.abs(g).max(-1).astype(np.float64)
    e = np.zeros(amax.shape, dtype=np.int64)
    nz = amax > 0
    e[nz] = np.ceil(np.log2(amax[nz] / 6.0)).astype(np.int64)
    e[nz] += (amax[nz] / np.ldexp(1.0, e[nz]) > 6.0)
    e[nz] -= (amax[nz] / np.ldexp(1.0, e[nz] - 1) <= 6.0)
    assert ((e >= -127) & (e <= 127)).all(), "exponent outside e8m0"
    a = np.abs(g) * np.ldexp(1.0, -e).astype(np.float32)[..., None]  # in [0, 6]
    code = np.zeros(a.shape, dtype=np.uint8)
    for mid, even_below in ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False),
                            (5.0, True)):
        code += (a > mid) if even_below else (a >= mid)
    code = (code | (np.signbit(g).astype(np.uint8) << 3)).reshape(out, n)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8), (e + 127).astype(np.uint8)


def is_mxfp4_config(d):
    q = d.get("quantization_config") or {}
    return q.get("quant_method") == "compressed-tensors" and q.get("format") == "mxfp4-pack-quantized"


def clear_shards(out):
    """Removes a previous checkpoint's weight files from out (a shard count may have changed)."""
    for fn in os.listdir(out):
        if fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
            os.remove(os.path.join(out, fn))


def make(cfg_dict, out, seed=0, use_fp8=False, shards=1, mtp=False, log=False, init="0.02"):
    cfg_dict = dict(cfg_dict)
    if mtp:
        cfg_dict["num_nextn_predict_layers"] = 1
    if use_fp8:
        cfg_dict["quantization_config"] = dict(FP8_QCONFIG)
    if is_k3_config(cfg_dict):
        assert not mtp and not use_fp8, "Kimi K3: no MTP layer, no FP8 variant"
        cfg = K3Config(cfg_dict)
        specs = k3_tensor_specs(cfg)
    elif is_kimi_config(cfg_dict):
        assert not mtp and not use_fp8, "Kimi Linear: no MTP layer, no FP8 variant"
        cfg = KimiConfig(cfg_dict)
        specs = kimi_tensor_specs(cfg, mxfp4_experts=is_mxfp4_config(cfg_dict))
    else:
        cfg = Config(cfg_dict)
        specs = tensor_specs(cfg, mtp)
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    # One entry per stored tensor; producers draw lazily IN ORDER (the writer calls them in order).
    entries = []
    heads = getattr(cfg, "kda_num_heads", None)
    k3 = is_k3_config(cfg_dict)
    # K3 presets keep the reference encoder (their fixtures were made with it); others use the fast
    # one, checked once against the reference on the first rows of the first matrix.
    checked = {"done": k3}

    def encode(w):
        if k3:
            return encode_mxfp4(w)
        if not checked["done"]:
            ref, fast = encode_mxfp4(w[:16]), encode_mxfp4_fast(w[:16])
            assert all((x == y).all() for x, y in zip(ref, fast)), "encode_mxfp4_fast disagrees with encode_mxfp4"
            checked["done"] = True
        return encode_mxfp4_fast(w)
    for name, shape, kind in specs:
        if kind in F32_KINDS:
            entries.append(Entry(name, "F32", shape, producer=lambda s=shape, k=kind: draw(gen, s, k, init, heads)))
        elif kind == "mxfp4":
            o, i = shape
            cache = {}

            def prod_packed(s=shape, name=name, cache=cache):
                w = mxfp4_master(draw(gen, s, "linear", init), name, edge_groups=k3)
                cache["p"], cache["s"] = encode(w.numpy())
                return torch.from_numpy(cache.pop("p"))

            entries.append(Entry(name + "_packed", "U8", [o, i // 2], producer=prod_packed))
            entries.append(Entry(name + "_scale", "U8", [o, i // 32],
                                 producer=lambda cache=cache: torch.from_numpy(cache.pop("s"))))
        elif use_fp8 and kind == "linear":
            o, i = shape
            cache = {}

            def prod_w(s=shape, k=kind, cache=cache):
                w = draw(gen, s, k, init).to(torch.bfloat16).float()
                cache["q"], cache["s"] = fp8.quantize_block(w)
                return cache["q"]

            entries.append(Entry(name, "F8_E4M3", shape, producer=prod_w))
            entries.append(Entry(name + "_scale_inv", "F32", [(o + 127) // 128, (i + 127) // 128],
                                 producer=lambda cache=cache: cache.pop("s")))
        else:
            entries.append(Entry(name, "BF16", shape,
                                 producer=lambda s=shape, k=kind: draw(gen, s, k, init).to(torch.bfloat16)))

    # shard split by bytes, keeping a weight and its scale together
    total = sum(e.nbytes() for e in entries)
    groups = []
    for e in entries:
        if e.name.endswith(("_scale_inv", ".weight_scale")):
            groups[-1].append(e)
        else:
            groups.append([e])
    shard_lists = [[] for _ in range(shards)]
    acc = 0
    for g in groups:
        k = min(shards - 1, acc * shards // max(total, 1))
        shard_lists[k].extend(g)
        acc += sum(e.nbytes() for e in g)
    clear_shards(out)
    meta = {"format": "pt"}
    if shards == 1:
        write_safetensors(os.path.join(out, "model.safetensors"), entries, meta)
    else:
        wm = {}
        for k, lst in enumerate(shard_lists):
            fn = "model-%05d-of-%05d.safetensors" % (k + 1, shards)
            if log:
                print("writing", fn, flush=True)
            write_safetensors(os.path.join(out, fn), lst, meta)
            for e in lst:
                wm[e.name] = fn
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)
    return cfg


def make_mtp_over(base, out, seed=0, init="0.02"):
    with open(os.path.join(base, "config.json")) as f:
        cfg_dict = json.load(f)
    assert not is_kimi_config(cfg_dict) and not is_k3_config(cfg_dict), "--mtp-over: a DeepSeek-V3 checkpoint"
    assert not cfg_dict.get("num_nextn_predict_layers"), "--mtp-over: %s already has MTP layers" % base
    assert "quantization_config" not in cfg_dict, "--mtp-over: a bf16 checkpoint"
    cfg = Config(cfg_dict)
    have = {name for name, _, _ in tensor_specs(cfg)}
    gen = torch.Generator().manual_seed(seed)
    entries = [Entry(name, "BF16", shape, producer=lambda s=shape, k=kind: draw(gen, s, k, init).to(torch.bfloat16))
               for name, shape, kind in tensor_specs(cfg, mtp=True) if name not in have]
    index_path = os.path.join(base, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        weight_map = {name: "model.safetensors" for name in have}
    os.makedirs(out, exist_ok=True)
    clear_shards(out)
    rel = os.path.relpath(os.path.abspath(base), os.path.abspath(out))
    for fn in sorted(set(weight_map.values())):
        os.symlink(os.path.join(rel, fn), os.path.join(out, fn))
    write_safetensors(os.path.join(out, "model-mtp.safetensors"), entries, {"format": "pt"})
    weight_map.update({e.name: "model-mtp.safetensors" for e in entries})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    cfg_dict["num_nextn_predict_layers"] = 1
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--mtp", action="store_true")
    ap.add_argument("--mtp-over", metavar="DIR", help="DIR's checkpoint (linked) plus an MTP layer")
    ap.add_argument("--init", default=None,
                    help='matrix init std, or "fanin" (1/sqrt(in)); default 0.02 (bench-kimi: fanin)')
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.mtp_over:
        make_mtp_over(a.mtp_over, a.out, a.seed, a.init or "0.02")
        print("wrote", a.out)
        return
    if a.preset:
        cfg = PRESETS[a.preset]
    elif a.config:
        with open(a.config) as f:
            cfg = json.load(f)
    else:
        ap.error("--config or --preset")
    torch.set_num_threads(1)
    init = a.init or PRESET_INIT.get(a.preset, "0.02")
    make(cfg, a.out, a.seed, a.fp8, a.shards, a.mtp, log=True, init=init)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
