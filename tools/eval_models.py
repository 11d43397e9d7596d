#!/usr/bin/python3
"""Evaluates the shipped models and writes models/README.md (and models/eval.json).

  tools/eval_models.py [--target models/k3-nano] [--draft models/k3-nano-draft]
                       [--train-log checkpoints/train/train.log]

Works for both shipped-model layouts, chosen from the target's config.json: DeepSeek-V3
(`DeepseekV3ForCausalLM`, tools/train.py; default --train-log checkpoints/train/train.log) and
Kimi K3 (`KimiK3ForConditionalGeneration`, tools/train_k3.py; default --train-log
checkpoints/train-k3/train.log when it exists). A missing log only drops the wall-time line.

Reports: parameter counts (total / active per token), validation loss and perplexity on the
held-out split (tools/corpus.py) in windows of --ctx tokens, the draft's greedy top-1 agreement
with the target on that held-out text (teacher-forced: at every position, does argmax(draft) ==
argmax(target)? -- this predicts the greedy speculative acceptance rate), and greedy and
temperature samples from the reference implementation (fp32 compute, BOS + prompt tokens).
"""
import argparse
import json
import math
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import corpus  # noqa: E402
from bpe import Tokenizer  # noqa: E402
import reference_kimi  # noqa: E402
import reference_model  # noqa: E402
from reference_model import load_model  # noqa: E402
from safetensors_io import read_header  # noqa: E402

PROMPTS = ["The meaning of life is", "A computer is"]


def is_k3(c):
    return reference_kimi.is_k3_config(c)


def count_params(model):
    """(total, active per token) parameter counts, embeddings and lm_head included (as
    reference_model.count_params counts them for DeepSeek models). For K3, total is every parameter
    with the routed experts at their logical (dequantized) size; active drops the routed experts a
    token does not use (num_experts - num_experts_per_token per MoE layer). Router biases are
    buffers and not counted, as for DeepSeek."""
    if isinstance(model, reference_kimi.KimiK3ForConditionalGeneration):
        cfg = model.cfg
        total = sum(p.numel() for p in model.parameters())
        active = total
        for layer in model.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None:
                per = sum(p.numel() for p in moe.experts[0].parameters())
                active -= per * (cfg.num_experts - cfg.num_experts_per_token)
        return total, active
    if isinstance(model, reference_kimi.KimiLinearForCausalLM):
        return reference_kimi.count_params(model)
    return reference_model.count_params(model)


def tensor_dtypes(d):
    """[(name, dtype)] of a checkpoint dir's safetensors (single file or sharded)."""
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        files = sorted(set(json.load(open(idx))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = []
    for fn in files:
        h, _ = read_header(os.path.join(d, fn))
        out += [(k, v["dtype"]) for k, v in h.items() if k != "__metadata__"]
    return out


def dtype_text(d):
    """How model.safetensors stores its tensors, from the file headers: e.g. "BF16;
    `e_score_correction_bias` F32" or the MXFP4 routed experts + BF16 + the F32 vectors."""
    def leaf(name):
        parts = name.split(".")
        if parts[-1] in ("weight", "weight_packed", "weight_scale") and len(parts) > 1:
            parts = parts[:-1]
        return parts[-1]

    groups, mx = {}, []
    for name, dt in tensor_dtypes(d):
        if name.endswith((".weight_packed", ".weight_scale")) and dt == "U8":
            if leaf(name) not in mx:
                mx.append(leaf(name))
            continue
        groups.setdefault(dt, [])
        if leaf(name) not in groups[dt]:
            groups[dt].append(leaf(name))
    main = max(groups, key=lambda k: len(groups[k])) if groups else "BF16"
    rest = "; ".join("%s %s" % (" ".join("`%s`" % n for n in names), dt)
                     for dt, names in groups.items() if dt != main)
    if not mx:
        return main + ("; " + rest if rest else "")
    return ("routed experts (%s) as compressed-tensors MXFP4: `weight_packed` U8 [out, in/2], two e2m1\n"
            "values per byte, and `weight_scale` U8 [out, in/32], one e8m0 scale per 32 values;\n"
            "everything else %s%s" % ("/".join(sorted(mx)), main, ", except " + rest if rest else ""))


@torch.no_grad()
def val_stats(target, draft, windows, bs=16):
    tot = {"target": 0.0, "draft": 0.0}
    agree = n = 0
    for i in range(0, windows.shape[0], bs):
        x = windows[i:i + bs, :-1]
        y = windows[i:i + bs, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lt = target(x).float()
            ld = draft(x).float()
        tot["target"] += F.cross_entropy(lt.flatten(0, 1), y.flatten(), reduction="sum").item()
        tot["draft"] += F.cross_entropy(ld.flatten(0, 1), y.flatten(), reduction="sum").item()
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        n += y.numel()
    return {k: v / n for k, v in tot.items()}, agree / n, n


@torch.no_grad()
def generate(model, ids, n, temperature=0.0, seed=0, eos=None):
    g = torch.Generator().manual_seed(seed)
    ids = list(ids)
    out = []
    for _ in range(n):
        logits = model(torch.tensor(ids))[-1]
        if temperature < 1e-6:
            t = int(logits.argmax())
        else:
            p = torch.softmax(logits / temperature, -1)
            t = int(torch.multinomial(p, 1, generator=g))
        if t == eos:
            break
        ids.append(t)
        out.append(t)
    return out


def parse_log(path):
    info = {}
    if not path or not os.path.exists(path):
        return info
    # tools/train.py and tools/train_k3.py log through the same functions (train.log / train_k3.py's
    # log): "HH:MM:SS target step 125/800 loss 5.2980 ce 5.2980 lr 1.96e-03  444 tok/s",
    # "HH:MM:SS target step 200 VAL loss 4.9167 ppl 136.55 (best)", "target: resumed at step 100
    # (best val 5.3940)", "target trained in 12.3 min", "total wall time 45.6 min". A log may hold
    # several appended runs: the last value of each counts.
    txt = open(path).read()
    for key, what in (("target_min", "target trained in"), ("draft_min", "draft trained in"),
                      ("total_min", "total wall time")):
        m = re.findall(what + r" ([\d.]+) min", txt)
        if m:
            info[key] = float(m[-1])
    info["last_val"] = re.findall(r"(\w+) step (\d+) VAL loss ([\d.]+)", txt)[-4:]
    toks = re.findall(r"(\w+) step \d+/\d+ .*?(\d+) tok/s", txt)
    if toks:
        info["tok_s"] = {k: v for k, v in toks}
    res = re.findall(r"(\w+): resumed at step (\d+)", txt)
    if res:
        info["resumed"] = {k: int(v) for k, v in res}
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.path.join(ROOT, "models/k3-nano"))
    ap.add_argument("--draft", default=os.path.join(ROOT, "models/k3-nano-draft"))
    ap.add_argument("--train-log", default=None,
                    help="training log for the wall-time line (default: checkpoints/train/train.log, or "
                         "checkpoints/train-k3/train.log for K3-shaped models when it exists)")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=40)
    ap.add_argument("--readme", default=os.path.join(ROOT, "models/README.md"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    tc = json.load(open(os.path.join(a.target, "config.json")))
    dc = json.load(open(os.path.join(a.draft, "config.json")))
    if a.train_log is None:
        a.train_log = os.path.join(ROOT, "checkpoints/train/train.log")
        if is_k3(tc):
            k3log = os.path.join(ROOT, "checkpoints/train-k3/train.log")
            a.train_log = k3log if os.path.exists(k3log) else None
    tok = Tokenizer.load(os.path.join(a.target, "tokenizer.json"))
    bos, eos = tok.added["<|bos|>"], tok.added["<|eos|>"]
    target, draft = load_model(a.target).eval(), load_model(a.draft).eval()
    _, val = corpus.split()
    stream = []
    for d in val:
        stream += [bos] + tok.encode(d, specials=False) + [eos]
    T = a.ctx + 1
    n = (len(stream) - 1) // a.ctx
    windows = torch.tensor(stream[:n * a.ctx + 1])
    windows = torch.stack([windows[i * a.ctx:i * a.ctx + T] for i in range(n)])
    losses, agree, ntok = val_stats(target, draft, windows)
    res = {
        "params": {k: dict(zip(("total", "active_per_token"), count_params(m)))
                   for k, m in (("target", target), ("draft", draft))},
        "val_loss": losses, "val_ppl": {k: math.exp(v) for k, v in losses.items()},
        "val_tokens": ntok, "gen_tokens": a.gen_tokens, "draft_top1_agreement": agree, "samples": [],
        "files_mb": {k: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) / 1e6
                     for k, d in (("target", a.target), ("draft", a.draft))},
    }
    for pi, prompt in enumerate(PROMPTS):
        ids = [bos] + tok.encode(prompt)
        for temp, seed in ((0.0, 0), (0.8, 1 + pi)):
            out = generate(target, ids, a.gen_tokens, temp, seed, eos)
            res["samples"].append({"model": "k3-nano", "prompt": prompt, "temperature": temp, "seed": seed,
                                   "text": tok.decode(out), "tokens": out})
        out = generate(draft, ids, a.gen_tokens, 0.0, 0, eos)
        res["samples"].append({"model": "k3-nano-draft", "prompt": prompt, "temperature": 0.0, "seed": 0,
                               "text": tok.decode(out), "tokens": out})
    res["train"] = parse_log(a.train_log)
    res["eval_seconds"] = time.time() - t0
    with open(os.path.join(os.path.dirname(a.readme), "eval.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_readme(a.readme, res, tc, dc, dtype_text(a.target), dtype_text(a.draft))
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    for s in res["samples"]:
        print("%s T=%.1f | %s|%s" % (s["model"], s["temperature"], s["prompt"], s["text"]))


def arch_deepseek(c):
    return ("hidden %d, %d layers (first %d dense, intermediate %d), %d heads (nope %d, rope %d, v %d), "
            "q_lora_rank %s, kv_lora_rank %d, %d routed experts (moe_intermediate %d, %d per token, "
            "%s/%s groups, %s %s, routed_scaling_factor %s), %d shared, vocab %d, tied embeddings: %s" % (
                c["hidden_size"], c["num_hidden_layers"], c["first_k_dense_replace"], c["intermediate_size"],
                c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                c["q_lora_rank"], c["kv_lora_rank"], c["n_routed_experts"], c["moe_intermediate_size"],
                c["num_experts_per_tok"], c["topk_group"], c["n_group"], c["topk_method"], c["scoring_func"],
                c["routed_scaling_factor"], c["n_shared_experts"], c["vocab_size"], c["tie_word_embeddings"]))


def expert_format(t):
    """"MXFP4" when the (text) config's quantization_config is compressed-tensors mxfp4, else "BF16"."""
    q = t.get("quantization_config") or {}
    fmts = [g.get("format", "") for g in (q.get("config_groups") or {}).values()] + [q.get("format") or ""]
    return "MXFP4" if any("mxfp4" in f for f in fmts) else "BF16"


def arch_k3(c):
    """One line from a Kimi K3 config's text_config (a bare Kimi Linear config works too)."""
    t = c.get("text_config", c)
    la = t["linear_attn_config"]
    kda, mla = la.get("kda_layers", []), la.get("full_attn_layers", [])
    kda_txt = "KDA %d heads x %d, conv kernel %d" % (la["num_heads"], la["head_dim"], la["short_conv_kernel_size"])
    if la.get("gate_lower_bound") is not None:
        kda_txt += ", gate lower bound %s" % la["gate_lower_bound"]
    if la.get("use_full_rank_gate"):
        kda_txt += ", full-rank output gate"
    mla_txt = "MLA %d heads (nope %d, rope %d, v %d), q_lora_rank %s, kv_lora_rank %d%s%s" % (
        t["num_attention_heads"], t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"],
        t.get("q_lora_rank"), t["kv_lora_rank"], ", NoPE" if t.get("mla_use_nope") else ", RoPE",
        ", output gate" if t.get("mla_use_output_gate") else "")
    moe = "%d routed experts (%d per token" % (t["num_experts"], t["num_experts_per_token"])
    if t.get("routed_expert_hidden_size"):
        moe = "latent MoE: " + moe + ", latent %d%s" % (
            t["routed_expert_hidden_size"], " + norm" if t.get("latent_moe_use_norm") else "")
    else:
        moe = "MoE: " + moe
    moe += ", expert intermediate %d, %s, %s router, routed_scaling_factor %s), %d shared" % (
        t["moe_intermediate_size"], expert_format(t), t.get("moe_router_activation_func", "sigmoid"),
        t.get("routed_scaling_factor", 1.0), t.get("num_shared_experts", 0))
    act = t.get("hidden_act", "silu")
    if act == "situ":
        act = "SiTU (beta %s, linear beta %s)" % (t.get("activation_situ_beta"), t.get("activation_situ_linear_beta"))
    parts = ["hidden %d" % t["hidden_size"],
             "%d layers: KDA %s, MLA %s (1-based)" % (t["num_hidden_layers"], kda, mla),
             kda_txt, mla_txt,
             "first %d dense (intermediate %d)" % (t.get("first_k_dense_replace", 0), t["intermediate_size"]),
             moe, act]
    if t.get("attn_res_block_size"):
        parts.append("AttnRes block size %d" % t["attn_res_block_size"])
    parts.append("vocab %d, tied embeddings: %s" % (
        t["vocab_size"], t.get("tie_word_embeddings", c.get("tie_word_embeddings", False))))
    return "; ".join(parts)


def arch(c):
    return arch_k3(c) if is_k3(c) or reference_kimi.is_kimi_config(c) else arch_deepseek(c)


def arch_name(c):
    return "`%s`, model_type %s" % ((c.get("architectures") or ["?"])[0], c.get("model_type"))


def config_text(c):
    """What config.json holds, for the "Files per model" paragraph."""
    if is_k3(c):
        t = c["text_config"]
        return "%s;\nthe text model under `text_config`, model_type %s%s" % (
            arch_name(c), t.get("model_type"),
            ", with the compressed-tensors `quantization_config`" if expert_format(t) == "MXFP4" else "")
    return arch_name(c)


def write_readme(path, r, tc, dc, tdtypes=None, ddtypes=None):
    p, tr = r["params"], r.get("train", {})
    k3 = is_k3(tc)
    tdtypes = tdtypes or "BF16; `e_score_correction_bias` F32"
    ddtypes = ddtypes or tdtypes

    samples = "\n".join(
        "- %s, %s: **%s**%s" % (
            s["model"], "greedy" if s["temperature"] == 0 else "temperature %.1f, seed %d" % (s["temperature"], s["seed"]),
            s["prompt"], s["text"].replace("\n", " / ").replace("\t", " "))
        for s in r["samples"])
    wall = ""
    if tr.get("target_min"):
        times = "target %.1f min" % tr["target_min"]
        if tr.get("draft_min") is not None:
            times += ", draft %.1f min" % tr["draft_min"]
        if tr.get("total_min") is not None:
            times += " (total %.1f min, including data preparation)" % tr["total_min"]
        wall = "Measured wall time: %s, one thread, on a 2-core VM shared with %s " \
               "(mean training throughput %s tok/s; the draft's includes the teacher forward).\n" % (
                   times, "other jobs" if k3 else "C++ builds",
                   ", ".join("%s %s" % kv for kv in tr.get("tok_s", {}).items()))
        if tr.get("resumed"):
            wall += "Resumed from saved training state (%s): the times cover the resumed part only.\n" % (
                ", ".join("%s at step %d" % kv for kv in tr["resumed"].items()))

    if k3:
        intro = ("Two small models in Kimi K3's text architecture (%s:\nhybrid KDA + gated NoPE MLA, "
                 "attention residuals, SiTU, latent MoE with MXFP4 routed experts)" % arch_name(tc))
    elif reference_kimi.is_kimi_config(tc):
        intro = "Two small models in Kimi Linear's architecture (%s: hybrid KDA + NoPE MLA, MoE)" % arch_name(tc)
    else:
        intro = "Two small models of moat's own architecture (DeepSeek-V3 layout: MLA + MoE)"
    if config_text(tc) == config_text(dc) and tdtypes == ddtypes:
        files = "config.json (%s), model.safetensors\n(%s)" % (config_text(tc), tdtypes)
    else:
        files = ("config.json (k3-nano: %s; k3-nano-draft: %s), model.safetensors\n(k3-nano: %s; "
                 "k3-nano-draft: %s)" % (config_text(tc), config_text(dc), tdtypes, ddtypes))

    if k3:
        reproduce = """```sh
mkdir -p checkpoints/train-k3
tools/train_k3.py --work checkpoints/train-k3 --steps 800 --draft-steps 400 \\
    --out-target checkpoints/k3-nano-k3 --out-draft checkpoints/k3-nano-k3-draft \\
    --fresh > checkpoints/train-k3/train.log 2>&1
tools/train_k3.py --work checkpoints/train-k3 --export-only     # re-export the best saved weights
cp checkpoints/k3-nano-k3/* models/k3-nano/                      # the exports are the shipped models
cp checkpoints/k3-nano-k3-draft/* models/k3-nano-draft/
tools/eval_models.py --train-log checkpoints/train-k3/train.log  # rewrites this file and models/eval.json
tools/make_golden.py --model-dir models/k3-nano --name k3_nano
tools/make_golden.py --model-dir models/k3-nano-draft --name k3_nano_draft
```

train_k3.py's other defaults: `--tokenizer models/k3-nano` (the byte-level BPE above, from
`tools/train_tokenizer.py --vocab-size 4096`), `--batch 16 --ctx 128 --lr 2e-3 --draft-lr 3e-3
--warmup 50 --eval-every 100 --seed 1234 --threads 1`."""
        training = """Training (tools/train_k3.py, with tools/train.py's loop, data, schedule and distillation): target
first with next-token cross-entropy; the draft second, distilled from the target (0.5 CE + 0.5
KL(target || draft)). AdamW (0.9, 0.95), weight decay 0.1, warm-up then cosine decay, bf16 autocast,
no dropout, matrices N(0, 0.02) at init (make_checkpoint's initial values for the KDA decay and gate
vectors, norms 1). The routed experts train through a fake MXFP4 quantizer (straight-through
gradient) that rounds exactly as the exporter stores them, so the shipped MXFP4 weights are the ones
evaluated. noaux_tc expert balance through the `e_score_correction_bias` update (aux-loss-free). The
weights with the best validation loss are exported. Deterministic given the seed on one thread."""
    else:
        reproduce = """```sh
tools/train_tokenizer.py --out checkpoints/tokenizer --vocab-size 4096          # ~20 s
tools/train.py --tokenizer checkpoints/tokenizer --work checkpoints/train \\
    --steps 800 --draft-steps 400 --batch 16 --ctx 128 --warmup 50 --eval-every 100 \\
    --seed 1234 --fresh > checkpoints/train/train.log 2>&1
tools/train.py --work checkpoints/train --export-only   # re-export the best saved weights
tools/eval_models.py                                    # rewrites this file and models/eval.json
tools/make_golden.py --model-dir models/k3-nano --name k3_nano
tools/make_golden.py --model-dir models/k3-nano-draft --name k3_nano_draft
```"""
        training = """Training: target first with next-token cross-entropy; the draft second, distilled from the target
(0.5 CE + 0.5 KL(target || draft)). AdamW (0.9, 0.95), weight decay 0.1, warm-up then cosine decay,
bf16 autocast, residual dropout 0.1, std 0.02 init; noaux_tc expert balance through the
`e_score_correction_bias` update (aux-loss-free). The weights with the best validation loss are
exported. Deterministic given the seed on one thread (a resumed run is not bit-identical: the dropout
RNG state is not saved)."""
    txt = f"""# Shipped models

{intro}, trained from scratch
on this machine. `moat` uses `models/k3-nano` when no `--model` is given; `models/k3-nano-draft`
is its speculative-decoding draft (same tokenizer).

| | k3-nano (target) | k3-nano-draft |
|---|---|---|
| parameters (total) | {p['target']['total']:,} | {p['draft']['total']:,} |
| parameters active per token | {p['target']['active_per_token']:,} | {p['draft']['active_per_token']:,} |
| validation loss (nats/token) | {r['val_loss']['target']:.4f} | {r['val_loss']['draft']:.4f} |
| validation perplexity | {r['val_ppl']['target']:.2f} | {r['val_ppl']['draft']:.2f} |
| files (MB) | {r['files_mb']['target']:.1f} | {r['files_mb']['draft']:.1f} |

Draft greedy top-1 agreement with the target on the held-out text: **{100 * r['draft_top1_agreement']:.1f}%**
({r['val_tokens']:,} positions, teacher-forced: argmax of the draft equals argmax of the target).
This predicts the greedy speculative-decoding acceptance rate per drafted token.
Validation numbers use bf16 autocast; the samples below use fp32 (the reference's golden mode).

- k3-nano: {arch(tc)}.
- k3-nano-draft: {arch(dc)}.

Files per model: {files}, tokenizer.json (byte-level BPE, 4091 tokens + 5 special:
`<|bos|>` `<|eos|>` `<|user|>` `<|assistant|>` `<|system|>`, GPT-2 pre-tokenizer regex, ByteLevel
decoder), tokenizer_config.json (bos/eos, add_bos_token, a simple chat template).
Golden logits for both: tests/golden/k3_nano, tests/golden/k3_nano_draft.

## Samples (reference implementation, fp32, `<|bos|>` + prompt, up to {r['gen_tokens']} tokens, stopping at `<|eos|>`)

{samples}

The sampled token ids are in models/eval.json: moat's greedy output for the same prompt (with the
`<|bos|>` that tokenizer_config's add_bos_token asks for) should match them token for token.

## Corpus and license

The fortune cookie databases shipped by the Debian packages **fortunes-min** and **fortunes**
(source package fortune-mod 1:1.99.1; /usr/share/games/fortunes/*, every file except
`ascii-art`). Debian's copyright file for these packages (/usr/share/doc/fortunes/copyright)
gives the BSD license of fortune-mod (Regents of the University of California); the cookie files
are collections of short quotations from many authors, distributed by Debian under that file. The `%` separators are
stripped, each quote is one document (exact duplicates dropped), framed as `<|bos|> text <|eos|>`.
Validation split: documents with md5(text) mod 20 == 0 (5%, deterministic): {r['val_tokens']:,} tokens.

## Reproduce (Debian 12, `/usr/bin/python3` with python3-torch 1.13)

{reproduce}

{wall}
{training}
"""
    with open(path, "w") as f:
        f.write(txt)


if __name__ == "__main__":
    main()
