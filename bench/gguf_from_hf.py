#!/usr/bin/env python3
"""Converts a DeepSeek-V2 / V3-layout Hugging Face checkpoint (config.json + safetensors, bf16 or
FP8 e4m3 with 128x128 block scales) into a GGUF that llama.cpp's `deepseek2` architecture loads, for
the side-by-side benchmark in bench/llama_cpp_peer.sh. Our own code: it reads the safetensors with
numpy and writes the file with the `gguf` Python package only (gguf-py from a llama.cpp tree or
`pip install gguf`; checked against llama.cpp 0.5.0 / gguf-py 0.19.0):

  PYTHONPATH=$LLAMA_CPP_DIR/gguf-py python3 bench/gguf_from_hf.py checkpoints/bench checkpoints/gguf/bench-bf16.gguf
  PYTHONPATH=$LLAMA_CPP_DIR/gguf-py python3 bench/gguf_from_hf.py checkpoints/bench-fp8 checkpoints/gguf/bench-fp8-q8_0.gguf

--outtype auto (the default) writes BF16 from a bf16 checkpoint and Q8_0 from an FP8 one.
  bf16: every matrix in bf16 (FP8 matrices dequantized, rounded to nearest even).
  q8_0: the matrices the checkpoint stores in FP8 are dequantized (fp8 x its block's
        weight_scale_inv) and quantized to Q8_0 (32 weights + one f16 scale: 8.5 bits a weight, as
        FP8 with 128x128 block scales is ~8 bits); the matrices the checkpoint keeps in bf16 (the
        embedding and lm_head of the bench checkpoint) stay bf16 so both engines read the same bytes.
        --q8-scope all quantizes those too (what llama-quantize's Q8_0 does).
Always f32, as llama.cpp's own converter writes them: norms, the router (ffn_gate_inp) and the
router's correction bias (exp_probs_b).

What llama.cpp's deepseek2 expects, and what this writes:
  - routed experts merged into 3D tensors blk.N.ffn_{gate,up,down}_exps [n_expert, out, in];
  - kv_b_proj split per head into attn_k_b [n_head, kv_lora, nope] (transposed, for the absorbed
    MLA product q_nope . W_kb) and attn_v_b [n_head, v, kv_lora]; head_count_kv = 1 (MLA runs as
    MQA over the latent), key_length = kv_lora + rope, value_length = kv_lora, and the per-head
    sizes in key_length_mla / value_length_mla;
  - no q_lora (q_lora_rank null): attn_q, and attention.q_lora_rank = 0 written explicitly
    (llama.cpp reads that key as required unless the layer count is a known "lite" one);
  - rope on the last qk_rope_head_dim dims of q and of kv_a_proj's output, as llama.cpp's NORM rope
    (rotates adjacent pairs). The HF DeepSeek code permutes q_pe / k_pe from interleaved to halves
    before its rotate_half, which is the same map, so no weight is permuted (llama.cpp's converter
    does not permute either). YaRN is not written (the bench checkpoints have rope_scaling null);
    a config with rope_scaling is refused.
  - a synthetic SentencePiece-style vocabulary of vocab_size tokens (<unk>, 256 byte tokens, then
    <tN>; bos / eos at the ids of config.json): the bench checkpoints have no tokenizer and
    llama-bench feeds random token ids. Text through this vocabulary means nothing.
  - tie_word_embeddings: lm_head is not written; llama.cpp then uses token_embd as the output.
Checked: the last position's top-5 logits through libllama equal `moat score`'s (same ids and order,
logits within 5e-3) on models/k3-nano (q_lora, sigmoid + grouped routing, correction bias, tied
embeddings) and checkpoints/bench (bf16); on bench-fp8 -> Q8_0 the same top-5 ids, within 0.05.
"""
import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("gguf_from_hf.py: the `gguf` package is missing: PYTHONPATH=$LLAMA_CPP_DIR/gguf-py (or pip install gguf)")

Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------------------------------------
# safetensors, read with numpy: 8-byte little-endian header length, JSON header, raw data


class SafeTensors:
    DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F8_E4M3": np.uint8}

    def __init__(self, model_dir: Path):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            sys.exit(f"gguf_from_hf.py: no *.safetensors in {model_dir}")
        self.entries = {}  # name -> (file, dtype string, shape, begin, end)
        self.maps = {}
        for f in files:
            with open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(n))
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                if e["dtype"] not in self.DTYPES:
                    sys.exit(f"gguf_from_hf.py: {f.name}: {name} has dtype {e['dtype']}, not one of {list(self.DTYPES)}")
                a, b = e["data_offsets"]
                self.entries[name] = (f, e["dtype"], tuple(e["shape"]), 8 + n + a, 8 + n + b)

    def __contains__(self, name):
        return name in self.entries

    def dtype(self, name):
        return self.entries[name][1]

    def shape(self, name):
        return self.entries[name][2]

    def raw(self, name) -> np.ndarray:
        f, dt, shape, a, b = self.entries[name]
        if f not in self.maps:
            self.maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        return self.maps[f][a:b].view(self.DTYPES[dt]).reshape(shape)


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def e4m3_table() -> np.ndarray:
    """float32 value of each FP8 e4m3fn byte (bias 7, no infinities, 0x7f / 0xff are NaN)."""
    v = np.arange(256, dtype=np.uint32)
    sign = np.where(v & 0x80, -1.0, 1.0)
    exp = (v >> 3) & 0xF
    man = (v & 0x7).astype(np.float64)
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
    val = sign * val
    val[(v & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


E4M3 = e4m3_table()


class Source:
    """Tensors of the checkpoint as 'native' arrays: bf16 stays uint16 (bits), everything else is
    float32 (FP8 dequantized with its block scales)."""

    def __init__(self, st: SafeTensors, block=(128, 128)):
        self.st = st
        self.block = block

    def is_fp8(self, name):
        return self.st.dtype(name) == "F8_E4M3"

    def is_bf16(self, name):
        return self.st.dtype(name) == "BF16"

    def native(self, name) -> np.ndarray:
        dt = self.st.dtype(name)
        a = self.st.raw(name)
        if dt == "BF16":
            return np.array(a)
        if dt == "F32":
            return np.array(a)
        if dt == "F16":
            return a.astype(np.float32)
        # FP8 e4m3 with weight_scale_inv [ceil(out/128), ceil(in/128)]: w = fp8 * scale of its block
        scale_name = name + "_scale_inv"
        if scale_name not in self.st:
            sys.exit(f"gguf_from_hf.py: {name} is FP8 but {scale_name} is missing")
        s = np.asarray(self.st.raw(scale_name), dtype=np.float32)
        w = E4M3[a]
        bo, bi = self.block
        out, inp = w.shape
        s_full = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:out, :inp]
        w *= s_full
        return w


def as_f32(a: np.ndarray) -> np.ndarray:
    return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32, copy=False)


def encode(a: np.ndarray, qtype) -> np.ndarray:
    """native array -> the bytes of the GGUF tensor of type qtype (uint16 for BF16 kept as bits)."""
    if qtype == Q.F32:
        return np.ascontiguousarray(as_f32(a))
    if qtype == Q.BF16 and a.dtype == np.uint16:
        return np.ascontiguousarray(a)
    return gguf.quants.quantize(np.ascontiguousarray(as_f32(a)), qtype)


# ---------------------------------------------------------------------------------------------
# the plan: every GGUF tensor with its shape, type and how to make it


class Plan:
    def __init__(self, name, shape, qtype, make, src_names):
        self.name, self.shape, self.qtype, self.make, self.src_names = name, tuple(shape), qtype, make, src_names

    def nbytes(self):
        if self.qtype == Q.F32:
            return int(np.prod(self.shape)) * 4
        return int(np.prod(gguf.quant_shape_to_byte_shape(self.shape, self.qtype)))


def build_plan(cfg, src: Source, outtype: str, q8_scope: str):
    st = src.st
    n_layer = cfg["num_hidden_layers"]
    n_head = cfg["num_attention_heads"]
    nope, vdim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    n_exp = cfg.get("n_routed_experts")
    dense_lead = cfg.get("first_k_dense_replace", 0 if n_exp else n_layer)
    freq = cfg.get("moe_layer_freq", 1)
    if freq != 1:
        sys.exit("gguf_from_hf.py: moe_layer_freq != 1 is not supported by llama.cpp's deepseek2")
    plans = []

    def matrix_type(src_names, row_len):
        """GGUF type of a weight matrix made from src_names (rows of row_len values)."""
        if outtype == "bf16":
            return Q.BF16
        fp8 = all(src.is_fp8(n) for n in src_names)
        if q8_scope == "fp8" and not fp8:
            return Q.BF16
        if row_len % 32:
            print(f"  note: rows of {row_len} values do not split in Q8_0 blocks of 32; {src_names[0]} stays bf16")
            return Q.BF16
        return Q.Q8_0

    def one(gname, hname, kind="matrix"):
        shape = st.shape(hname)
        if kind == "f32":
            qt = Q.F32
        else:
            qt = matrix_type([hname], shape[-1])
        plans.append(Plan(gname, shape, qt, lambda h=hname: src.native(h), [hname]))

    one("token_embd.weight", "model.embed_tokens.weight")
    for i in range(n_layer):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        one(b + "attn_norm.weight", p + "input_layernorm.weight", "f32")
        if cfg.get("q_lora_rank"):
            one(b + "attn_q_a.weight", p + "self_attn.q_a_proj.weight")
            one(b + "attn_q_a_norm.weight", p + "self_attn.q_a_layernorm.weight", "f32")
            one(b + "attn_q_b.weight", p + "self_attn.q_b_proj.weight")
        else:
            one(b + "attn_q.weight", p + "self_attn.q_proj.weight")
        one(b + "attn_kv_a_mqa.weight", p + "self_attn.kv_a_proj_with_mqa.weight")
        one(b + "attn_kv_a_norm.weight", p + "self_attn.kv_a_layernorm.weight", "f32")
        # kv_b_proj [n_head * (nope + v), kv_lora]: per head nope rows of W_kb then v rows of W_vb
        kvb = p + "self_attn.kv_b_proj.weight"
        kv_lora = st.shape(kvb)[1]
        assert st.shape(kvb)[0] == n_head * (nope + vdim), (kvb, st.shape(kvb))

        def k_b(h=kvb):
            w = src.native(h).reshape(n_head, nope + vdim, kv_lora)
            return np.ascontiguousarray(w[:, :nope, :].transpose(0, 2, 1))  # [n_head, kv_lora, nope]

        def v_b(h=kvb):
            w = src.native(h).reshape(n_head, nope + vdim, kv_lora)
            return np.ascontiguousarray(w[:, nope:, :])  # [n_head, v, kv_lora]

        plans.append(Plan(b + "attn_k_b.weight", (n_head, kv_lora, nope), matrix_type([kvb], nope), k_b, [kvb]))
        plans.append(Plan(b + "attn_v_b.weight", (n_head, vdim, kv_lora), matrix_type([kvb], kv_lora), v_b, [kvb]))
        one(b + "attn_output.weight", p + "self_attn.o_proj.weight")
        one(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", "f32")
        if i < dense_lead:
            for proj, g in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                one(b + g + ".weight", p + "mlp." + proj + ".weight")
            continue
        one(b + "ffn_gate_inp.weight", p + "mlp.gate.weight", "f32")
        if p + "mlp.gate.e_score_correction_bias" in st:
            one(b + "exp_probs_b.bias", p + "mlp.gate.e_score_correction_bias", "f32")
        for proj, g in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            names = [f"{p}mlp.experts.{e}.{proj}.weight" for e in range(n_exp)]
            shape = (n_exp,) + st.shape(names[0])

            def stack(names=names):
                return np.stack([src.native(n) for n in names], axis=0)

            plans.append(Plan(b + g + ".weight", shape, matrix_type(names, shape[-1]), stack, names))
        if cfg.get("n_shared_experts"):
            for proj, g in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
                one(b + g + ".weight", p + "mlp.shared_experts." + proj + ".weight")
    one("output_norm.weight", "model.norm.weight", "f32")
    if not cfg.get("tie_word_embeddings", False):
        one("output.weight", "lm_head.weight")
    return plans


# ---------------------------------------------------------------------------------------------
# metadata


def write_metadata(w: "gguf.GGUFWriter", cfg, name, file_type):
    nope, rope, vdim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_lora = cfg["kv_lora_rank"]
    n_layer = cfg["num_hidden_layers"]
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_block_count(n_layer)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1)  # MLA with the absorbed product runs as MQA over the latent
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
    w.add_q_lora_rank(cfg.get("q_lora_rank") or 0)
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(vdim)
    w.add_rope_dimension_count(rope)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])
    if cfg.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    scoring = cfg.get("scoring_func", "softmax")
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if scoring == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX)


def write_vocab(w: "gguf.GGUFWriter", cfg):
    n = cfg["vocab_size"]
    bos, eos = cfg.get("bos_token_id"), cfg.get("eos_token_id")
    tokens, types = [], []
    for i in range(n):
        if i == bos:
            tokens.append("<|bos|>"); types.append(gguf.TokenType.CONTROL)
        elif i == eos:
            tokens.append("<|eos|>"); types.append(gguf.TokenType.CONTROL)
        elif i == 0:
            tokens.append("<unk>"); types.append(gguf.TokenType.UNKNOWN)
        elif 1 <= i <= 256:  # byte fallback tokens (the newline token is looked up among them)
            tokens.append(f"<0x{i - 1:02X}>"); types.append(gguf.TokenType.BYTE)
        else:
            tokens.append(f"<t{i}>"); types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    if bos is not None and 0 <= bos < n:
        w.add_bos_token_id(bos)
    if eos is not None and 0 <= eos < n:
        w.add_eos_token_id(eos)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="Hugging Face checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("out", type=Path, help="output .gguf")
    ap.add_argument("--outtype", choices=["auto", "bf16", "q8_0"], default="auto")
    ap.add_argument("--q8-scope", choices=["fp8", "all"], default="fp8",
                    help="with q8_0: quantize only the checkpoint's FP8 matrices (default) or every matrix")
    ap.add_argument("--name", default=None, help="general.name (default: the directory name)")
    args = ap.parse_args()

    cfg = json.loads((args.model / "config.json").read_text())
    arch = (cfg.get("architectures") or [""])[0]
    if arch not in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        sys.exit(f"gguf_from_hf.py: {arch or 'no architecture'}: only DeepseekV2/V3ForCausalLM map onto llama.cpp's deepseek2")
    if cfg.get("rope_scaling"):
        sys.exit("gguf_from_hf.py: rope_scaling (YaRN) is not written by this converter; the bench checkpoints have none")
    if cfg.get("topk_method") == "group_limited_greedy" and (cfg.get("n_group") or 1) > 1:
        print("warning: topk_method group_limited_greedy scores a group by its best expert; llama.cpp scores it by "
              "its best two (DeepSeek-V3's noaux_tc): routing can differ", file=sys.stderr)
    if cfg.get("num_nextn_predict_layers"):
        print("note: MTP layers are not written", file=sys.stderr)
    qc = cfg.get("quantization_config") or {}
    if qc and (qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3"):
        sys.exit(f"gguf_from_hf.py: quantization_config {qc} is not FP8 e4m3 block-scaled")
    block = tuple(qc.get("weight_block_size", (128, 128)))

    st = SafeTensors(args.model)
    src = Source(st, block)
    outtype = args.outtype
    if outtype == "auto":
        outtype = "q8_0" if any(d[1] == "F8_E4M3" for d in st.entries.values()) else "bf16"
    if outtype == "q8_0" and args.q8_scope == "fp8" and not any(d[1] == "F8_E4M3" for d in st.entries.values()):
        sys.exit("gguf_from_hf.py: --outtype q8_0 of a checkpoint without FP8 matrices: add --q8-scope all")
    file_type = gguf.LlamaFileType.MOSTLY_BF16 if outtype == "bf16" else gguf.LlamaFileType.MOSTLY_Q8_0

    plans = build_plan(cfg, src, outtype, args.q8_scope)
    used = {n for p in plans for n in p.src_names}
    skipped = [n for n in st.entries if n not in used and not n.endswith("_scale_inv")
               and not (n == "lm_head.weight" and cfg.get("tie_word_embeddings"))]
    if skipped:
        sys.exit(f"gguf_from_hf.py: tensors this converter does not map: {skipped[:8]}{' ...' if len(skipped) > 8 else ''}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".part")
    w = gguf.GGUFWriter(tmp, "deepseek2")
    write_metadata(w, cfg, args.name or args.model.name, file_type)
    write_vocab(w, cfg)
    for p in plans:
        if p.qtype == Q.F32:
            w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes())
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(p.shape, p.qtype)
            w.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8), p.nbytes(), raw_dtype=p.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    counts = {}
    for k, p in enumerate(plans):
        data = encode(p.make(), p.qtype)
        if data.nbytes != p.nbytes():
            sys.exit(f"gguf_from_hf.py: {p.name}: {data.nbytes} bytes, planned {p.nbytes()}")
        w.write_tensor_data(data)
        counts[p.qtype.name] = counts.get(p.qtype.name, 0) + 1
        if k % 16 == 0 or p.name.endswith("_exps.weight"):
            print(f"  [{k + 1}/{len(plans)}] {p.name} {p.qtype.name} {list(reversed(p.shape))} ({time.time() - t0:.0f}s)",
                  flush=True)
    w.close()
    os.replace(tmp, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {len(plans)} tensors ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}), "
          f"{size / 2**30:.2f} GiB, {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
