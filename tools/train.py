#!/usr/bin/python3
"""Trains the shipped models models/k3-nano (target) and models/k3-nano-draft (draft) with the
reference model code (tools/reference_model.py), on the fortune corpus (tools/corpus.py) with the
tokenizer from tools/train_tokenizer.py. One process, one thread; deterministic given --seed.

  tools/train.py --tokenizer checkpoints/tokenizer --work checkpoints/train \
      --steps 800 --draft-steps 400 --batch 16 --ctx 128 --warmup 50 --eval-every 100 \
      --seed 1234 --fresh > checkpoints/train/train.log 2>&1
  tools/train.py --work checkpoints/train --export-only     # export the best saved weights

Target first (plain next-token cross-entropy), then the draft, distilled from the target
(0.5 * CE + 0.5 * KL(target || draft)) so that its greedy choices agree with the target's.
AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine decay to 10%,
bf16 autocast, residual dropout, std 0.02 init. noaux_tc routing stays balanced the aux-loss-free
way: after every step each e_score_correction_bias moves by 1e-3 * sign(mean load - load).
Every --eval-every steps: validation loss; the best-so-far weights are saved (work/<name>.best.pt)
and the training state (work/<name>.state.pt) so that a cut-short run can be exported or resumed.
"""
import argparse
import json
import math
import os
import shutil
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import corpus  # noqa: E402
from bpe import Tokenizer  # noqa: E402
from reference_model import Config, DeepseekV3ForCausalLM, MoE, count_params  # noqa: E402
from safetensors_io import entry, write_safetensors  # noqa: E402

COMMON = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "moe_layer_freq": 1, "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024, "torch_dtype": "bfloat16", "num_nextn_predict_layers": 0,
    "initializer_range": 0.02, "use_cache": True,
}

TARGET = dict(COMMON, **{
    "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 12,
    "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
    "v_head_dim": 16, "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4,
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
    "tie_word_embeddings": False,
})

DRAFT = dict(COMMON, **{
    "hidden_size": 128, "intermediate_size": 384, "moe_intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
    "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
    "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
    "tie_word_embeddings": True,
})


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ---------------------------------------------------------------- data
def encode_docs(tok, docs, bos, eos):
    out = []
    for d in docs:
        out.append(bos)
        out.extend(tok.encode(d, specials=False))
        out.append(eos)
    return torch.tensor(out, dtype=torch.long)


def load_data(tok_dir, seed):
    tok = Tokenizer.load(os.path.join(tok_dir, "tokenizer.json"))
    bos, eos = tok.added["<|bos|>"], tok.added["<|eos|>"]
    train, val = corpus.split()
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(train), generator=g).tolist()
    train = [train[i] for i in perm]
    return tok, encode_docs(tok, train, bos, eos), encode_docs(tok, val, bos, eos)


def batches(stream, B, T, gen):
    n = stream.numel() - T - 1
    while True:
        off = torch.randint(0, n, (B,), generator=gen)
        x = torch.stack([stream[o:o + T + 1] for o in off.tolist()])
        yield x[:, :-1], x[:, 1:]


def val_windows(stream, T):
    n = (stream.numel() - 1) // T
    x = stream[:n * T + 1]
    return x[:-1].view(n, T), x[1:].view(n, T)


# ---------------------------------------------------------------- model
def init_model(cfg_d, vocab, seed):
    cfg = Config(dict(cfg_d, vocab_size=vocab))
    torch.manual_seed(seed)
    m = DeepseekV3ForCausalLM(cfg)
    for name, p in m.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=0.02)
    return m


@torch.no_grad()
def evaluate(model, vx, vy, bs=16):
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, vx.shape[0], bs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(vx[i:i + bs])
        tot += F.cross_entropy(logits.float().flatten(0, 1), vy[i:i + bs].flatten(), reduction="sum").item()
        n += vy[i:i + bs].numel()
    model.train()
    return tot / n


def update_bias(model, rate=1e-3):
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE) and layer.mlp.gate.e_score_correction_bias is not None:
            load = layer.mlp.last_load.float()
            layer.mlp.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def lr_at(step, total, peak, warm):
    if step < warm:
        return peak * (step + 1) / warm
    p = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def train_one(name, model, data, a, steps, peak_lr, teacher=None):
    tx, vx, vy = data
    state_path = os.path.join(a.work, name + ".state.pt")
    best_path = os.path.join(a.work, name + ".best.pt")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(a.seed + (1 if teacher else 0))
    step, best = 0, float("inf")
    if os.path.exists(state_path) and not a.fresh:
        st = torch.load(state_path)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, best = st["step"], st["best"]
        log("%s: resumed at step %d (best val %.4f)" % (name, step, best))
    for layer in getattr(model, "layers", None) or model.model.layers:  # K3 (train_k3.py): model.layers
        layer.dropout = a.dropout
    it = batches(tx, a.batch, a.ctx, gen)
    model.train()
    t0 = time.time()
    tokens = 0
    while step < steps:
        x, y = next(it)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, a.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
            loss = ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            if teacher is not None:
                with torch.no_grad():
                    tl = teacher(x).float()
                kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(tl, -1),
                              log_target=True, reduction="batchmean") / x.shape[1]
                loss = 0.5 * ce + 0.5 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            update_bias(model)
        step += 1
        tokens += x.numel()
        if step % 25 == 0:
            el = time.time() - t0
            log("%s step %d/%d loss %.4f ce %.4f lr %.2e  %.0f tok/s" % (
                name, step, steps, loss.item(), ce.item(), opt.param_groups[0]["lr"], tokens / el))
        if step % a.eval_every == 0 or step == steps:
            v = evaluate(model, vx, vy)
            improved = v < best
            if improved:
                best = v
                torch.save(model.state_dict(), best_path)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "step": step, "best": best}, state_path)
            log("%s step %d VAL loss %.4f ppl %.2f%s" % (name, step, v, math.exp(v), " (best)" if improved else ""))
    model.eval()
    return best


# ---------------------------------------------------------------- export
def export(model, out, tok_dir, extra=None):
    os.makedirs(out, exist_ok=True)
    ents = []
    for n, t in model.state_dict().items():
        if n.endswith("e_score_correction_bias"):
            ents.append(entry(n, t.float().contiguous()))
        else:
            ents.append(entry(n, t.to(torch.bfloat16).contiguous()))
    write_safetensors(os.path.join(out, "model.safetensors"), ents, {"format": "pt"})
    cfg = dict(model.cfg.raw)
    if extra:
        cfg.update(extra)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, fn), os.path.join(out, fn))


def build(cfg_d, tok, seed):
    return init_model(dict(cfg_d, bos_token_id=tok.added["<|bos|>"], eos_token_id=tok.added["<|eos|>"]),
                      len(tok), seed)


def arg_parser(doc, **defaults):
    """The command line of train.py and train_k3.py; defaults: tokenizer, work, out_target, out_draft,
    dropout."""
    d = dict(tokenizer=os.path.join(ROOT, "checkpoints/tokenizer"), work=os.path.join(ROOT, "checkpoints/train"),
             out_target=os.path.join(ROOT, "models/k3-nano"), out_draft=os.path.join(ROOT, "models/k3-nano-draft"),
             dropout=0.1)
    d.update(defaults)
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=d["tokenizer"])
    ap.add_argument("--work", default=d["work"])
    ap.add_argument("--out-target", default=d["out_target"])
    ap.add_argument("--out-draft", default=d["out_draft"])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--draft-steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--dropout", type=float, default=d["dropout"])
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--fresh", action="store_true", help="ignore saved training state")
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--only", choices=["target", "draft"])
    ap.add_argument("--bench", type=int, default=0, help="time N steps of each model and exit")
    return ap


def bench_steps(a, tx, target, draft):
    """--bench: seconds per training step of each model (the draft's with its teacher's forward)."""
    gen = torch.Generator().manual_seed(0)
    for nm, m, teach in (("target", target, None), ("draft", draft, target)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        it = batches(tx, a.batch, a.ctx, gen)
        for i in range(a.bench + 2):
            if i == 2:
                t0 = time.time()
            x, y = next(it)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())
                if teach is not None:
                    with torch.no_grad():
                        teach(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
        dt = (time.time() - t0) / a.bench
        log("%s: %.3f s/step, %.0f tok/s" % (nm, dt, a.batch * a.ctx / dt))


def train_and_export(a, target, draft, data, export_fn):
    """The target (cross-entropy), then the draft distilled from it, each exported with
    export_fn(model, out, tokenizer_dir) from its best saved weights; --export-only / --only as
    the command line says."""
    t_start = time.time()
    if not a.export_only:
        if a.only != "draft":
            t0 = time.time()
            train_one("target", target, data, a, a.steps, a.lr)
            log("target trained in %.1f min" % ((time.time() - t0) / 60))
        target.load_state_dict(torch.load(os.path.join(a.work, "target.best.pt")))
        export_fn(target, a.out_target, a.tokenizer)
        log("exported", a.out_target)
        if a.only != "target":
            target.eval()
            for p in target.parameters():
                p.requires_grad_(False)
            t0 = time.time()
            train_one("draft", draft, data, a, a.draft_steps, a.draft_lr, teacher=target)
            log("draft trained in %.1f min" % ((time.time() - t0) / 60))
    for nm, m, out in (("target", target, a.out_target), ("draft", draft, a.out_draft)):
        p = os.path.join(a.work, nm + ".best.pt")
        if os.path.exists(p):
            m.load_state_dict(torch.load(p))
            export_fn(m, out, a.tokenizer)
            log("exported", out)
    log("total wall time %.1f min" % ((time.time() - t_start) / 60))


def main():
    a = arg_parser(__doc__).parse_args()
    torch.set_num_threads(1)
    os.makedirs(a.work, exist_ok=True)
    tok, tx, vstream = load_data(a.tokenizer, a.seed)
    vx, vy = val_windows(vstream, a.ctx)
    log("data: train %d tokens, val %d tokens (%d windows of %d), vocab %d" % (
        tx.numel(), vstream.numel(), vx.shape[0], a.ctx, len(tok)))
    target = build(TARGET, tok, a.seed)
    draft = build(DRAFT, tok, a.seed + 1)
    for nm, m in (("target", target), ("draft", draft)):
        tot, act = count_params(m)
        log("%s params: total %d, active per token %d" % (nm, tot, act))
    if a.bench:
        bench_steps(a, tx, target, draft)
        return
    train_and_export(a, target, draft, (tx, vx, vy), export)


if __name__ == "__main__":
    main()
