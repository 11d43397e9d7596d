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
  tools/check_kimi.py [tests/golden/tiny_kimi_linear]
"""
import os
import sys

import torch

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


def check_chunked(model, ids):
    layer = next(l for l in model.model.layers if l.is_kda)
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
    layer = next(l for l in model.model.layers if l.is_kda)
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
        m64 = rk.load_kimi(d, torch.float64)
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
    d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(HERE), "tests/golden/tiny_kimi_linear")
    torch.set_num_threads(4)
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


if __name__ == "__main__":
    main()
