#!/usr/bin/python3
"""Evaluates the shipped models and writes models/README.md (and models/eval.json).

  tools/eval_models.py [--target models/k3-nano] [--draft models/k3-nano-draft]
                       [--train-log checkpoints/train/train.log]

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
from reference_model import count_params, load_model  # noqa: E402

PROMPTS = ["The meaning of life is", "A computer is"]


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
    txt = open(path).read()
    m = re.search(r"target trained in ([\d.]+) min", txt)
    if m:
        info["target_min"] = float(m.group(1))
    m = re.search(r"draft trained in ([\d.]+) min", txt)
    if m:
        info["draft_min"] = float(m.group(1))
    m = re.search(r"total wall time ([\d.]+) min", txt)
    if m:
        info["total_min"] = float(m.group(1))
    info["last_val"] = re.findall(r"(\w+) step (\d+) VAL loss ([\d.]+)", txt)[-4:]
    toks = re.findall(r"(\w+) step \d+/\d+ .* (\d+) tok/s", txt)
    if toks:
        info["tok_s"] = {k: v for k, v in toks}
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.path.join(ROOT, "models/k3-nano"))
    ap.add_argument("--draft", default=os.path.join(ROOT, "models/k3-nano-draft"))
    ap.add_argument("--train-log", default=os.path.join(ROOT, "checkpoints/train/train.log"))
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=40)
    ap.add_argument("--readme", default=os.path.join(ROOT, "models/README.md"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
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
    write_readme(a.readme, res, json.load(open(os.path.join(a.target, "config.json"))),
                 json.load(open(os.path.join(a.draft, "config.json"))))
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    for s in res["samples"]:
        print("%s T=%.1f | %s|%s" % (s["model"], s["temperature"], s["prompt"], s["text"]))


def write_readme(path, r, tc, dc):
    p, tr = r["params"], r.get("train", {})

    def arch(c):
        return ("hidden %d, %d layers (first %d dense, intermediate %d), %d heads (nope %d, rope %d, v %d), "
                "q_lora_rank %s, kv_lora_rank %d, %d routed experts (moe_intermediate %d, %d per token, "
                "%s/%s groups, %s %s, routed_scaling_factor %s), %d shared, vocab %d, tied embeddings: %s" % (
                    c["hidden_size"], c["num_hidden_layers"], c["first_k_dense_replace"], c["intermediate_size"],
                    c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                    c["q_lora_rank"], c["kv_lora_rank"], c["n_routed_experts"], c["moe_intermediate_size"],
                    c["num_experts_per_tok"], c["topk_group"], c["n_group"], c["topk_method"], c["scoring_func"],
                    c["routed_scaling_factor"], c["n_shared_experts"], c["vocab_size"], c["tie_word_embeddings"]))

    samples = "\n".join(
        "- %s, %s: **%s**%s" % (
            s["model"], "greedy" if s["temperature"] == 0 else "temperature %.1f, seed %d" % (s["temperature"], s["seed"]),
            s["prompt"], s["text"].replace("\n", " / ").replace("\t", " "))
        for s in r["samples"])
    wall = ""
    if tr.get("target_min"):
        wall = "Measured wall time: target %.1f min, draft %.1f min (total %.1f min, including data preparation), " \
               "one thread, on a 2-core VM shared with C++ builds (mean training throughput %s tok/s; the draft's includes the teacher forward).\n" % (
                   tr.get("target_min", 0), tr.get("draft_min", 0), tr.get("total_min", 0),
                   ", ".join("%s %s" % kv for kv in tr.get("tok_s", {}).items()))
    txt = f"""# Shipped models

Two small models of moat's own architecture (DeepSeek-V3 layout: MLA + MoE), trained from scratch
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

Files per model: config.json (`DeepseekV3ForCausalLM`, model_type deepseek_v3), model.safetensors
(BF16; `e_score_correction_bias` F32), tokenizer.json (byte-level BPE, 4091 tokens + 5 special:
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

```sh
tools/train_tokenizer.py --out checkpoints/tokenizer --vocab-size 4096          # ~20 s
tools/train.py --tokenizer checkpoints/tokenizer --work checkpoints/train \\
    --steps 800 --draft-steps 400 --batch 16 --ctx 128 --warmup 50 --eval-every 100 \\
    --seed 1234 --fresh > checkpoints/train/train.log 2>&1
tools/train.py --work checkpoints/train --export-only   # re-export the best saved weights
tools/eval_models.py                                    # rewrites this file and models/eval.json
tools/make_golden.py --model-dir models/k3-nano --name k3_nano
tools/make_golden.py --model-dir models/k3-nano-draft --name k3_nano_draft
```

{wall}
Training: target first with next-token cross-entropy; the draft second, distilled from the target
(0.5 CE + 0.5 KL(target || draft)). AdamW (0.9, 0.95), weight decay 0.1, warm-up then cosine decay,
bf16 autocast, residual dropout 0.1, std 0.02 init; noaux_tc expert balance through the
`e_score_correction_bias` update (aux-loss-free). The weights with the best validation loss are
exported. Deterministic given the seed on one thread (a resumed run is not bit-identical: the dropout
RNG state is not saved).
"""
    with open(path, "w") as f:
        f.write(txt)


if __name__ == "__main__":
    main()
