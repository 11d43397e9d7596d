#!/usr/bin/python3
"""PyTorch reference of Kimi Linear (`KimiLinearForCausalLM`, model_type `kimi_linear`): a hybrid of
Kimi Delta Attention (KDA, a gated delta-rule recurrence) and NoPE MLA layers, with a DeepSeek-V3
style MoE. Parameter names are exactly the Hugging Face checkpoint tensor names.

Written from the public engine code (read, not copied): vLLM `model_executor/models/kimi_linear.py`
and `layers/kda.py`, sglang `srt/models/kimi_linear.py`, flash-linear-attention `fla/ops/kda/naive.py`
and `gate.py`, and HF `modeling_kimi.py` of moonshotai/Kimi-Linear-48B-A3B-Instruct. Where HF and the
serving engines differ, this file follows vLLM/sglang and says so where it matters.

Math (fp32 compute, bf16 weights upcast; shared pieces come from reference_model.py):
  * Layer i (0-based) is KDA iff i + 1 is in linear_attn_config.kda_layers (1-based), else MLA.
    FFN: dense `mlp` (intermediate_size) for i < first_k_dense_replace, else MoE `block_sparse_moe`.
    h += attn(input_layernorm(h)); h += ffn(post_attention_layernorm(h)); logits = lm_head(norm(h)).
  * KDA, per token x (the normed layer input), H = num_heads, K = V = head_dim:
      q, k, v = {q,k,v}_proj(x) [H*K], each through its own depthwise causal conv1d (kernel W =
        short_conv_kernel_size, weight [H*K, 1, W], no bias; y[t] = sum_j w[j] * x[t - W + 1 + j],
        zero before the first token) then SiLU. Decode carries the last W - 1 conv INPUTS per channel.
      g = f_b_proj(f_a_proj(x)) + dt_bias                                     [H, K]
      g = -exp(A_log[h]) * softplus(g)                   (Kimi Linear; softplus linear above 20)
        = gate_lower_bound * sigmoid(exp(A_log[h]) * g)  (when linear_attn_config.gate_lower_bound
          is set: the K3 form, fla `naive_kda_lowerbound_gate`, vLLM `lower_bound=`)
      beta = sigmoid(b_proj(x))                                               [H]
      q, k = l2norm per head (x / sqrt(sum x^2 + 1e-6)); q *= K^-0.5
      per head, fp32 state S [K, V] (zero at sequence start):
        S = S * exp(g)[:, None];  S = S + beta * k (v - S^T k)^T;  o = S^T q
      out = o_proj( RMSNorm_K(o per head; weight o_norm, eps 1e-5) * sigmoid(g_b_proj(g_a_proj(x))) )
      (o_norm eps: vLLM and sglang build FusedRMSNormGated with its default 1e-5 and never pass the
      config's; HF passes rms_norm_eps, which is 1e-5 in the released config, so they agree there.
      With linear_attn_config.use_full_rank_gate the output gate is g_proj(x) [H*K, hidden], vLLM's K3
      path.)
  * MLA: DeepSeek-V3 MLA without q-LoRA (q_proj) and, with mla_use_nope, no rotary embedding at all:
    the qk_rope_head_dim slices of q and k_pe are used unrotated; softmax scale (nope + rope)^-0.5.
    kv_a_layernorm uses rms_norm_eps as vLLM/sglang do (HF's modeling_kimi.py builds it with its
    default 1e-6; the difference is ~1e-6 relative).
  * MoE: router gate.weight [E, hidden] on fp32 x, scores = sigmoid (moe_router_activation_func),
    selection on scores + gate.e_score_correction_bias with group limiting (num_expert_group /
    topk_group; groups scored by their top-2 biased scores), weights = UNBIASED scores of the
    chosen experts, renormalized to sum 1 (moe_renormalize), times routed_scaling_factor.
    (HF's modeling_kimi.py adds the bias to the scores in place and so weights by biased scores;
    vLLM's FusedMoE and sglang's biased grouped top-k use the unbiased ones. Followed: vLLM.)
    Experts: w2(silu(w1 x) * w3 x); plus shared_experts (gate/up/down_proj, width
    moe_intermediate_size * num_shared_experts), unscaled. Ties: lower index wins.
"""
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_model as rm  # noqa: E402
from reference_model import MLP, RMSNorm, _lin, route  # noqa: E402

ARCHITECTURE = "KimiLinearForCausalLM"
KDA_O_NORM_EPS = 1e-5    # vLLM / sglang FusedRMSNormGated default (see the docstring)
L2NORM_EPS = 1e-6        # fla l2norm_fwd

DEFAULTS = dict(
    q_lora_rank=None, rms_norm_eps=1e-6, tie_word_embeddings=False, num_shared_experts=0,
    routed_scaling_factor=1.0, first_k_dense_replace=0, moe_layer_freq=1, use_grouped_topk=True,
    num_expert_group=1, topk_group=1, moe_renormalize=True, moe_router_activation_func="sigmoid",
    mla_use_nope=False, num_nextn_predict_layers=0, rope_scaling=None, num_experts=None,
    hidden_act="silu",
)


def is_kimi_config(d):
    return ARCHITECTURE in (d.get("architectures") or []) or d.get("model_type") == "kimi_linear"


class KimiConfig:
    """config.json of a Kimi Linear checkpoint, with the aliases the shared DeepSeek pieces read
    (n_routed_experts, num_experts_per_tok, n_group, scoring_func, ...)."""

    def __init__(self, d):
        self.raw = dict(d)
        for k, v in DEFAULTS.items():
            setattr(self, k, v)
        for k, v in d.items():
            setattr(self, k, v)
        lac = self.linear_attn_config
        self.kda_num_heads = int(lac["num_heads"])
        self.kda_head_dim = int(lac["head_dim"])
        self.conv_kernel = int(lac["short_conv_kernel_size"])
        self.kda_layers = [int(i) for i in lac["kda_layers"]]
        self.full_attn_layers = [int(i) for i in lac.get("full_attn_layers", [])]
        self.gate_lower_bound = lac.get("gate_lower_bound")
        self.use_full_rank_gate = bool(lac.get("use_full_rank_gate", False))
        L = self.num_hidden_layers
        # engines read only kda_layers; a config whose two lists do not partition 1..L is refused here
        assert sorted(self.kda_layers + self.full_attn_layers) == list(range(1, L + 1)), \
            "linear_attn_config: kda_layers + full_attn_layers must partition 1..%d" % L
        assert self.hidden_act == "silu", self.hidden_act
        assert self.moe_layer_freq == 1, "moe_layer_freq != 1 is not modelled"
        if self.full_attn_layers:
            assert self.mla_use_nope, "mla_use_nope false: vLLM's KimiMLAAttention asserts NoPE"
        assert self.use_grouped_topk or self.num_expert_group == 1, "ungrouped top-k with groups"
        # aliases for reference_model.Attention / route
        self.n_routed_experts = self.num_experts
        self.num_experts_per_tok = self.num_experts_per_token
        self.n_shared_experts = self.num_shared_experts
        self.n_group = self.num_expert_group
        self.scoring_func = self.moe_router_activation_func
        self.norm_topk_prob = self.moe_renormalize
        self.topk_method = "noaux_tc"

    @staticmethod
    def load(path):
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return KimiConfig(json.load(f))

    def is_kda_layer(self, i):
        return (i + 1) in self.kda_layers

    def is_moe_layer(self, i):
        return (self.num_experts is not None and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)


# ---------------------------------------------------------------- KDA
class ShortConv(nn.Module):
    """Depthwise causal conv1d + SiLU (fla ShortConvolution / vLLM causal_conv1d_fn)."""

    def __init__(self, channels, kernel):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))

    def forward(self, x, state=None):
        """x [B, T, C]; state [B, W-1, C] = the last W-1 inputs before x (oldest first), zeros if None.
        Returns (silu(conv(x)) [B, T, C], new state [B, W-1, C])."""
        B, T, C = x.shape
        W = self.weight.shape[-1]
        if state is None:
            state = torch.zeros(B, W - 1, C, dtype=x.dtype, device=x.device)
        xp = torch.cat([state.to(x.dtype), x], dim=1)            # [B, W-1+T, C]
        win = xp.unfold(1, W, 1)                                   # [B, T, C, W]
        y = (win * self.weight[:, 0, :].to(x.dtype)).sum(-1)
        return F.silu(y), xp[:, T:, :]


def l2norm(x, eps=L2NORM_EPS):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(raw, A_log, dt_bias, lower_bound=None):
    """raw [..., H, K] = f_b_proj(f_a_proj(x)); A_log (H values); dt_bias [H*K] -> g [..., H, K]
    (log of the per-channel decay, <= 0)."""
    H, K = raw.shape[-2:]
    g = raw + dt_bias.view(H, K).to(raw.dtype)
    a = A_log.reshape(-1)[:H].to(raw.dtype).exp().view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(g)
    return float(lower_bound) * torch.sigmoid(a * g)


def kda_recurrent(q, k, v, g, beta, S=None):
    """The naive recurrence (the oracle). q, k [B, T, H, K] (q already l2-normed and scaled, k
    l2-normed), v [B, T, H, V], g [B, T, H, K] (log decay), beta [B, T, H]; S [B, H, K, V] or None.
    Returns (o [B, T, H, V], S [B, H, K, V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if S is None:
        S = torch.zeros(B, H, K, V, dtype=q.dtype, device=q.device)
    S = S.to(q.dtype).clone()
    o = torch.zeros(B, T, H, V, dtype=q.dtype, device=q.device)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        kt = k[:, t]                                                   # [B, H, K]
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)          # v - S^T k
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * kt, err)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        D, H, K, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel
        P = H * K
        self.q_proj, self.k_proj, self.v_proj = _lin(D, P), _lin(D, P), _lin(D, P)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = ShortConv(P, W), ShortConv(P, W), ShortConv(P, W)
        self.A_log = nn.Parameter(torch.zeros(1, 1, H, 1))
        self.f_a_proj = _lin(D, K)
        self.f_b_proj = _lin(K, P)
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.b_proj = _lin(D, H)
        if cfg.use_full_rank_gate:
            self.g_proj = _lin(D, P)
        else:
            self.g_a_proj = _lin(D, K)
            self.g_b_proj = _lin(K, P)
        self.o_norm = RMSNorm(K, KDA_O_NORM_EPS)
        self.o_proj = _lin(P, D)

    def new_state(self, B=1, dtype=rm.CD, device=None):
        c = self.cfg
        P, W, H, K = c.kda_num_heads * c.kda_head_dim, c.conv_kernel, c.kda_num_heads, c.kda_head_dim
        z = lambda *s: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
        return {"conv_q": z(B, W - 1, P), "conv_k": z(B, W - 1, P), "conv_v": z(B, W - 1, P),
                "recurrent": z(B, H, K, K)}

    def inputs(self, x, state=None):
        """The recurrence inputs for x [B, T, D]: (q, k, v, g, beta) and the new conv states."""
        c = self.cfg
        B, T, _ = x.shape
        H, K = c.kda_num_heads, c.kda_head_dim
        st = state or {}
        q, cq = self.q_conv1d(self.q_proj(x).to(rm.CD), st.get("conv_q"))
        k, ck = self.k_conv1d(self.k_proj(x).to(rm.CD), st.get("conv_k"))
        v, cv = self.v_conv1d(self.v_proj(x).to(rm.CD), st.get("conv_v"))
        q = l2norm(q.view(B, T, H, K)) * K ** -0.5
        k = l2norm(k.view(B, T, H, K))
        v = v.view(B, T, H, K)
        raw = self.f_b_proj(self.f_a_proj(x)).to(rm.CD).view(B, T, H, K)
        g = kda_gate(raw, self.A_log, self.dt_bias, c.gate_lower_bound)
        beta = torch.sigmoid(self.b_proj(x).to(rm.CD))
        return (q, k, v, g, beta), {"conv_q": cq, "conv_k": ck, "conv_v": cv}

    def output(self, x, o):
        """o [B, T, H, V] -> o_proj(o_norm(o) * sigmoid(gate)) [B, T, D]."""
        c = self.cfg
        B, T, H, K = o.shape
        gate = self.g_proj(x) if c.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        y = self.o_norm(o) * torch.sigmoid(gate.to(rm.CD).view(B, T, H, K))
        return self.o_proj(y.reshape(B, T, H * K).to(self.o_proj.weight.dtype))

    def forward(self, x, state=None):
        """x [B, T, D]. state: None (a fresh sequence, nothing kept) or a dict from new_state(),
        updated in place (conv_q/k/v [B, W-1, H*K]: the last W-1 projected inputs, oldest first;
        recurrent [B, H, K, V] fp32)."""
        (q, k, v, g, beta), conv = self.inputs(x, state)
        o, S = kda_recurrent(q, k, v, g, beta, None if state is None else state["recurrent"])
        if state is not None:
            state.update(conv)
            state["recurrent"] = S
        return self.output(x, o)


# ---------------------------------------------------------------- MLA (NoPE)
def mla_forward_cached(attn, x, cache):
    """The same NoPE MLA as reference_model.Attention with identity rotation, over a per-layer
    cache of expanded keys and values (a decode/chunked-prefill form for self-checks).
    x [B, T, D]; cache {"k": [B, S, H, nope+rope], "v": [B, S, H, v]} updated in place."""
    c = attn.cfg
    B, T, _ = x.shape
    H, nope, rope, vd = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q = attn.q_proj(x).to(rm.CD).view(B, T, H, nope + rope)
    kv = attn.kv_a_proj_with_mqa(x).to(rm.CD)
    latent = attn.kv_a_layernorm(kv[..., :c.kv_lora_rank])
    k_pe = kv[..., c.kv_lora_rank:]
    kvb = attn.kv_b_proj(latent).to(rm.CD).view(B, T, H, nope + vd)
    key = torch.cat([kvb[..., :nope], k_pe[:, :, None, :].expand(B, T, H, rope)], dim=-1)
    cache["k"] = torch.cat([cache["k"], key], 1) if "k" in cache else key
    cache["v"] = torch.cat([cache["v"], kvb[..., nope:]], 1) if "v" in cache else kvb[..., nope:]
    S = cache["k"].shape[1]
    s = torch.einsum("bthd,bshd->bhts", q, cache["k"]) * attn.scale
    pos_q = torch.arange(S - T, S)[:, None]
    s = s.masked_fill(torch.arange(S)[None, :] > pos_q, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhts,bshd->bthd", p, cache["v"]).reshape(B, T, H * vd)
    return attn.o_proj(o)


# ---------------------------------------------------------------- MoE
class Expert(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.w1, self.w3, self.w2 = _lin(hidden, inter), _lin(hidden, inter), _lin(inter, hidden)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class KimiGate(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))


class KimiMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = KimiGate(cfg)
        self.experts = nn.ModuleList([Expert(cfg.hidden_size, cfg.moe_intermediate_size)
                                      for _ in range(cfg.num_experts)])
        if cfg.num_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)
        else:
            self.shared_experts = None
        self.last_gap = None  # smallest k-th vs (k+1)-th selection-score gap in the last forward

    def forward(self, x):
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        logits = F.linear(xf.to(rm.CD), self.gate.weight.to(rm.CD))
        w, idx = route(self.cfg, logits, self.gate.e_score_correction_bias)
        k = self.cfg.num_experts_per_token
        sel = (logits.sigmoid() if self.cfg.scoring_func == "sigmoid" else logits.softmax(-1)) \
            + self.gate.e_score_correction_bias.to(rm.CD)[None]
        if self.cfg.num_expert_group == 1 and k < sel.shape[1]:
            top = sel.sort(-1, descending=True)[0]
            self.last_gap = (top[:, k - 1] - top[:, k]).min().item()
        out = torch.zeros(xf.shape, dtype=rm.CD, device=x.device)
        for e in range(self.cfg.num_experts):
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.experts[e](xf[rows])
            out = out.index_add(0, rows, y.to(rm.CD) * w[rows, slot][:, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(xf).to(rm.CD)
        return out.view(shp)


# ---------------------------------------------------------------- model
class KimiDecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.is_kda = cfg.is_kda_layer(i)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = KimiDeltaAttention(cfg) if self.is_kda else rm.Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(i):
            self.block_sparse_moe = KimiMoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def ffn(self, x):
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(self, h, cache=None):
        """h [B, T, D] fp32; cache None (full causal forward of a fresh sequence) or this layer's
        entry of KimiLinearForCausalLM.new_cache() (KDA state / MLA keys and values), updated."""
        x = self.input_layernorm(h)
        if self.is_kda:
            a = self.self_attn(x, cache)
        elif cache is None:
            T, rope = h.shape[1], self.self_attn.cfg.qk_rope_head_dim
            one = torch.ones(T, rope // 2, dtype=rm.CD, device=h.device)
            # mla_use_nope: no rotation -- cos 1, sin 0 is the exact identity in the shared Attention
            a = self.self_attn(x, one, torch.zeros_like(one))
        else:
            a = mla_forward_cached(self.self_attn, x, cache)
        h = h + a.to(rm.CD)
        return h + self.ffn(self.post_attention_layernorm(h)).to(rm.CD)


class KimiInner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([KimiDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = KimiInner(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else _lin(cfg.hidden_size, cfg.vocab_size)

    def new_cache(self, B=1):
        """Per-layer decode state: a KDA layer's dict (conv_q/k/v, recurrent), an MLA layer's dict
        of keys and values (empty until the first forward)."""
        return [l.self_attn.new_state(B) if l.is_kda else {} for l in self.model.layers]

    def forward(self, ids, return_hidden=False, cache=None):
        """ids [B, T] or [T] -> logits fp32 [B, T, V] (and the residual stream after each decoder
        layer when return_hidden). cache (from new_cache) continues a sequence: ids are the next
        tokens; None is one full causal forward of a fresh sequence."""
        squeeze = ids.dim() == 1
        if squeeze:
            ids = ids[None]
        h = self.model.embed_tokens(ids).to(rm.CD)
        hidden = []
        for i, layer in enumerate(self.model.layers):
            h = layer(h, None if cache is None else cache[i])
            if return_hidden:
                hidden.append(h)
        h = self.model.norm(h)
        W = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, W).to(rm.CD)
        if squeeze:
            logits = logits[0]
            hidden = [x[0] for x in hidden]
        return (logits, hidden) if return_hidden else logits


def load_kimi(ckpt_dir, dtype=torch.float32):
    """Builds the model from an HF checkpoint dir (BF16/F32 tensors, upcast); MTP layers skipped."""
    from safetensors_io import read_checkpoint_dir
    cfg = KimiConfig.load(ckpt_dir)
    model = KimiLinearForCausalLM(cfg)
    want = model.state_dict()
    sd = {}
    for name, (dt, t) in read_checkpoint_dir(ckpt_dir).items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_hidden_layers:
            continue
        assert dt in ("BF16", "F32", "F16"), (name, dt)
        if name.endswith(".A_log") and name in want and t.numel() != want[name].numel():
            t = t.reshape(-1)[:want[name].numel()]  # K3 stores A_log padded 1-D; the first H are used
        if name in want:
            t = t.reshape(want[name].shape)
        sd[name] = t.float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model.to(dtype)


def count_params(model):
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    active = total
    for layer in model.model.layers:
        if hasattr(layer, "block_sparse_moe"):
            per = sum(p.numel() for p in layer.block_sparse_moe.experts[0].parameters())
            active -= per * (cfg.num_experts - cfg.num_experts_per_token)
    return total, active


if __name__ == "__main__":
    m = load_kimi(sys.argv[1])
    print(m.cfg.raw.get("architectures"), "params (total, active):", count_params(m))
