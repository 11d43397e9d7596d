#!/usr/bin/python3
"""PyTorch reference of the DeepSeek-V3 / DeepSeek-V2 / Kimi K2 architecture (MLA + MoE).

Written from the published architecture description; parameter names are exactly the Hugging Face
checkpoint tensor names, so `state_dict()` round-trips with config.json + safetensors checkpoints.
This file is the oracle for moat's golden tests and the model used by the trainer: the C++ forward
pass implements exactly the math here.

Math summary (all compute in fp32; weights are bf16 in checkpoints and upcast to fp32):
  * RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * weight.
  * h = embed(ids); per layer: h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h));
    logits = lm_head(norm(h)) (embed_tokens.weight when tie_word_embeddings).
  * MLA: q = q_b_proj(q_a_layernorm(q_a_proj(x))) if q_lora_rank else q_proj(x), viewed
    [T, H, nope + rope] -> (q_nope, q_pe). kv = kv_a_proj_with_mqa(x) = [c | k_pe] with
    c = kv_a_layernorm(kv[:, :kv_lora_rank]) and k_pe [T, rope] shared by all heads.
    kv_b_proj(c) viewed [T, H, nope + v] -> (k_nope, value).
    RoPE on INTERLEAVED pairs (x[2i], x[2i+1]) by angle pos * inv_freq[i]:
    (a cos - b sin, a sin + b cos) written back to positions 2i, 2i+1. (HF's modeling code
    de-interleaves q_pe/k_pe first; dot products are identical.)
    scores = [q_nope, q_pe] . [k_nope, k_pe] * softmax_scale, causal, softmax fp32, @ value,
    [T, H * v] -> o_proj.
  * softmax_scale = (nope + rope)^-0.5, times m^2 with m = 0.1 * mscale_all_dim * ln(factor) + 1
    when rope_scaling (yarn) has mscale_all_dim and factor > 1.
  * YaRN inv_freq and cos/sin multiplier: see `rope_inv_freq`.
  * Dense MLP: down(silu(gate(x)) * up(x)).
  * MoE routing: see `route`. Ties in every top-k (groups and experts) are broken by the LOWER
    index (a stable descending sort), which is what a deterministic implementation should do.
    out = sum_k w_k * expert_k(x) + shared_experts(x) (shared is one MLP of width
    n_shared_experts * moe_intermediate_size, unscaled).
"""
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

# Compute dtype of the reference: fp32 (set to torch.float64 only for precision self-checks).
CD = torch.float32

DEFAULTS = dict(
    q_lora_rank=None, n_shared_experts=None, n_routed_experts=None, num_experts_per_tok=None,
    n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
    routed_scaling_factor=1.0, first_k_dense_replace=0, moe_layer_freq=1, rope_theta=10000.0,
    rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=0,
)


class Config:
    def __init__(self, d):
        self.raw = dict(d)
        for k, v in DEFAULTS.items():
            setattr(self, k, v)
        for k, v in d.items():
            setattr(self, k, v)
        assert self.moe_layer_freq == 1

    @staticmethod
    def load(path):
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return Config(json.load(f))

    def is_moe_layer(self, i):
        return (self.n_routed_experts is not None and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)


# ---------------------------------------------------------------- RoPE
def _yarn_find_dim(num_rot, dim, base, max_pos):
    return (dim * math.log(max_pos / (num_rot * 2 * math.pi))) / (2 * math.log(base))


def get_mscale(factor, mscale=1.0):
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_inv_freq(cfg):
    """Returns (inv_freq fp32 [rope/2], cos_sin_multiplier float)."""
    dim, base = cfg.qk_rope_head_dim, float(cfg.rope_theta)
    expo = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    freq_extra = 1.0 / (base ** expo)
    rs = cfg.rope_scaling
    if not rs:
        return freq_extra, 1.0
    typ = rs.get("type", rs.get("rope_type"))
    assert typ == "yarn", rs
    factor = float(rs["factor"])
    orig = rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast", 32), rs.get("beta_slow", 1)
    mscale, mscale_all = rs.get("mscale", 1), rs.get("mscale_all_dim", 0)
    freq_inter = 1.0 / (factor * base ** expo)
    low = max(math.floor(_yarn_find_dim(beta_fast, dim, base, orig)), 0)
    high = min(math.ceil(_yarn_find_dim(beta_slow, dim, base, orig)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    mask = 1.0 - ramp
    inv_freq = freq_inter * (1 - mask) + freq_extra * mask
    m = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
    return inv_freq, float(m)


def softmax_scale(cfg):
    s = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling
    if rs and rs.get("mscale_all_dim"):
        m = get_mscale(float(rs["factor"]), rs["mscale_all_dim"])
        s = s * m * m
    return s


def apply_rope_interleaved(x, cos, sin):
    """x [..., T, (H,) rope]; cos/sin [T, rope/2] broadcast over the head dim by the caller."""
    a, b = x[..., 0::2], x[..., 1::2]
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    return torch.stack([ra, rb], dim=-1).flatten(-2)


# ---------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        x = x.to(CD)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(CD)


def _lin(i, o):
    return nn.Linear(i, o, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _lin(hidden, inter), _lin(hidden, inter), _lin(inter, hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg
        self.cfg = c
        H, D = c.num_attention_heads, c.hidden_size
        self.qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank:
            self.q_a_proj = _lin(D, c.q_lora_rank)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = _lin(c.q_lora_rank, H * self.qk_head)
        else:
            self.q_proj = _lin(D, H * self.qk_head)
        self.kv_a_proj_with_mqa = _lin(D, c.kv_lora_rank + c.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = _lin(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = _lin(H * c.v_head_dim, D)
        self.scale = softmax_scale(c)

    def forward(self, x, cos, sin):
        # x [B, T, D]; cos/sin [T, rope/2]
        c = self.cfg
        B, T, _ = x.shape
        H, nope, rope, vd = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        if c.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(B, T, H, nope + rope)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., :c.kv_lora_rank])
        k_pe = kv[..., c.kv_lora_rank:]  # [B, T, rope]
        kvb = self.kv_b_proj(latent).view(B, T, H, nope + vd)
        k_nope, value = kvb[..., :nope], kvb[..., nope:]
        q_pe = apply_rope_interleaved(q_pe.to(CD), cos[:, None, :], sin[:, None, :])
        k_pe = apply_rope_interleaved(k_pe.to(CD), cos, sin)
        # scores [B, H, T, S] = [q_nope | q_pe] . [k_nope | k_pe (shared by all heads)]
        query = torch.cat([q_nope.to(CD), q_pe], dim=-1)
        key = torch.cat([k_nope.to(CD), k_pe[:, :, None, :].expand(B, T, H, rope)], dim=-1)
        s = torch.einsum("bthd,bshd->bhts", query, key)
        causal = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        s = s.to(CD) * self.scale + causal
        p = torch.softmax(s, dim=-1, dtype=CD)
        o = torch.einsum("bhts,bshd->bthd", p.to(value.dtype), value).reshape(B, T, H * vd)
        return self.o_proj(o)


class Gate(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        else:
            self.e_score_correction_bias = None


def _topk_idx(x, k):
    """Indices of the k largest along the last dim, ties -> lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True)[1][..., :k]


def route(cfg, logits, bias):
    """logits fp32 [N, E] -> (weights [N, k] fp32, expert ids [N, k] int64)."""
    k = cfg.num_experts_per_tok
    if cfg.scoring_func == "sigmoid":
        s = logits.sigmoid()
    elif cfg.scoring_func == "softmax":
        s = logits.softmax(dim=-1)
    else:
        raise ValueError(cfg.scoring_func)
    if cfg.topk_method == "noaux_tc":
        N, E = s.shape
        G = cfg.n_group
        sc = s.detach() + bias.to(CD)[None, :]
        grp = sc.view(N, G, E // G)
        gscore = torch.sort(grp, dim=-1, descending=True)[0][..., :2].sum(-1)  # [N, G]
        gidx = _topk_idx(gscore, cfg.topk_group)
        gmask = torch.zeros(N, G, dtype=torch.bool, device=s.device).scatter_(1, gidx, True)
        emask = gmask[:, :, None].expand(N, G, E // G).reshape(N, E)
        idx = _topk_idx(sc.masked_fill(~emask, float("-inf")), k)
    elif cfg.topk_method == "greedy":
        idx = _topk_idx(s.detach(), k)
    else:
        raise ValueError(cfg.topk_method)
    w = s.gather(1, idx)
    if cfg.norm_topk_prob and k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    return w, idx


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList([MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                      for _ in range(cfg.n_routed_experts)])
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        else:
            self.shared_experts = None
        self.last_load = None  # [E] tokens routed to each expert in the last forward (for training)

    def forward(self, x):
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        logits = F.linear(xf.to(CD), self.gate.weight.to(CD))
        w, idx = route(self.cfg, logits, self.gate.e_score_correction_bias)
        out = torch.zeros(xf.shape, dtype=CD, device=x.device)
        E = self.cfg.n_routed_experts
        self.last_load = torch.bincount(idx.flatten(), minlength=E).detach()
        for e in range(E):
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.experts[e](xf[rows])
            out = out.index_add(0, rows, y.to(CD) * w[rows, slot][:, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(xf).to(CD)
        return out.view(shp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.dropout = 0.0  # residual-branch dropout, training only (not part of the architecture)

    def forward(self, h, cos, sin):
        a = self.self_attn(self.input_layernorm(h), cos, sin).to(CD)
        if self.training and self.dropout > 0:
            a = F.dropout(a, self.dropout)
        h = h + a
        m = self.mlp(self.post_attention_layernorm(h)).to(CD)
        if self.training and self.dropout > 0:
            m = F.dropout(m, self.dropout)
        return h + m


class Inner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = Inner(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else _lin(cfg.hidden_size, cfg.vocab_size)
        inv, m = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_mscale = m

    def cos_sin(self, T, device=None):
        pos = torch.arange(T, dtype=torch.float32, device=device)
        ang = torch.outer(pos, self.inv_freq.to(device))
        return ang.cos() * self.rope_mscale, ang.sin() * self.rope_mscale

    def forward(self, ids, return_hidden=False, return_final=False):
        """ids [B, T] or [T] int64 -> logits fp32 [B, T, V] (and the residual stream after
        each decoder layer when return_hidden; the final normed hidden state, what MTP reads,
        when return_final)."""
        squeeze = ids.dim() == 1
        if squeeze:
            ids = ids[None]
        cos, sin = self.cos_sin(ids.shape[1], ids.device)
        h = self.model.embed_tokens(ids).to(CD)
        hidden = []
        for layer in self.model.layers:
            h = layer(h, cos, sin)
            if return_hidden:
                hidden.append(h)
        h = self.model.norm(h)
        W = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, W).to(CD)
        if squeeze:
            logits = logits[0]
            hidden = [x[0] for x in hidden]
            h = h[0]
        if return_final:
            return logits, h
        return (logits, hidden) if return_hidden else logits

    def tensor_names(self):
        return list(self.state_dict().keys())


def count_params(model):
    """(total, active per token) parameter counts, embeddings and lm_head included."""
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    active = total
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            per = sum(p.numel() for p in layer.mlp.experts[0].parameters())
            active -= per * (cfg.n_routed_experts - cfg.num_experts_per_tok)
    return total, active


class MTPLayer(nn.Module):
    """DeepSeek-V3's multi-token prediction module (num_nextn_predict_layers), the checkpoint's
    model.layers.{L}.* for L = num_hidden_layers: position i combines the main model's final
    (normed) hidden state h_i with the embedding of the next token x_{i+1} and predicts x_{i+2}:
        e = embed(x_{i+1}), zeroed at position 0 (vLLM's convention)
        h = eh_proj([enorm(e); hnorm(h_i)])          eh_proj: [hidden, 2 * hidden]
        h = decoder layer (MLA attention over the module's own cache of positions <= i, MoE)
        logits = shared_head.head(shared_head.norm(h))
    Chained guesses feed its output h (before shared_head.norm) back as the next h_i."""

    def __init__(self, cfg):
        super().__init__()
        D = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = _lin(2 * D, D)
        layer = DecoderLayer(cfg, cfg.num_hidden_layers)
        if not isinstance(layer.mlp, MoE) and cfg.n_routed_experts:
            layer.mlp = MoE(cfg)  # the MTP block is an MoE layer whenever the model has experts
        self.block = layer
        self.shared_head_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.shared_head = _lin(D, cfg.vocab_size)

    def forward(self, next_ids, prev_hidden, cos, sin, positions):
        """next_ids [T] (the token after each position), prev_hidden [T, D], positions [T]
        (0..T-1, one sequence) -> (logits [T, V], hidden [T, D])."""
        e = self.embed_tokens(next_ids).to(CD)
        e = torch.where((positions == 0)[:, None], torch.zeros_like(e), e)
        h = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(prev_hidden.to(CD))], dim=-1).to(self.eh_proj.weight.dtype)).to(CD)
        h = self.block(h[None], cos, sin)[0]
        return F.linear(self.shared_head_norm(h), self.shared_head.weight).to(CD), h


def load_mtp(ckpt_dir, dtype=torch.float32):
    """The MTP layer of an HF checkpoint (model.layers.{num_hidden_layers}.*), FP8 dequantized."""
    from safetensors_io import read_checkpoint_dir
    import fp8
    cfg = Config.load(ckpt_dir)
    mtp = MTPLayer(cfg)
    raw = read_checkpoint_dir(ckpt_dir)
    prefix = "model.layers.%d." % cfg.num_hidden_layers
    rename = {"shared_head.norm.weight": "shared_head_norm.weight", "shared_head.head.weight": "shared_head.weight"}
    sd = {}
    for name, (dt, t) in raw.items():
        if not name.startswith(prefix) or name.endswith("_scale_inv"):
            continue
        if dt == "F8_E4M3":
            t = fp8.dequantize_block(t, raw[name + "_scale_inv"][1])
        short = name[len(prefix):]
        if short in rename:
            short = rename[short]
        elif short.split(".")[0] not in ("embed_tokens", "enorm", "hnorm", "eh_proj"):
            short = "block." + short
        sd[short] = t.float()
    missing, unexpected = mtp.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return mtp.to(dtype)


# ---------------------------------------------------------------- checkpoint loading
def load_model(ckpt_dir, dtype=torch.float32):
    """Builds the model from an HF checkpoint dir; FP8 weights are dequantized
    (W = e4m3(q) * scale_inv per 128x128 block), MTP layers (index >= num_hidden_layers) skipped.
    The architecture follows config.json "architectures": KimiLinearForCausalLM and
    KimiK3ForConditionalGeneration are built by reference_kimi.py, everything else (DeepSeek-V2/V3,
    Kimi K2) here."""
    from safetensors_io import read_checkpoint_dir
    import fp8
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        raw_cfg = json.load(f)
    import reference_kimi
    if reference_kimi.is_k3_config(raw_cfg):
        return reference_kimi.load_k3(ckpt_dir, dtype)
    if reference_kimi.is_kimi_config(raw_cfg):
        return reference_kimi.load_kimi(ckpt_dir, dtype)
    cfg = Config.load(ckpt_dir)
    model = DeepseekV3ForCausalLM(cfg)
    raw = read_checkpoint_dir(ckpt_dir)
    sd = {}
    for name, (dt, t) in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= cfg.num_hidden_layers:
                continue
        if dt == "F8_E4M3":
            t = fp8.dequantize_block(t, raw[name + "_scale_inv"][1])
        sd[name] = t.float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model.to(dtype)
