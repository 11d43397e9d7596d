#!/usr/bin/python3
"""FP8 E4M3 (the "fn" variant: no infinities, 0x7F/0xFF are NaN, max 448) encode/decode and the
DeepSeek-V3 128x128 block quantization, for torch 1.13 which has no float8 dtype.

Encoding: round to nearest representable value, ties to the even code (code LSB 0), saturating at
448. Block quantization: scale = amax(|w| over the block) / 448 (1.0 for an all-zero block),
q = e4m3(w / scale); stored as weight (F8_E4M3 codes [out, in]) + weight_scale_inv (F32
[ceil(out/128), ceil(in/128)]) and W = value(q) * scale_inv[i // 128][j // 128].
"""
import torch

BLOCK = 128


def _code_value(c):
    s = -1.0 if c & 0x80 else 1.0
    e = (c >> 3) & 0xF
    m = c & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    if e == 0:
        return s * (m / 8.0) * 2.0 ** -6
    return s * (1.0 + m / 8.0) * 2.0 ** (e - 7)


# value of every code 0..255
TABLE = torch.tensor([_code_value(c) for c in range(256)], dtype=torch.float32)
# positive codes 0..126 are monotonically increasing in value
_POS = TABLE[:127].clone()
_MID = (_POS[:-1] + _POS[1:]) / 2  # exact in fp32 (needs 5 significant bits)


def decode(codes):
    return TABLE[codes.long()]


def encode(x):
    """fp32 tensor -> uint8 e4m3fn codes, round to nearest, ties to even code, saturate."""
    x = x.float()
    a = x.abs().clamp(max=448.0)
    lo = torch.searchsorted(_POS, a, right=True) - 1  # largest code with value <= a
    lo = lo.clamp(0, 126)
    hi = (lo + 1).clamp(max=126)
    mid = _MID[lo.clamp(max=125)]
    pick_hi = (a > mid) | ((a == mid) & (lo % 2 == 1))
    pick_hi &= lo < 126
    code = torch.where(pick_hi, hi, lo)
    sign = torch.signbit(x)  # negative values rounding to zero become -0 (0x80)
    code = code | (sign.long() << 7)
    return code.to(torch.uint8)


def quantize_block(w):
    """w [out, in] float -> (codes uint8 [out, in], scale_inv fp32 [ceil(out/128), ceil(in/128)])."""
    w = w.float()
    o, i = w.shape
    bo, bi = (o + BLOCK - 1) // BLOCK, (i + BLOCK - 1) // BLOCK
    wp = torch.zeros(bo * BLOCK, bi * BLOCK, dtype=torch.float32)
    wp[:o, :i] = w
    blk = wp.view(bo, BLOCK, bi, BLOCK)
    amax = blk.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    codes = encode(blk / scale[:, None, :, None]).view(bo * BLOCK, bi * BLOCK)[:o, :i].contiguous()
    return codes, scale


def dequantize_block(codes, scale):
    o, i = codes.shape
    v = decode(codes)
    s = scale.repeat_interleave(BLOCK, 0)[:o].repeat_interleave(BLOCK, 1)[:, :i]
    return v * s


if __name__ == "__main__":
    # self-check: every finite code round-trips, midpoints go to the even code
    vals = TABLE.clone()
    finite = ~torch.isnan(vals)
    codes = torch.arange(256)[finite]
    enc = encode(vals[finite])
    # -0.0 encodes to 0x80 (signbit kept)
    assert torch.equal(enc.long(), codes), (enc, codes)
    mids = _MID
    e = encode(mids).long()
    assert bool((e % 2 == 0).all()), "ties must go to the even code"
    assert encode(torch.tensor([1000.0, -1000.0])).tolist() == [126, 254]
    w = torch.randn(200, 300)
    q, s = quantize_block(w)
    err = (dequantize_block(q, s) - w).abs().max().item()
    print("fp8 self-check ok, max abs dequant error", err, "scale shape", tuple(s.shape))
