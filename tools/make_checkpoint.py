#!/usr/bin/python3
"""Random-weight checkpoints in the exact Hugging Face DeepSeek-V3 / V2 / Kimi Linear layout.

  tools/make_checkpoint.py --config cfg.json --out DIR [--seed N] [--fp8] [--shards K] [--mtp]
  tools/make_checkpoint.py --preset bench --out checkpoints/bench [--fp8]
  tools/make_checkpoint.py --preset tiny_kimi_linear --out DIR --init fanin

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
Kimi Linear (config "architectures": ["KimiLinearForCausalLM"]): the KDA / NoPE-MLA / MoE tensors of
tools/reference_kimi.py; A_log, dt_bias and e_score_correction_bias are F32, the rest BF16. A_log is
log(A) with A ~ U(1, 4) per head and dt_bias the inverse softplus of dt, log-uniform in [1e-3, 0.1]
per channel (the Kimi / Mamba initialisation): with fan-in f_a/f_b the per-step decays exp(g) spread
over ~[0.4, 0.999] (1st / 50th / 99th percentile 0.42 / 0.975 / 0.999 on tiny_kimi_linear's input).
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
from reference_kimi import KimiConfig, is_kimi_config  # noqa: E402

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
}

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


def kimi_tensor_specs(cfg):
    """[(name, shape, kind)] of a Kimi Linear checkpoint (HF modeling_kimi.py names) in layer order;
    kind as tensor_specs plus conv (q/k/v_conv1d [H*K, 1, W]), a_log ([1, 1, H, 1]) and dt_bias
    ([H*K])."""
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
                specs += mlp(m + "experts.%d." % e, c.moe_intermediate_size, ("w1", "w3", "w2"))
            if c.num_shared_experts:
                specs += mlp(m + "shared_experts.", c.moe_intermediate_size * c.num_shared_experts)
        else:
            specs += mlp(p + "mlp.", c.intermediate_size)
    specs += [("model.norm.weight", [D], "norm")]
    if not c.tie_word_embeddings:
        specs += [("lm_head.weight", [c.vocab_size, D], "head")]
    return specs


F32_KINDS = ("bias", "a_log", "dt_bias")


def draw(gen, shape, kind, init="0.02"):
    """fp32 values for one tensor (before the bf16 / fp8 storage rounding).
    init "0.02": matrices N(0, 0.02); "fanin": linear/gate/lm_head N(0, 1/in_features) so that
    attention scores and routing are far from uniform (used by the golden fixtures: a bug in RoPE
    or the softmax scale then moves the logits well past the tolerance); embeddings N(0, 1)."""
    if kind == "norm":
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
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


def make(cfg_dict, out, seed=0, use_fp8=False, shards=1, mtp=False, log=False, init="0.02"):
    cfg_dict = dict(cfg_dict)
    if mtp:
        cfg_dict["num_nextn_predict_layers"] = 1
    if use_fp8:
        cfg_dict["quantization_config"] = dict(FP8_QCONFIG)
    if is_kimi_config(cfg_dict):
        assert not mtp and not use_fp8, "Kimi Linear: no MTP layer, no FP8 variant"
        cfg = KimiConfig(cfg_dict)
        specs = kimi_tensor_specs(cfg)
    else:
        cfg = Config(cfg_dict)
        specs = tensor_specs(cfg, mtp)
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    # One entry per stored tensor; producers draw lazily IN ORDER (the writer calls them in order).
    entries = []
    for name, shape, kind in specs:
        if kind in F32_KINDS:
            entries.append(Entry(name, "F32", shape, producer=lambda s=shape, k=kind: draw(gen, s, k, init)))
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
        if e.name.endswith("_scale_inv"):
            groups[-1].append(e)
        else:
            groups.append([e])
    shard_lists = [[] for _ in range(shards)]
    acc = 0
    for g in groups:
        k = min(shards - 1, acc * shards // max(total, 1))
        shard_lists[k].extend(g)
        acc += sum(e.nbytes() for e in g)
    for fn in os.listdir(out):
        if fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
            os.remove(os.path.join(out, fn))
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--mtp", action="store_true")
    ap.add_argument("--init", default="0.02", help='matrix init std, or "fanin" (1/sqrt(in))')
    a = ap.parse_args()
    if a.preset:
        cfg = PRESETS[a.preset]
    elif a.config:
        with open(a.config) as f:
            cfg = json.load(f)
    else:
        ap.error("--config or --preset")
    torch.set_num_threads(1)
    make(cfg, a.out, a.seed, a.fp8, a.shards, a.mtp, log=True, init=a.init)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
