#!/usr/bin/python3
"""Self-checks of tools/reference_model.py (run by hand; not part of CI):
  1. the absorbed MLA decode form (q_nope through W_UK into latent space, attention over the
     cached [latent | k_pe] per token, output latent through W_UV) equals the expanded forward,
     token by token -- this is the form the C++ decode path uses;
  2. RoPE on interleaved pairs equals HF's de-interleave + rotate_half formulation;
  3. group-limited routing changes the expert choice for some tokens in tiny_qlora (so the golden
     test really covers it), and the MTP layer of the checkpoint is ignored.
  tools/check_reference.py [tests/golden/tiny_qlora]
"""
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from reference_model import MoE, load_model, route  # noqa: E402


def absorbed_forward(model, ids):
    """Token-by-token decode with a latent cache; returns logits [T, V]."""
    cfg = model.cfg
    H, nope, rope, vd, R = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
    T = ids.shape[0]
    cos, sin = model.cos_sin(T)
    caches = [[] for _ in model.model.layers]
    out = []
    for t in range(T):
        h = model.model.embed_tokens(ids[t:t + 1]).float()  # [1, D]
        for li, layer in enumerate(model.model.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x))) if cfg.q_lora_rank else a.q_proj(x)
            q = q.view(H, nope + rope)
            q_nope, q_pe = q[:, :nope], q[:, nope:]
            kv = a.kv_a_proj_with_mqa(x)[0]
            c = a.kv_a_layernorm(kv[:R])
            k_pe = kv[R:]

            def rot(v):
                ev, od = v[..., 0::2], v[..., 1::2]
                return torch.stack([ev * cos[t] - od * sin[t], ev * sin[t] + od * cos[t]], -1).flatten(-2)

            caches[li].append(torch.cat([c, rot(k_pe)]))
            cache = torch.stack(caches[li])  # [S, R + rope]
            W = a.kv_b_proj.weight.view(H, nope + vd, R)
            W_UK, W_UV = W[:, :nope, :], W[:, nope:, :]
            q_lat = torch.einsum("hn,hnr->hr", q_nope, W_UK)
            s = q_lat @ cache[:, :R].T + rot(q_pe) @ cache[:, R:].T  # [H, S]
            p = torch.softmax(s * a.scale, -1)
            o_lat = p @ cache[:, :R]  # [H, R]
            o = torch.einsum("hr,hvr->hv", o_lat, W_UV).reshape(1, H * vd)
            h = h + a.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        hn = model.model.norm(h)
        W = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        out.append(F.linear(hn, W)[0])
    return torch.stack(out)


def hf_style_rope(x, cos, sin):
    d = x.shape[-1]
    x = x.view(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(x.shape)
    c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * c + torch.cat([-x2, x1], -1) * s


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(HERE), "tests/golden/tiny_qlora")
    torch.manual_seed(0)
    model = load_model(d)
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (20,))
    with torch.no_grad():
        ref = model(ids)
        ab = absorbed_forward(model, ids)
    err = ((ab - ref).abs().max() / ref.abs().max()).item()
    print("absorbed vs expanded: rel max err %.2e" % err)
    assert err < 1e-5

    from reference_model import apply_rope_interleaved
    cos, sin = model.cos_sin(20)
    q = torch.randn(20, 3, cfg.qk_rope_head_dim)
    k = torch.randn(20, cfg.qk_rope_head_dim)
    mine = torch.einsum("thd,sd->ths", apply_rope_interleaved(q, cos[:, None], sin[:, None]),
                        apply_rope_interleaved(k, cos, sin))
    hf = torch.einsum("thd,sd->ths", hf_style_rope(q, cos[:, None], sin[:, None]), hf_style_rope(k, cos, sin))
    print("rope interleaved vs HF de-interleaved dot products: max err %.2e" % (mine - hf).abs().max())
    assert torch.allclose(mine, hf, atol=1e-5)

    if cfg.topk_method == "noaux_tc" and cfg.n_group > 1:
        x = torch.randn(256, cfg.hidden_size)
        moe = next(l.mlp for l in model.model.layers if isinstance(l.mlp, MoE))
        logits = x @ moe.gate.weight.T
        _, idx = route(cfg, logits, moe.gate.e_score_correction_bias)

        class NoGroups:
            pass
        c2 = NoGroups()
        c2.__dict__.update(cfg.__dict__)
        c2.n_group, c2.topk_group = 1, 1
        _, idx2 = route(c2, logits, moe.gate.e_score_correction_bias)
        diff = (idx.sort(-1)[0] != idx2.sort(-1)[0]).any(-1).float().mean().item()
        print("tokens whose experts change because of group limiting: %.0f%%" % (100 * diff))
        assert diff > 0
    print("ok")


if __name__ == "__main__":
    main()
