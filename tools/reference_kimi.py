#!/usr/bin/python3
"""PyTorch reference of Kimi Linear (`KimiLinearForCausalLM`, model_type `kimi_linear`): a hybrid of
Kimi Delta Attention (KDA, a gated delta-rule recurrence) and NoPE MLA layers, with a DeepSeek-V3
style MoE. Parameter names are exactly the Hugging Face checkpoint tensor names. The second part of
the file is the text model of Kimi K3 (`KimiK3ForConditionalGeneration`: attention residuals, latent
MoE with MXFP4 routed experts, SiTU, MLA output gate, lower-bound KDA gate); its math is K3_NOTES,
written from sglang models/kimi_k3.py + layers/attn_residual.py + layers/activation.py and vLLM
models/kimi_k3/nvidia/{model,kda,mla}.py + ops/attn_res.py (read, not copied).

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

    HIDDEN_ACTS = ("silu",)  # K3Config (below) takes "situ"

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
        assert self.hidden_act in self.HIDDEN_ACTS, self.hidden_act
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
    def __init__(self, cfg, a_log_shape=None):
        """a_log_shape: how the checkpoint stores A_log; Kimi Linear [1, 1, H, 1] (the default), K3
        1-D [head_dim] zero-padded (only the first H entries are read, one per head)."""
        super().__init__()
        self.cfg = cfg
        D, H, K, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel
        P = H * K
        self.q_proj, self.k_proj, self.v_proj = _lin(D, P), _lin(D, P), _lin(D, P)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = ShortConv(P, W), ShortConv(P, W), ShortConv(P, W)
        self.A_log = nn.Parameter(torch.zeros(*(a_log_shape or (1, 1, H, 1))))
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
    return attn.o_proj(mla_attend(attn, x, cache))


def mla_attend(attn, x, cache):
    """mla_forward_cached without the o_proj: the attention output [B, T, H * v] (K3 gates it
    before o_proj). q from q_proj, or with q_lora_rank from q_b_proj(q_a_layernorm(q_a_proj(x)))."""
    c = attn.cfg
    B, T, _ = x.shape
    H, nope, rope, vd = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    if c.q_lora_rank:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).to(rm.CD).view(B, T, H, nope + rope)
    else:
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
    return torch.einsum("bhts,bshd->bthd", p, cache["v"]).reshape(B, T, H * vd)


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


# ================================================================ Kimi K3 (text model)
# KimiK3ForConditionalGeneration: config.json holds the text model under "text_config" (its own
# model_type "kimi_linear"); every text tensor is named "language_model." + the Kimi Linear style
# name ("language_model.model.layers.N....", "language_model.lm_head.weight"). vision_tower.* and
# mm_projector.* are not loaded. Semantics as sglang models/kimi_k3.py + layers/attn_residual.py and
# vLLM models/kimi_k3/nvidia/{model,kda,mla}.py + ops/attn_res.py compute them (see K3_NOTES).

K3_ARCHITECTURE = "KimiK3ForConditionalGeneration"

K3_NOTES = """
  * Stream (AttnRes, attn_res_block_size B): bank = [], P = embed(ids). Layer i (0-based):
        x  = input_layernorm(mix(bank + [P], self_attention_res_norm, self_attention_res_proj))
        if i % B == 0: bank.append(P); P = 0        (after the mix, as the engines do; appending
                                                     first and mixing bank + [0] differs only by a
                                                     per-token scale that input_layernorm removes)
        P  = P + self_attn(x)
        y  = post_attention_layernorm(mix(bank + [P], mlp_res_norm, mlp_res_proj))
        P  = P + ffn(y)
    out = norm(mix(bank + [P], output_attn_res_norm, output_attn_res_proj)); logits = lm_head(out).
    The embedding is bank[0] (written at layer 0, whose own attention mix is the single row P =
    embedding); bank[k] = P after layer k*B - 1. At the end the bank holds ceil(L / B) rows.
    mix(rows): r_j = rows[j]; s_j = sum_d (r_j[d] * rsqrt(mean_d(r_j^2) + eps)) * n[d] * w[d]
    with n = <site>_res_norm.weight [D], w = <site>_res_proj.weight [1, D], eps = rms_norm_eps;
    p = softmax_j(s); mix = sum_j p_j r_j (raw rows). Token-local: decode keeps no AttnRes state.
  * hidden_act "situ" in every MLP (dense layer, shared experts, routed experts):
        down(situ(gate(x), up(x))), situ(g, u) = b*tanh(g/b)*sigmoid(g) * l*tanh(u/l),
        b = activation_situ_beta (4.0), l = activation_situ_linear_beta (25.0).
  * MLA (q_lora_rank, mla_use_nope: no rotary at all): q = q_b_proj(q_a_layernorm(q_a_proj(x))),
    latent = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora]), k_pe the last rope columns, used
    unrotated; scale (nope + rope)^-0.5; o [T, H*v]; mla_use_output_gate:
    o_proj(o * sigmoid(g_proj(x))) with x the same normed layer input q and kv read.
  * KDA: Kimi Linear's layer with gate_lower_bound (lb): g = lb * sigmoid(exp(A_log[h]) *
    (f_b_proj(f_a_proj(x)) + dt_bias)) and use_full_rank_gate: output gate sigmoid(g_proj(x)),
    g_proj [H*K, D], inside the gated o_norm (eps 1e-5). A_log is stored 1-D [head_dim], zero
    padded; entry h (< H) is head h's. q/k/v_conv1d, A_log, dt_bias, o_norm are F32 in the
    checkpoint. H and K (for q, k AND v) come from linear_attn_config (vLLM); v_head_dim is the
    MLA value width only. In the released model they coincide (96 = num_attention_heads, 128 =
    v_head_dim) and sglang's K3 KDA takes its value head dim from v_head_dim; tiny_k3 makes them
    differ (v_head_dim 16, KDA head_dim 32), so sglang could not run it.
  * Latent MoE (routed_expert_hidden_size R): router logits = gate.weight x (fp32); sigmoid
    scores; top-k on scores + e_score_correction_bias; weights = unbiased scores, renormalized,
    times routed_scaling_factor (1.0 in K3; engines apply it to the latent expert sum, i.e.
    before the norm). z = routed_expert_down_proj(x) [R]; l = sum_k w_k expert_k(z) (SiTU
    experts w1/w3 [I, R], w2 [R, I]); l = routed_expert_norm(l) (RMSNorm, eps rms_norm_eps, if
    latent_moe_use_norm); out = routed_expert_up_proj(l) + shared_experts(x) (SiTU MLP of width
    moe_intermediate_size * num_shared_experts on the full x).
  * Routed experts are stored as compressed-tensors mxfp4-pack-quantized: <w>.weight_packed U8
    [out, in/2] (element 2j low nibble, 2j+1 high nibble; bit 3 sign, bits 0-2 index into
    [0, .5, 1, 1.5, 2, 3, 4, 6]) and <w>.weight_scale U8 [out, in/32] (e8m0: 2^(s - 127), 255 is
    NaN); dequantized to fp32 (exact) before the forward. Whether a tensor is quantized is decided
    by the presence of weight_packed, not by quantization_config.ignore.
  * Precision: this reference is fp32 throughout. The engines keep P and the bank rows in bf16
    (vLLM's attn_res kernel rounds every prefix add to bf16) and run MLA/KDA/MoE on bf16
    activations; none of that is part of the model's definition.
"""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def decode_mxfp4(packed, scale, swap_nibbles=False, e8m0_bias=127):
    """compressed-tensors mxfp4-pack-quantized -> fp32 numpy [out, in] (exact).
    packed uint8 [out, in/2], scale uint8 [out, in/32]. swap_nibbles / e8m0_bias exist only for
    check_kimi.py's wrong variants."""
    import numpy as np
    packed = np.asarray(packed, dtype=np.uint8)
    scale = np.asarray(scale, dtype=np.uint8)
    out, half = packed.shape
    n = 2 * half
    assert n % 32 == 0 and scale.shape == (out, n // 32), (packed.shape, scale.shape)
    assert not (scale == 255).any(), "e8m0 scale 255 is NaN"
    table = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=np.float32)  # code 8 = -0
    lo, hi = packed & 0x0F, packed >> 4
    if swap_nibbles:
        lo, hi = hi, lo
    codes = np.empty((out, n), dtype=np.uint8)
    codes[:, 0::2] = lo
    codes[:, 1::2] = hi
    mult = np.ldexp(np.float32(1.0), scale.astype(np.int32) - e8m0_bias).astype(np.float32)
    return table[codes] * np.repeat(mult, 32, axis=1)


def encode_mxfp4(w):
    """fp32 [out, in] -> (packed uint8 [out, in/2], scale uint8 [out, in/32]): per group of 32 the
    smallest e8m0 exponent e with max|w| / 2^e <= 6 (e = 0 for an all-zero group), then each
    element rounded to the nearest e2m1 value (ties to the even code); negative values keep the
    sign bit even when they round to 0 (code 8, -0)."""
    import numpy as np
    w = np.asarray(w, dtype=np.float64)
    out, n = w.shape
    assert n % 32 == 0
    g = w.reshape(out, n // 32, 32)
    amax = np.abs(g).max(-1)
    e = np.zeros_like(amax, dtype=np.int64)
    nz = amax > 0
    e[nz] = np.ceil(np.log2(amax[nz] / 6.0)).astype(np.int64)
    e[nz] += (amax[nz] / np.ldexp(1.0, e[nz]) > 6.0)            # guard log2 rounding
    e[nz] -= (amax[nz] / np.ldexp(1.0, e[nz] - 1) <= 6.0)
    assert ((e >= -127) & (e <= 127)).all(), "exponent outside e8m0"
    a = np.abs(g) / np.ldexp(1.0, e)[..., None]                   # in [0, 6]
    grid = np.array(E2M1_VALUES)
    d = np.abs(a[..., None] - grid)                               # [out, G, 32, 8]
    best = d == d.min(-1, keepdims=True)
    idx = np.where(best, np.arange(8) % 2, 9).argmin(-1)          # ties -> the even code
    codes = (idx | (np.signbit(g).astype(np.int64) << 3)).reshape(out, n).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, (e + 127).astype(np.uint8)


def is_k3_config(d):
    return K3_ARCHITECTURE in (d.get("architectures") or []) or d.get("model_type") == "kimi_k3"


class K3Config(KimiConfig):
    """config.json of a Kimi K3 checkpoint (top level, with text_config): the text config's keys
    as attributes (KimiConfig aliases included); .top is the whole file."""

    HIDDEN_ACTS = ("situ",)

    def __init__(self, d):
        self.top = dict(d)
        text = dict(d["text_config"])
        super().__init__(text)
        for k, v in dict(attn_res_block_size=None, routed_expert_hidden_size=None,
                         latent_moe_use_norm=False, mla_use_output_gate=False,
                         activation_situ_beta=None, activation_situ_linear_beta=None).items():
            if k not in text:
                setattr(self, k, v)
        # the K3 reference models exactly the released model's feature set
        assert self.attn_res_block_size, "attn_res_block_size"
        assert self.routed_expert_hidden_size, "routed_expert_hidden_size"
        assert self.mla_use_output_gate and self.use_full_rank_gate
        assert self.gate_lower_bound is not None
        assert self.num_experts is not None and self.first_k_dense_replace >= 1
        self.situ_beta = float(self.activation_situ_beta or 1.0)   # engines: `beta or 1.0`
        self.situ_linear_beta = self.activation_situ_linear_beta   # None: up branch unchanged
        self.quantization_config = text.get("quantization_config", d.get("quantization_config"))

    @staticmethod
    def load(path):
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return K3Config(json.load(f))


def situ(g, u, beta, linear_beta):
    """SiTU-and-multiply (sglang/vLLM SituAndMul): beta*tanh(g/beta)*sigmoid(g) * (linear_beta *
    tanh(u/linear_beta), or u when linear_beta is None). fp32."""
    g, u = g.to(rm.CD), u.to(rm.CD)
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return a * u


class SituMLP(nn.Module):
    """gate_proj / up_proj / down_proj with SiTU: the dense layer-0 MLP and the shared experts."""

    def __init__(self, cfg, hidden, inter):
        super().__init__()
        self.cfg = cfg
        self.gate_proj, self.up_proj, self.down_proj = _lin(hidden, inter), _lin(hidden, inter), _lin(inter, hidden)

    def forward(self, x):
        a = situ(self.gate_proj(x), self.up_proj(x), self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return self.down_proj(a.to(self.down_proj.weight.dtype))


class K3Expert(nn.Module):
    """A routed expert in the latent space: w2(situ(w1 z, w3 z)), w1/w3 [I, R], w2 [R, I]
    (dequantized MXFP4)."""

    def __init__(self, cfg, latent, inter):
        super().__init__()
        self.cfg = cfg
        self.w1, self.w3, self.w2 = _lin(latent, inter), _lin(latent, inter), _lin(inter, latent)

    def forward(self, z):
        a = situ(self.w1(z), self.w3(z), self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return self.w2(a.to(self.w2.weight.dtype))


class K3MoE(nn.Module):
    """block_sparse_moe of a K3 layer (latent MoE, see K3_NOTES)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        D, R = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.gate = KimiGate(cfg)
        self.experts = nn.ModuleList([K3Expert(cfg, R, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)])
        self.shared_experts = SituMLP(cfg, D, cfg.moe_intermediate_size * cfg.num_shared_experts)
        self.routed_expert_down_proj = _lin(D, R)
        self.routed_expert_norm = RMSNorm(R, cfg.rms_norm_eps)
        self.routed_expert_up_proj = _lin(R, D)
        self.last_gap = None   # smallest k-th vs (k+1)-th biased score gap in the last forward
        self.last_idx = None   # [N, k] experts chosen in the last forward

    def forward(self, x):
        c = self.cfg
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        logits = F.linear(xf.to(rm.CD), self.gate.weight.to(rm.CD))
        w, idx = route(c, logits, self.gate.e_score_correction_bias)
        k = c.num_experts_per_token
        sel = logits.sigmoid() + self.gate.e_score_correction_bias.to(rm.CD)[None]
        top = sel.sort(-1, descending=True)[0]
        self.last_gap = (top[:, k - 1] - top[:, k]).min().item()
        self.last_idx = idx
        z = self.routed_expert_down_proj(xf)                                  # [N, R]
        lat = torch.zeros(xf.shape[0], c.routed_expert_hidden_size, dtype=rm.CD, device=x.device)
        for e in range(c.num_experts):
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.experts[e](z[rows])
            lat = lat.index_add(0, rows, y.to(rm.CD) * w[rows, slot][:, None])
        if c.latent_moe_use_norm:
            lat = self.routed_expert_norm(lat)
        out = self.routed_expert_up_proj(lat.to(self.routed_expert_up_proj.weight.dtype)).to(rm.CD)
        out = out + self.shared_experts(xf).to(rm.CD)
        return out.view(shp)


class K3MLA(rm.Attention):
    """NoPE MLA with q-LoRA and the sigmoid output gate (mla_use_output_gate)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.g_proj = _lin(cfg.hidden_size, cfg.num_attention_heads * cfg.v_head_dim)

    def forward(self, x, cache=None):
        """x [B, T, D] (normed layer input); cache: None (fresh sequence) or this layer's dict of
        keys and values, extended in place."""
        o = mla_attend(self, x, {} if cache is None else cache)              # [B, T, H*v]
        o = o * torch.sigmoid(self.g_proj(x).to(rm.CD))
        return self.o_proj(o.to(self.o_proj.weight.dtype))


def attn_res_mix(rows, norm, proj):
    """AttnRes mix: rows list of [B, T, D] (bank rows then P) -> [B, T, D]. The score RMSNorm
    carries the site's norm weight and eps; proj is Linear(D -> 1)."""
    v = torch.stack([r.to(rm.CD) for r in rows], dim=-2)                      # [B, T, R, D]
    s = F.linear(norm(v), proj.weight.to(rm.CD))[..., 0]                      # [B, T, R]
    p = torch.softmax(s, dim=-1)
    return (p[..., None] * v).sum(-2)


class K3DecoderLayer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.i = i
        self.cfg = cfg
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.is_kda = cfg.is_kda_layer(i)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.self_attention_res_norm = RMSNorm(D, eps)
        self.self_attention_res_proj = _lin(D, 1)
        self.mlp_res_norm = RMSNorm(D, eps)
        self.mlp_res_proj = _lin(D, 1)
        if self.is_kda:
            self.self_attn = KimiDeltaAttention(cfg, a_log_shape=(cfg.kda_head_dim,))
        else:
            self.self_attn = K3MLA(cfg)
        if cfg.is_moe_layer(i):
            self.block_sparse_moe = K3MoE(cfg)
        else:
            self.mlp = SituMLP(cfg, D, cfg.intermediate_size)

    def ffn(self, x):
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(self, bank, P, cache=None):
        """bank: list of [B, T, D] (appended to in place on block-write layers), P [B, T, D] the
        running partial sum -> the new P. cache: this layer's decode state or None."""
        x = self.input_layernorm(attn_res_mix(bank + [P], self.self_attention_res_norm,
                                              self.self_attention_res_proj))
        if self.i % self.cfg.attn_res_block_size == 0:
            bank.append(P)
            P = torch.zeros_like(P)
        a = self.self_attn(x, cache)
        P = P + a.to(rm.CD)
        y = self.post_attention_layernorm(attn_res_mix(bank + [P], self.mlp_res_norm, self.mlp_res_proj))
        return P + self.ffn(y).to(rm.CD)


class K3TextInner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList([K3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.output_attn_res_proj = _lin(D, 1)


class K3TextModel(nn.Module):
    """The `language_model` of KimiK3ForConditionalGeneration."""

    def __init__(self, cfg):
        super().__init__()
        self.model = K3TextInner(cfg)
        assert not cfg.tie_word_embeddings
        self.lm_head = _lin(cfg.hidden_size, cfg.vocab_size)


class KimiK3ForConditionalGeneration(nn.Module):
    """Text path of Kimi K3; parameter names are the checkpoint's (language_model.*), routed
    experts' w1/w2/w3 hold the dequantized MXFP4 weights."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.language_model = K3TextModel(cfg)

    @property
    def layers(self):
        return self.language_model.model.layers

    def new_cache(self, B=1):
        return [l.self_attn.new_state(B) if l.is_kda else {} for l in self.layers]

    def forward(self, ids, return_hidden=False, cache=None, return_mix=False):
        """ids [B, T] or [T] -> logits fp32 [B, T, V]; with return_hidden also the list of P (the
        running AttnRes partial sum) after each layer; with return_mix also the final pre-norm
        output mix [B, T, D]. cache (new_cache) continues a sequence; None is a fresh one."""
        squeeze = ids.dim() == 1
        if squeeze:
            ids = ids[None]
        m = self.language_model.model
        P = m.embed_tokens(ids).to(rm.CD)
        bank, hidden = [], []
        for i, layer in enumerate(m.layers):
            P = layer(bank, P, None if cache is None else cache[i])
            hidden.append(P)
        mix = attn_res_mix(bank + [P], m.output_attn_res_norm, m.output_attn_res_proj)
        logits = F.linear(m.norm(mix), self.language_model.lm_head.weight.to(rm.CD)).to(rm.CD)
        if squeeze:
            logits, hidden, mix = logits[0], [x[0] for x in hidden], mix[0]
        out = (logits,)
        if return_hidden:
            out += (hidden,)
        if return_mix:
            out += (mix,)
        return out if len(out) > 1 else logits


def load_k3(ckpt_dir, dtype=torch.float32, decode=decode_mxfp4):
    """KimiK3ForConditionalGeneration from an HF checkpoint dir: BF16/F32 upcast, MXFP4 routed
    experts dequantized by `decode` (weight_packed + weight_scale -> <w>.weight), vision_tower.* /
    mm_projector.* skipped."""
    from safetensors_io import read_checkpoint_dir
    cfg = K3Config.load(ckpt_dir)
    model = KimiK3ForConditionalGeneration(cfg)
    want = model.state_dict()
    raw = read_checkpoint_dir(ckpt_dir)
    sd = {}
    for name, (dt, t) in raw.items():
        if name.startswith(("vision_tower.", "mm_projector.")) or name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            assert dt == "U8", (name, dt)
            sdt, s = raw[name[:-len("_packed")] + "_scale"]
            assert sdt == "U8", name
            name = name[:-len("_packed")]
            t = torch.from_numpy(decode(t.numpy(), s.numpy()))
        else:
            assert dt in ("BF16", "F32"), (name, dt)
        if name in want:
            assert list(t.shape) == list(want[name].shape), (name, list(t.shape), list(want[name].shape))
        sd[name] = t.float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model.to(dtype)


if __name__ == "__main__":
    m = load_kimi(sys.argv[1])
    print(m.cfg.raw.get("architectures"), "params (total, active):", count_params(m))
