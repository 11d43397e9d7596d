#!/usr/bin/python3
"""Self-checks of tools/reference_kimi.py (run by hand; not part of CI):
  1. a chunked KDA form (the WY / UT-transform form prefill kernels use) equals the naive recurrence,
     for chunk sizes 16, 32 and 64, a length that is no multiple of the chunk, and a nonzero
     initial state;
  2. a KDA layer run over a sequence in two pieces, carrying the conv and recurrent state, equals
     one pass; the whole model prefilled over half the tokens and then decoded token by token
     (KDA state + MLA key/value cache) equals the full causal forward;
  3. fp32 against fp64 on the golden input (the rounding floor under the golden's tolerance);
  4. what the golden catches: plausible wrong variants of the semantics (HF's biased routing
     weights, RoPE on the MLA slice, the K3 lower-bound gate, no q scale, conv without SiLU,
     o_norm eps 1e-6, missing shared expert) and how far each moves the logits (each must move
     them by > 1e-2, ten times the tolerance);
  5. the K3 lower-bound gate stays in [lower_bound, 0].
For a Kimi K3 fixture (tests/golden/tiny_k3) the same checks 1-4 on the K3 model (lower-bound gate,
AttnRes, latent MoE, MXFP4 experts), the stored KDA prefill state, the MXFP4 decoder on hand-made
bytes, and the K3 mistakes (AttnRes off or wired differently, wrong gate form, SiLU for SiTU, latent
norm off, MXFP4 nibble order swapped, ...).
  tools/check_kimi.py [tests/golden/tiny_kimi_linear | tests/golden/tiny_k3]   (no argument: both)
"""
import functools
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference_model as rm  # noqa: E402
import reference_kimi as rk  # noqa: E402
from safetensors_io import read_safetensors  # noqa: E402


def kda_chunked(q, k, v, g, beta, S=None, chunk=64):
    """Chunked KDA, same contract as reference_kimi.kda_recurrent. Within a chunk, with G_t the
    cumulative log decay (inclusive) and S0 the state entering the chunk, the delta-rule
    corrections e_t = beta_t (v_t - (decayed S_{t-1})^T k_t) solve the unit lower-triangular system
        e_t + sum_{s<t} A[t,s] e_s = beta_t (v_t - S0^T (exp(G_t) * k_t)),
        A[t,s] = beta_t sum_d k_t[d] k_s[d] exp(G_t[d] - G_s[d]),
    then o_t = S0^T (exp(G_t) * q_t) + sum_{s<=t} (q_t . (exp(G_t - G_s) * k_s)) e_s and
    S_end = exp(G_last) * S0 + sum_s (exp(G_last - G_s) * k_s) e_s^T."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    tr = lambda x: x.transpose(1, 2)  # noqa: E731  [B, T, H, ...] -> [B, H, T, ...]
    q, k, v, g, beta = tr(q), tr(k), tr(v), tr(g), beta.transpose(1, 2)
    S = torch.zeros(B, H, K, V, dtype=q.dtype) if S is None else S.clone()
    out = []
    for t0 in range(0, T, chunk):
        sl = slice(t0, min(T, t0 + chunk))
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        G = g[:, :, sl].cumsum(2)                                     # [B, H, c, K]
        c = G.shape[2]
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]              # [B, H, t, s, K]
        incl = torch.ones(c, c, dtype=torch.bool).tril()              # s <= t
        decay = diff.masked_fill(~incl[:, :, None], float("-inf")).exp()
        A = bc[..., None] * torch.einsum("bhtk,bhsk,bhtsk->bhts", kc, kc, decay)
        A = A.masked_fill(~torch.ones(c, c, dtype=torch.bool).tril(-1), 0.0)
        M = torch.eye(c, dtype=q.dtype) + A
        rhs = bc[..., None] * (vc - torch.einsum("bhtk,bhkv->bhtv", kc * G.exp(), S))
        E = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
        o = (torch.einsum("bhtk,bhkv->bhtv", qc * G.exp(), S)
             + torch.einsum("bhtk,bhsk,bhtsk,bhsv->bhtv", qc, kc, decay, E))
        out.append(o)
        Gl = G[:, :, -1:]                                             # [B, H, 1, K]
        S = Gl[:, :, 0, :, None].exp() * S + torch.einsum("bhsk,bhsv->bhkv", kc * (Gl - G).exp(), E)
    return torch.cat(out, 2).transpose(1, 2), S


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _layers(model):
    return model.layers if isinstance(model, rk.KimiK3ForConditionalGeneration) else model.model.layers


def check_chunked(model, ids):
    layer = next(l for l in _layers(model) if l.is_kda)
    torch.manual_seed(1)
    x = torch.randn(2, 77, model.cfg.hidden_size)
    (q, k, v, g, beta), _ = layer.self_attn.inputs(x)
    S0 = 0.5 * torch.randn(2, q.shape[2], q.shape[3], v.shape[3])
    o_ref, S_ref = rk.kda_recurrent(q, k, v, g, beta, S0)
    worst = 0.0
    for chunk in (16, 32, 64):
        o, S = kda_chunked(q, k, v, g, beta, S0, chunk)
        worst = max(worst, rel(o, o_ref), rel(S, S_ref))
    print("1. chunked (16/32/64, T=77, nonzero S0) vs naive recurrence: rel max err %.2e" % worst)
    assert worst < 1e-5


def check_pieces(model, ids):
    layer = next(l for l in _layers(model) if l.is_kda)
    attn = layer.self_attn
    torch.manual_seed(2)
    x = torch.randn(1, 70, model.cfg.hidden_size)
    with torch.no_grad():
        one = attn(x)
        st = attn.new_state()
        two = torch.cat([attn(x[:, :29], st), attn(x[:, 29:30], st), attn(x[:, 30:], st)], 1)
        st_full = attn.new_state()
        attn(x, st_full)
    e1 = max(rel(two, one), rel(st["recurrent"], st_full["recurrent"]),
             rel(st["conv_q"], st_full["conv_q"]))
    print("2a. KDA layer in pieces (29 + 1 + 40) with carried state vs one pass: rel max err %.2e" % e1)
    assert e1 < 1e-5
    T = ids.shape[0]
    P = T // 2
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        outs = [model(ids[None, :P], cache=cache)[0]]
        for t in range(P, T):
            outs.append(model(ids[None, t:t + 1], cache=cache)[0])
    inc = torch.cat(outs, 0)
    e2 = max(rel(inc[t], full[t]) for t in range(T))
    print("2b. model: prefill %d + %d decode steps vs full forward: worst per-position rel err %.2e"
          % (P, T - P, e2))
    assert e2 < 1e-5
    return e2


def check_fp64(d, ids, ref):
    rm.CD = torch.float64
    try:
        m64 = rm.load_model(d, torch.float64)
        with torch.no_grad():
            l64 = m64(ids)
    finally:
        rm.CD = torch.float32
    e = max(rel(ref[t].double(), l64[t]) for t in range(ids.shape[0]))
    print("3. fp32 golden logits vs fp64 run: worst per-position rel err %.2e" % e)
    return e


def variants(model, ids, ref):
    """Run the model with one piece of the semantics changed; print how far the logits move."""
    cfg = model.cfg
    results = {}

    def run(name, patch, undo):
        patch()
        try:
            with torch.no_grad():
                out = model(ids)
        finally:
            undo()
        e = max(rel(out[t], ref[t]) for t in range(ids.shape[0]))
        flips = int((out.argmax(-1) != ref.argmax(-1)).sum())
        results[name] = (e, flips)
        print("   %-44s worst per-position rel change %.3f, top-1 changed at %d/%d" % (name, e, flips, ids.shape[0]))

    # HF modeling_kimi.py: routing weights from the biased scores
    orig_route = rk.route

    def biased_route(c, logits, bias):
        w, idx = orig_route(c, logits, bias)
        s = logits.sigmoid() + bias.to(rm.CD)[None]
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        return w, idx
    run("HF biased routing weights", lambda: setattr(rk, "route", biased_route),
        lambda: setattr(rk, "route", orig_route))

    # RoPE on the MLA rope slice (mla_use_nope ignored)
    orig_fwd = rk.KimiDecoderLayer.forward
    inv = 1.0 / (10000.0 ** (torch.arange(0, cfg.qk_rope_head_dim, 2, dtype=torch.float32) / cfg.qk_rope_head_dim))

    def rope_fwd(self, h, cache=None):
        if self.is_kda:
            return orig_fwd(self, h, cache)
        ang = torch.outer(torch.arange(h.shape[1], dtype=torch.float32), inv)
        x = self.input_layernorm(h)
        h = h + self.self_attn(x, ang.cos(), ang.sin()).to(rm.CD)
        return h + self.ffn(self.post_attention_layernorm(h)).to(rm.CD)
    run("RoPE applied on MLA (mla_use_nope ignored)", lambda: setattr(rk.KimiDecoderLayer, "forward", rope_fwd),
        lambda: setattr(rk.KimiDecoderLayer, "forward", orig_fwd))

    run("K3 lower-bound gate (-5) instead of softplus", lambda: setattr(cfg, "gate_lower_bound", -5.0),
        lambda: setattr(cfg, "gate_lower_bound", None))

    orig_l2 = rk.l2norm
    calls = {"n": 0}

    def l2_noscale(x, eps=rk.L2NORM_EPS):  # inputs() normalizes q first: undo its K^-0.5 scale
        calls["n"] += 1
        y = orig_l2(x, eps)
        return y * (cfg.kda_head_dim ** 0.5) if calls["n"] % 2 == 1 else y
    run("q not scaled by K^-0.5", lambda: setattr(rk, "l2norm", l2_noscale), lambda: setattr(rk, "l2norm", orig_l2))

    orig_conv = rk.ShortConv.forward

    def conv_plain(self, x, state=None):
        B, T, C = x.shape
        W = self.weight.shape[-1]
        st = torch.zeros(B, W - 1, C, dtype=x.dtype) if state is None else state
        xp = torch.cat([st, x], 1)
        return (xp.unfold(1, W, 1) * self.weight[:, 0, :]).sum(-1), xp[:, T:]
    run("conv without SiLU", lambda: setattr(rk.ShortConv, "forward", conv_plain),
        lambda: setattr(rk.ShortConv, "forward", orig_conv))

    norms = [l.self_attn.o_norm for l in model.model.layers if l.is_kda]
    run("o_norm eps 1e-6 instead of 1e-5", lambda: [setattr(n, "eps", 1e-6) for n in norms],
        lambda: [setattr(n, "eps", rk.KDA_O_NORM_EPS) for n in norms])

    moes = [l.block_sparse_moe for l in model.model.layers if hasattr(l, "block_sparse_moe")]
    saved = [m.shared_experts for m in moes]
    run("shared expert missing", lambda: [setattr(m, "shared_experts", None) for m in moes],
        lambda: [setattr(m, "shared_experts", s) for m, s in zip(moes, saved)])

    rsf = cfg.routed_scaling_factor
    run("routed_scaling_factor not applied", lambda: setattr(cfg, "routed_scaling_factor", 1.0),
        lambda: setattr(cfg, "routed_scaling_factor", rsf))

    mlas = [l.self_attn for l in model.model.layers if not l.is_kda]
    sc = mlas[0].scale
    run("MLA softmax scale nope^-0.5", lambda: [setattr(a, "scale", cfg.qk_nope_head_dim ** -0.5) for a in mlas],
        lambda: [setattr(a, "scale", sc) for a in mlas])

    kdas = [l.self_attn for l in model.model.layers if l.is_kda]
    dtb = [a.dt_bias.data.clone() for a in kdas]
    run("dt_bias not added", lambda: [a.dt_bias.data.zero_() for a in kdas],
        lambda: [a.dt_bias.data.copy_(b) for a, b in zip(kdas, dtb)])

    orig_rec = rk.kda_recurrent

    def no_beta(q, k, v, g, beta, S=None):
        return orig_rec(q, k, v, g, torch.ones_like(beta), S)
    run("beta = 1 (b_proj ignored)", lambda: setattr(rk, "kda_recurrent", no_beta),
        lambda: setattr(rk, "kda_recurrent", orig_rec))
    return results


def main():
    root = os.path.dirname(HERE)
    dirs = sys.argv[1:] or [os.path.join(root, "tests/golden/tiny_kimi_linear"), os.path.join(root, "tests/golden/tiny_k3")]
    torch.set_num_threads(4)
    for d in dirs:
        with open(os.path.join(d, "config.json")) as f:
            if rk.is_k3_config(json.load(f)):
                main_k3(d)
            else:
                main_kimi_linear(d)


def main_kimi_linear(d):
    print("== Kimi Linear:", d)
    model = rk.load_kimi(d)
    g = read_safetensors(os.path.join(d, "golden.safetensors"))[0]
    ids = g["input_ids"][1].long()
    ref = g["logits"][1]
    with torch.no_grad():
        now = model(ids)
    print("0. reference now vs stored golden logits: %.2e" % max(rel(now[t], ref[t]) for t in range(ids.shape[0])))
    check_chunked(model, ids)
    check_pieces(model, ids)
    check_fp64(d, ids, ref)
    orig_rec = rk.kda_recurrent
    for chunk in (16, 64):
        rk.kda_recurrent = lambda q, k, v, g, b, S=None, c=chunk: kda_chunked(q, k, v, g, b, S, c)
        try:
            with torch.no_grad():
                out = model(ids)
        finally:
            rk.kda_recurrent = orig_rec
        print("3b. model with chunked KDA (chunk %d) vs golden logits: worst per-position rel err %.2e"
              % (chunk, max(rel(out[t], ref[t]) for t in range(ids.shape[0]))))
    print("4. variants the golden must catch (tolerance 1e-3 per position):")
    res = variants(model, ids, ref)
    for name, (e, flips) in res.items():
        assert e > 1e-2, name
    lb = -5.0
    raw = 3 * torch.randn(1000, model.cfg.kda_num_heads, model.cfg.kda_head_dim)
    attn = next(l.self_attn for l in model.model.layers if l.is_kda)
    gl = rk.kda_gate(raw, attn.A_log, attn.dt_bias, lb)
    print("5. K3 lower-bound gate range: [%.3f, %.3f] (bound %.1f)" % (gl.min(), gl.max(), lb))
    assert gl.min() >= lb and gl.max() <= 0
    print("ok")


# ================================================================ Kimi K3
def check_mxfp4_decoder():
    """Hand-made bytes against values worked out from the format (not from the encoder)."""
    packed = np.zeros((2, 16), dtype=np.uint8)
    packed[0, 0] = 0x1F      # element 0 = code 0xF (-6), element 1 = code 0x1 (+0.5)
    packed[0, 1] = 0x8A      # element 2 = code 0xA (-1.0), element 3 = code 0x8 (-0)
    packed[1, 15] = 0x70     # element 30 = code 0 (0), element 31 = code 7 (+6)
    scale = np.array([[128], [100]], dtype=np.uint8)
    w = rk.decode_mxfp4(packed, scale)
    assert w.shape == (2, 32)
    assert list(w[0, :4]) == [-12.0, 1.0, -2.0, 0.0] and np.signbit(w[0, 3]) and not w[0, 4:].any()
    assert w[1, 31] == 6.0 * 2.0 ** -27 and not w[1, :31].any()
    big = rk.decode_mxfp4(np.full((1, 16), 0x31, np.uint8), np.array([[254]], np.uint8))
    assert (big[0, 0::2] == 0.5 * 2.0 ** 127).all() and (big[0, 1::2] == 1.5 * 2.0 ** 127).all()  # 2 * 2^127 is inf in fp32
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 64)) * np.exp2(rng.integers(-30, 10, (8, 1)))).astype(np.float32)
    p, sc = rk.encode_mxfp4(x)
    y = rk.decode_mxfp4(p, sc)
    assert np.array_equal(rk.decode_mxfp4(*rk.encode_mxfp4(y)), y)
    rel = np.abs(y - x).max(-1) / np.abs(x).max(-1)
    assert (rel <= 0.25 + 1e-6).all(), rel   # half an e2m1 step at the top of the range, relative to the max
    print("M. MXFP4 decoder: hand-made bytes (nibble order, sign, -0, e8m0 100/128/254) ok; encode/decode "
          "idempotent; quantization error <= %.3f of the group max" % rel.max())


def check_k3_stored_state(model, ids, d):
    g = read_safetensors(os.path.join(d, "golden_decode.safetensors"))
    dec, meta = g[0], json.loads(g[1]["meta"])
    P = meta["prefill_len"]
    cache = model.new_cache()
    with torch.no_grad():
        model(ids[None, :P], cache=cache)
    worst = 0.0
    for i, l in enumerate(model.layers):
        if l.is_kda:
            for key in ("recurrent", "conv_q", "conv_k", "conv_v"):
                worst = max(worst, rel(cache[i][key][0], dec["state.prefill.layer%d.%s" % (i, key)][1]))
    print("2c. KDA state after a %d-token prefill vs golden_decode.safetensors: rel max err %.2e" % (P, worst))
    assert worst < 1e-5


def check_k3_mla(model):
    """K3MLA (mla_attend over an explicit key/value cache) against the shared DeepSeek Attention with
    identity rotation (cos 1, sin 0), gated by sigmoid(g_proj(x)) outside it."""
    torch.manual_seed(3)
    worst = 0.0
    for layer in model.layers:
        if layer.is_kda:
            continue
        at = layer.self_attn
        x = torch.randn(2, 33, model.cfg.hidden_size)
        one = torch.ones(33, model.cfg.qk_rope_head_dim // 2)
        with torch.no_grad():
            gate = torch.sigmoid(at.g_proj(x))
            saved = at.o_proj

            class Capture(torch.nn.Module):   # the attention output before o_proj
                def forward(self, y):
                    self.y = y
                    return y
            at.o_proj = cap = Capture()
            try:
                rm.Attention.forward(at, x, one, torch.zeros_like(one))
            finally:
                at.o_proj = saved
            want = at.o_proj(cap.y * gate)
            worst = max(worst, rel(at(x), want))
    print("2d. K3 MLA (cached form, q-LoRA, output gate) vs the shared DeepSeek Attention: rel max err %.2e" % worst)
    assert worst < 1e-5


def k3_variants(model, d, ids, ref):
    """The K3 model with one piece of the semantics changed; how far the logits move."""
    cfg = model.cfg
    T = ids.shape[0]
    results = {}

    def measure(name, out):
        e = max(rel(out[t], ref[t]) for t in range(T))
        flips = int((out.argmax(-1) != ref.argmax(-1)).sum())
        results[name] = (e, flips)
        print("   %-58s worst per-position rel change %.3f, top-1 changed at %d/%d" % (name, e, flips, T))

    def run(name, patch, undo, m=None):
        patch()
        try:
            with torch.no_grad():
                out = (m or model)(ids)
        finally:
            undo()
        measure(name, out)

    def swap(obj, attr, value):
        old = getattr(obj, attr)
        return (lambda: setattr(obj, attr, value)), (lambda: setattr(obj, attr, old))

    # --- AttnRes
    def plain_sum(rows, norm, proj):
        return sum(r.to(rm.CD) for r in rows)
    run("AttnRes off (plain residual: sum of bank + P)", *swap(rk, "attn_res_mix", plain_sum))

    def no_rms(rows, norm, proj):
        v = torch.stack([r.to(rm.CD) for r in rows], dim=-2)
        p = torch.softmax(F.linear(v * norm.weight.to(rm.CD), proj.weight.to(rm.CD))[..., 0], -1)
        return (p[..., None] * v).sum(-2)
    run("AttnRes score without the RMS normalization", *swap(rk, "attn_res_mix", no_rms))

    def normed_sum(rows, norm, proj):
        v = torch.stack([r.to(rm.CD) for r in rows], dim=-2)
        nv = norm(v)
        p = torch.softmax(F.linear(nv, proj.weight.to(rm.CD))[..., 0], -1)
        return (p[..., None] * nv).sum(-2)
    run("AttnRes weighted sum of the normed rows", *swap(rk, "attn_res_mix", normed_sum))

    def no_norm_weight(rows, norm, proj):
        v = torch.stack([r.to(rm.CD) for r in rows], dim=-2)
        k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps)
        p = torch.softmax(F.linear(k, proj.weight.to(rm.CD))[..., 0], -1)
        return (p[..., None] * v).sum(-2)
    run("AttnRes score without the <site>_res_norm weight", *swap(rk, "attn_res_mix", no_norm_weight))

    orig_fwd = rk.K3DecoderLayer.forward

    # (Writing the bank row before the attention-side mix, so that the mix sees bank + [P] + [0], is
    # NOT a detectable mistake: the zero row scores 0 and adds nothing, it only rescales the mix by
    # a per-token scalar, which input_layernorm removes up to its eps. Either order is correct.)
    def no_restart(self, bank, P, cache=None):
        x = self.input_layernorm(rk.attn_res_mix(bank + [P], self.self_attention_res_norm, self.self_attention_res_proj))
        if self.i % self.cfg.attn_res_block_size == 0:
            bank.append(P)
        P = P + self.self_attn(x, cache).to(rm.CD)
        y = self.post_attention_layernorm(rk.attn_res_mix(bank + [P], self.mlp_res_norm, self.mlp_res_proj))
        return P + self.ffn(y).to(rm.CD)
    run("AttnRes: P not restarted at the bank write", *swap(rk.K3DecoderLayer, "forward", no_restart))

    def write_at_end(self, bank, P, cache=None):
        x = self.input_layernorm(rk.attn_res_mix(bank + [P], self.self_attention_res_norm, self.self_attention_res_proj))
        P = P + self.self_attn(x, cache).to(rm.CD)
        y = self.post_attention_layernorm(rk.attn_res_mix(bank + [P], self.mlp_res_norm, self.mlp_res_proj))
        P = P + self.ffn(y).to(rm.CD)
        if self.i % self.cfg.attn_res_block_size == 0:
            bank.append(P)
            P = torch.zeros_like(P)
        return P
    run("AttnRes: bank write at the end of the write layer", *swap(rk.K3DecoderLayer, "forward", write_at_end))

    def emb_not_banked(self, bank, P, cache=None):
        x = self.input_layernorm(rk.attn_res_mix(bank + [P], self.self_attention_res_norm, self.self_attention_res_proj))
        if self.i > 0 and self.i % self.cfg.attn_res_block_size == 0:
            bank.append(P)
            P = torch.zeros_like(P)
        P = P + self.self_attn(x, cache).to(rm.CD)
        y = self.post_attention_layernorm(rk.attn_res_mix(bank + [P], self.mlp_res_norm, self.mlp_res_proj))
        return P + self.ffn(y).to(rm.CD)
    run("AttnRes: embedding not a bank row (first write at layer B)", *swap(rk.K3DecoderLayer, "forward", emb_not_banked))

    def ungated_input(self, bank, P, cache=None):
        mix = rk.attn_res_mix(bank + [P], self.self_attention_res_norm, self.self_attention_res_proj)
        x = self.input_layernorm(mix)
        if self.i % self.cfg.attn_res_block_size == 0:
            bank.append(P)
            P = torch.zeros_like(P)
        if self.is_kda:
            a = self.self_attn(x, cache)
        else:
            at = self.self_attn
            o = rk.mla_attend(at, x, {})
            a = at.o_proj(o * torch.sigmoid(at.g_proj(mix).to(rm.CD)))
        P = P + a.to(rm.CD)
        y = self.post_attention_layernorm(rk.attn_res_mix(bank + [P], self.mlp_res_norm, self.mlp_res_proj))
        return P + self.ffn(y).to(rm.CD)
    run("MLA output gate fed the un-normed mix (not the layer input)", *swap(rk.K3DecoderLayer, "forward", ungated_input))

    orig_model_fwd = rk.KimiK3ForConditionalGeneration.forward

    def no_output_mix(self, ids, return_hidden=False, cache=None, return_mix=False):
        m = self.language_model.model
        P = m.embed_tokens(ids[None]).to(rm.CD)
        bank = []
        for layer in m.layers:
            P = layer(bank, P, None)
        return F.linear(m.norm(P), self.language_model.lm_head.weight.to(rm.CD))[0]
    run("final norm of P (output-side mix skipped)", *swap(rk.KimiK3ForConditionalGeneration, "forward", no_output_mix))

    # --- KDA
    run("KDA gate: Kimi Linear softplus form instead of the lower bound", *swap(cfg, "gate_lower_bound", None))
    orig_gate = rk.kda_gate

    def per_channel(raw, A_log, dt_bias, lower_bound=None):
        H, K = raw.shape[-2:]
        g = raw + dt_bias.view(H, K).to(raw.dtype)
        return float(lower_bound) * torch.sigmoid(A_log.reshape(-1)[:K].to(raw.dtype).exp().view(1, K) * g)
    run("KDA A_log read per channel ([head_dim]) instead of per head", *swap(rk, "kda_gate", per_channel))
    run("KDA gate lower bound -1 instead of -5", *swap(cfg, "gate_lower_bound", -1.0))

    kdas = [l.self_attn for l in model.layers if l.is_kda]
    orig_out = rk.KimiDeltaAttention.output

    def ungated_out(self, x, o):
        B, T_, H, K = o.shape
        return self.o_proj(self.o_norm(o).reshape(B, T_, H * K))
    run("KDA output gate sigmoid(g_proj(x)) dropped", *swap(rk.KimiDeltaAttention, "output", ungated_out))

    # --- MLA
    mlas = [l.self_attn for l in model.layers if not l.is_kda]
    orig_mla_fwd = rk.K3MLA.forward
    run("MLA output gate dropped", *swap(rk.K3MLA, "forward", lambda self, x, cache=None: self.o_proj(rk.mla_attend(self, x, {}))))
    sc = mlas[0].scale
    run("MLA softmax scale nope^-0.5",
        lambda: [setattr(a, "scale", cfg.qk_nope_head_dim ** -0.5) for a in mlas],
        lambda: [setattr(a, "scale", sc) for a in mlas])

    # --- MLP / MoE
    orig_situ = rk.situ
    run("SiLU instead of SiTU (every MLP)", *swap(rk, "situ", lambda g, u, b, lb: F.silu(g.to(rm.CD)) * u.to(rm.CD)))
    run("SiTU without the up-branch clamp (linear_beta ignored)",
        *swap(rk, "situ", lambda g, u, b, lb: orig_situ(g, u, b, None)))
    run("SiTU betas swapped (4 <-> 25)", *swap(rk, "situ", lambda g, u, b, lb: orig_situ(g, u, lb, b)))
    run("latent routed_expert_norm off", *swap(cfg, "latent_moe_use_norm", False))
    moes = [l.block_sparse_moe for l in model.layers if hasattr(l, "block_sparse_moe")]
    saved = [m.shared_experts for m in moes]

    class Zero(torch.nn.Module):
        def forward(self, x):
            return torch.zeros_like(x)
    run("shared experts missing",
        lambda: [setattr(m, "shared_experts", Zero()) for m in moes],
        lambda: [setattr(m, "shared_experts", s) for m, s in zip(moes, saved)])
    orig_route = rk.route

    def biased_route(c, logits, bias):
        w, idx = orig_route(c, logits, bias)
        s = logits.sigmoid() + bias.to(rm.CD)[None]
        w = s.gather(1, idx)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor, idx
    run("routing weights from the biased scores (Kimi Linear HF code)", *swap(rk, "route", biased_route))

    # --- MXFP4 storage
    for name, dec in (("MXFP4 nibble order swapped (2j in the high nibble)", functools.partial(rk.decode_mxfp4, swap_nibbles=True)),
                      ("MXFP4 e8m0 bias 128 instead of 127", functools.partial(rk.decode_mxfp4, e8m0_bias=128))):
        with torch.no_grad():
            measure(name, rk.load_k3(d, decode=dec)(ids))
    return results


def main_k3(d):
    print("== Kimi K3:", d)
    check_mxfp4_decoder()
    model = rk.load_k3(d)
    g = read_safetensors(os.path.join(d, "golden.safetensors"))[0]
    ids = g["input_ids"][1].long()
    ref = g["logits"][1]
    with torch.no_grad():
        now, hidden = model(ids, return_hidden=True)
    eh = max(rel(h, g["hidden.layer%d" % i][1]) for i, h in enumerate(hidden))
    print("0. reference now vs stored golden: logits %.2e, hidden %.2e"
          % (max(rel(now[t], ref[t]) for t in range(ids.shape[0])), eh))
    check_chunked(model, ids)
    check_pieces(model, ids)
    check_k3_stored_state(model, ids, d)
    check_k3_mla(model)
    check_fp64(d, ids, ref)
    orig_rec = rk.kda_recurrent
    for chunk in (16, 32):
        rk.kda_recurrent = lambda q, k, v, g_, b, S=None, c=chunk: kda_chunked(q, k, v, g_, b, S, c)
        try:
            with torch.no_grad():
                out = model(ids)
        finally:
            rk.kda_recurrent = orig_rec
        print("3b. model with chunked KDA (chunk %d) vs golden logits: worst per-position rel err %.2e"
              % (chunk, max(rel(out[t], ref[t]) for t in range(ids.shape[0]))))
    print("4. K3 variants the golden must catch (tolerance 1e-3 per position):")
    res = k3_variants(model, d, ids, ref)
    for name, (e, flips) in res.items():
        assert e > 1e-2, name
    print("ok")


if __name__ == "__main__":
    main()
