#!/usr/bin/python3
"""Random-weight checkpoints in the exact Hugging Face DeepSeek-V3 / V2 layout.

  tools/make_checkpoint.py --config cfg.json --out DIR [--seed N] [--fp8] [--shards K] [--mtp]
  tools/make_checkpoint.py --preset bench --out checkpoints/bench [--fp8]

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
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8  # noqa: E402
from safetensors_io import Entry, write_safetensors  # noqa: E402
from reference_model import Config  # noqa: E402

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


def draw(gen, shape, kind, init="0.02"):
    """fp32 values for one tensor (before the bf16 / fp8 storage rounding).
    init "0.02": matrices N(0, 0.02); "fanin": linear/gate/lm_head N(0, 1/in_features) so that
    attention scores and routing are far from uniform (used by the golden fixtures: a bug in RoPE
    or the softmax scale then moves the logits well past the tolerance); embeddings N(0, 1)."""
    if kind == "norm":
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if kind == "bias":
        return 0.05 * torch.randn(shape, generator=gen)
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
    cfg = Config(cfg_dict)
    os.makedirs(out, exist_ok=True)
    specs = tensor_specs(cfg, mtp)
    gen = torch.Generator().manual_seed(seed)

    # One entry per stored tensor; producers draw lazily IN ORDER (the writer calls them in order).
    entries = []
    for name, shape, kind in specs:
        if kind == "bias":
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
