#!/usr/bin/python3
"""Trains K3-shaped shipped models (Kimi K3's text architecture, `KimiK3ForConditionalGeneration`:
hybrid KDA + gated NoPE MLA 3:1, attention residuals, SiTU, latent MoE with MXFP4 routed experts)
with the PyTorch reference (tools/reference_kimi.py) on the fortune corpus, with the k3-nano
tokenizer. The loop, data, schedule and distillation are tools/train.py's; this file adds the
architecture, the MXFP4 quantization-aware training of the routed experts, and the export in K3's
checkpoint layout (language_model.*, experts as compressed-tensors weight_packed + weight_scale).

  /usr/bin/python3 tools/train_k3.py --work checkpoints/train-k3 --steps 800 --draft-steps 400 \\
      --out-target checkpoints/k3-nano-k3 --out-draft checkpoints/k3-nano-k3-draft --fresh
  /usr/bin/python3 tools/train_k3.py --bench 3        # seconds per step of each model

Routed experts train through a fake MXFP4 quantizer (straight-through gradient): the forward uses
the weights rounded exactly as the exporter will store them (per 32-element group the smallest
e8m0 exponent with max|w| / 2^e <= 6, nearest e2m1 value), so the shipped MXFP4 model is the one
that was evaluated. (K3's own experts are MXFP4 QAT as well.)
"""
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import reference_kimi as rk  # noqa: E402
import train as base  # noqa: E402
from make_checkpoint import F32_KINDS, PRESETS, draw, k3_tensor_specs  # noqa: E402
from safetensors_io import entry, write_safetensors  # noqa: E402


def k3_config(text):
    """A top-level K3 config.json (tiny_k3's keys: auto_map, vision_config, the MXFP4
    quantization_config) with these text_config values."""
    d = json.loads(json.dumps(PRESETS["tiny_k3"]))
    d["text_config"].update(text)
    return d


# k3-nano in K3's architecture: 12 heads (KDA and MLA), 3 KDA layers then 1 MLA (K3's 3:1 with the
# last layer MLA), AttnRes blocks of 2, the first layer dense, latent MoE (256 -> 128) with 16
# routed MXFP4 experts (4 active) + 1 shared. ~8.4M parameters, like the DeepSeek-V3-shaped k3-nano.
TARGET = {
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
    "linear_attn_config": {"full_attn_layers": [4], "gate_lower_bound": -5.0, "head_dim": 32,
                           "kda_layers": [1, 2, 3], "num_heads": 12, "short_conv_kernel_size": 4,
                           "use_full_rank_gate": True},
    "num_attention_heads": 12, "num_key_value_heads": 12, "q_lora_rank": 128, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "attn_res_block_size": 2, "first_k_dense_replace": 1,
    "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 1, "moe_intermediate_size": 128,
    "routed_expert_hidden_size": 128, "routed_scaling_factor": 1.0,
    "max_position_embeddings": 4096,
}

# The draft: the same architecture, a quarter of the width: 1 KDA + 1 MLA layer.
DRAFT = {
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
    "linear_attn_config": {"full_attn_layers": [2], "gate_lower_bound": -5.0, "head_dim": 32,
                           "kda_layers": [1], "num_heads": 4, "short_conv_kernel_size": 4,
                           "use_full_rank_gate": True},
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "attn_res_block_size": 2, "first_k_dense_replace": 1,
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 64,
    "routed_expert_hidden_size": 64, "routed_scaling_factor": 1.0,
    "max_position_embeddings": 4096,
}

E2M1 = torch.tensor(rk.E2M1_VALUES)


def fake_mxfp4(w):
    """w [out, in] -> w rounded to MXFP4 as encode_mxfp4 stores it, with a straight-through gradient."""
    with torch.no_grad():
        o, n = w.shape
        g = w.detach().float().view(o, n // 32, 32)
        amax = g.abs().amax(-1, keepdim=True)
        e = torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / 6.0))
        e = e + (amax / torch.exp2(e) > 6.0).float() - (amax / torch.exp2(e - 1) <= 6.0).float()
        s = torch.exp2(e)
        a = g.abs() / s
        idx = (a[..., None] - E2M1).abs().argmin(-1)
        q = (E2M1[idx] * torch.sign(g) * s).view(o, n).to(w.dtype)
    return w + (q - w).detach()


def kda_recurrent_train(q, k, v, g, beta, S=None):
    """reference_kimi.kda_recurrent's recurrence for training: the same arithmetic, with the decays
    and beta * k computed once for all steps and the outputs stacked at the end (assigning o[:, t]
    in place made autograd copy the whole [B, T, H, V] output at every step: 5x slower)."""
    B, T, H, K = q.shape
    if S is None:
        S = torch.zeros(B, H, K, v.shape[-1], dtype=q.dtype, device=q.device)
    decay = g.exp()[..., None]                                         # [B, T, H, K, 1]
    bk = beta[..., None] * k                                           # [B, T, H, K]
    outs = []
    for t in range(T):
        S = S * decay[:, t]
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)      # v - S^T k
        S = S + torch.einsum("bhk,bhv->bhkv", bk[:, t], err)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), S


def short_conv_train(self, x, state=None):
    """reference_kimi.ShortConv.forward as one depthwise conv1d (the reference's unfold-and-sum
    form is the oracle; this is the same cross-correlation, ~10x faster in training)."""
    B, T, C = x.shape
    W = self.weight.shape[-1]
    if state is None:
        state = torch.zeros(B, W - 1, C, dtype=x.dtype, device=x.device)
    xp = torch.cat([state.to(x.dtype), x], dim=1)                     # [B, W-1+T, C]
    y = F.conv1d(xp.transpose(1, 2), self.weight.to(x.dtype), groups=C).transpose(1, 2)
    return F.silu(y), xp[:, T:, :]


def check_training_forms():
    """The training forms above against the reference's own (run before every training)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 2, 9, 3, 8
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, K), rk.l2norm(r(B, T, H, K)), r(B, T, H, K)
    g, beta, S0 = -torch.rand(B, T, H, K, generator=gen), torch.rand(B, T, H, generator=gen), r(B, H, K, K)
    for want, got in zip(rk.kda_recurrent(q, k, v, g, beta, S0), kda_recurrent_train(q, k, v, g, beta, S0)):
        assert (want - got).abs().max() < 1e-5, "kda_recurrent_train disagrees with reference_kimi.kda_recurrent"
    conv = rk.ShortConv(6, 4)
    conv.weight.data = r(6, 1, 4)
    x, state = r(2, 7, 6), r(2, 3, 6)
    for st in (None, state):
        for want, got in zip(rk.ShortConv.forward(conv, x, st), short_conv_train(conv, x, st)):
            assert (want - got).abs().max() < 1e-5, "short_conv_train disagrees with reference_kimi.ShortConv"
    # the QAT rounding is the exporter's: fake_mxfp4(w) == decode(encode(w))
    w = 0.05 * r(4, 64)
    stored = torch.from_numpy(rk.decode_mxfp4(*rk.encode_mxfp4(w.numpy())))
    assert torch.equal(fake_mxfp4(w), stored), "fake_mxfp4 disagrees with encode_mxfp4 + decode_mxfp4"


def qat_expert_forward(self, z):
    w1, w3, w2 = fake_mxfp4(self.w1.weight), fake_mxfp4(self.w3.weight), fake_mxfp4(self.w2.weight)
    a = rk.situ(F.linear(z, w1), F.linear(z, w3), self.cfg.situ_beta, self.cfg.situ_linear_beta)
    return F.linear(a.to(w2.dtype), w2)


def build(text, tok, seed):
    d = k3_config(dict(text, vocab_size=len(tok), bos_token_id=tok.added["<|bos|>"],
                       eos_token_id=tok.added["<|eos|>"], pad_token_id=tok.added["<|eos|>"]))
    d.update(bos_token_id=tok.added["<|bos|>"], eos_token_id=tok.added["<|eos|>"], pad_token_id=tok.added["<|eos|>"])
    cfg = rk.K3Config(d)
    model = rk.KimiK3ForConditionalGeneration(cfg)
    # make_checkpoint's initial values per tensor kind (KDA decay and gate ranges, norms near 1),
    # matrices N(0, 0.02)
    gen = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    for name, shape, kind in k3_tensor_specs(cfg):
        v = draw(gen, shape, "linear" if kind == "mxfp4" else kind, "0.02", cfg.kda_num_heads)
        if kind in ("norm", "norm_f32"):
            v = torch.ones(shape)
        elif kind == "bias":  # e_score_correction_bias: balancing moves it from 0
            v = torch.zeros(shape)
        sd[name] = v.view(sd[name].shape)
    model.load_state_dict(sd)
    model.cfg_dict = d
    return model


def update_bias(model, rate=1e-3):
    """noaux_tc's aux-loss-free balancing (tools/train.py) from the experts each K3MoE chose."""
    for layer in model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None or moe.last_idx is None:
            continue
        load = torch.bincount(moe.last_idx.flatten(), minlength=moe.cfg.num_experts).float()
        moe.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def export(model, out, tok_dir):
    os.makedirs(out, exist_ok=True)
    sd = model.state_dict()
    ents = []
    for name, shape, kind in k3_tensor_specs(model.cfg):
        t = sd[name].detach().float().reshape(shape)
        if kind in F32_KINDS:
            ents.append(entry(name, t.contiguous()))
        elif kind == "mxfp4":
            packed, scale = rk.encode_mxfp4(t.numpy())
            ents.append(entry(name + "_packed", torch.from_numpy(packed)))
            ents.append(entry(name + "_scale", torch.from_numpy(scale)))
        else:
            ents.append(entry(name, t.to(torch.bfloat16).contiguous()))
    for fn in os.listdir(out):
        if fn.endswith(".safetensors"):
            os.remove(os.path.join(out, fn))
    write_safetensors(os.path.join(out, "model.safetensors"), ents, {"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(model.cfg_dict, f, indent=2)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, fn), os.path.join(out, fn))


def main():
    ap = base.arg_parser(__doc__, tokenizer=os.path.join(ROOT, "models/k3-nano"),
                         work=os.path.join(ROOT, "checkpoints/train-k3"),
                         out_target=os.path.join(ROOT, "checkpoints/k3-nano-k3"),
                         out_draft=os.path.join(ROOT, "checkpoints/k3-nano-k3-draft"), dropout=0.0)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    check_training_forms()
    rk.K3Expert.forward = qat_expert_forward
    rk.kda_recurrent = kda_recurrent_train
    rk.ShortConv.forward = short_conv_train
    base.update_bias = update_bias
    os.makedirs(a.work, exist_ok=True)
    tok, tx, vstream = base.load_data(a.tokenizer, a.seed)
    vx, vy = base.val_windows(vstream, a.ctx)
    base.log("data: train %d tokens, val %d tokens (%d windows of %d), vocab %d" % (
        tx.numel(), vstream.numel(), vx.shape[0], a.ctx, len(tok)))
    target = build(TARGET, tok, a.seed)
    draft = build(DRAFT, tok, a.seed + 1)
    for nm, m in (("target", target), ("draft", draft)):
        base.log("%s params: %d" % (nm, sum(p.numel() for p in m.parameters())))
    if a.bench:
        base.bench_steps(a, tx, target, draft)
        return
    base.train_and_export(a, target, draft, (tx, vx, vy), export)


if __name__ == "__main__":
    main()
