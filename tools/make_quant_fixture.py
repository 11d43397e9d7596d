#!/usr/bin/python3
"""Writes tests/golden/quant/quant_fixture.safetensors: small 4-bit matrices in the published
on-disk formats, decoded here with numpy from the format descriptions alone (no moat code, no
torch), for tests/ops/quant_matmul_test.cpp to check WeightMatrix::at() and every matmul kernel
against.

Formats (../shared/K3.md, "Quantized expert formats"):
  compressed-tensors mxfp4-pack-quantized: X.weight_packed U8 [out, in/2], element 2j in the low
    nibble of byte j, 2j+1 in the high one; code bit 3 = sign, bits 0-2 index
    [0, .5, 1, 1.5, 2, 3, 4, 6]; X.weight_scale U8 [out, in/32] e8m0: value = e2m1 * 2^(s - 127).
  compressed-tensors pack-quantized (int4): X.weight_packed I32 [out, in/8], element i of a word at
    bits 4i..4i+3 holding q + 8; X.weight_scale BF16 [out, in/32]; X.weight_shape I64 [2];
    value = (nibble - 8) * scale.
  gpt-oss: X_blocks U8 [E, out, in/32, 16], X_scales U8 [E, out, in/32], same codes and scales.

Tensors written (N = 12 rows, K = 160 columns: five groups of 32, a ragged 128-block):
  mx.weight_packed, mx.weight_scale, mx.expected F32 [N, K]
  int4.weight_packed, int4.weight_scale, int4.weight_shape, int4.expected F32 [N, K]
  gptoss.w_blocks, gptoss.w_scales, gptoss.expected F32 [E, N, K] (E = 2)
  x F32 [T, K] (T = 5), mx.y, int4.y F32 [T, N] = x . expected^T (float64 sums)
The e8m0 scales include 0 (2^-127, an fp32 subnormal), 1, 126, 127, 128 and 254 (2^127); groups
with scale 254 hold codes of magnitude <= 1.5 so every value stays finite in fp32 (2 * 2^127
overflows), and x is small enough (|x| <= 1/64) that no y overflows.

Deterministic: rerunning writes the same bytes. Run: /usr/bin/python3 tools/make_quant_fixture.py
"""
import json
import os
import struct

import numpy as np

N, K, T, E = 12, 160, 5, 2
G = K // 32
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def decode_e2m1(code):
    """OCP FP4 E2M1 from the 4-bit code: sign bit 3, magnitude index bits 0-2."""
    mag = E2M1[code & 7]
    return np.where(code & 8, -mag, mag)


def e8m0(s):
    return np.power(2.0, s.astype(np.float64) - 127.0)


def bf16_bits(values):
    """float -> bfloat16 bit patterns, round to nearest even."""
    u = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, dtype string, numpy array); little-endian raw bytes in order."""
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, dtype, arr in tensors:
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def mxfp4_case(rng, rows):
    codes = rng.integers(0, 16, size=(rows, K)).astype(np.uint8)
    scales = rng.integers(118, 133, size=(rows, G)).astype(np.uint8)
    # the e8m0 edges, each in a row that also has ordinary groups
    for (r, g, s) in [(0, 0, 0), (0, 1, 1), (1, 2, 126), (1, 3, 127), (2, 4, 128), (3, 0, 254), (4, 1, 254),
                      (4, 3, 0), (5, 2, 1)]:
        scales[r % rows, g] = s
    for r in range(rows):
        for g in range(G):
            if scales[r, g] == 254:  # keep 2^127 * code finite: magnitudes 0..1.5 only
                codes[r, 32 * g:32 * g + 32] &= 0b1011
    codes[0, :16] = np.arange(16)  # every code once, in order
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    expected = decode_e2m1(codes.astype(np.int64)) * np.repeat(e8m0(scales), 32, axis=1)
    return packed, scales, expected


def main():
    rng = np.random.default_rng(20260727)
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "quant")
    os.makedirs(out_dir, exist_ok=True)

    mx_packed, mx_scale, mx_expected = mxfp4_case(rng, N)

    # int4: q in [-8, 7] stored as q + 8, eight per int32 word, element i at bits 4i..4i+3
    q = rng.integers(-8, 8, size=(N, K))
    q[0, :16] = np.arange(-8, 8)
    nib = (q + 8).astype(np.uint64)
    words = np.zeros((N, K // 8), dtype=np.uint64)
    for i in range(8):
        words |= nib[:, i::8] << np.uint64(4 * i)
    int4_packed = words.astype(np.uint32).view(np.int32)
    int4_scale_bits = bf16_bits(np.abs(rng.normal(0.0, 1.0, size=(N, G))) * 2.0 ** rng.integers(-10, 3, size=(N, G)))
    # independent decode of the stored words (not of q): nibble i of each word, minus 8
    w = int4_packed.view(np.uint32).astype(np.int64)
    dec = np.zeros((N, K), dtype=np.float64)
    for i in range(8):
        dec[:, i::8] = ((w >> (4 * i)) & 0xF) - 8
    int4_expected = dec * np.repeat(bf16_value(int4_scale_bits), 32, axis=1)
    assert np.array_equal(dec, q)

    # gpt-oss: [E, N, G, 16] blocks of the same codes layout, [E, N, G] scales
    oss = [mxfp4_case(rng, N) for _ in range(E)]
    oss_blocks = np.stack([p.reshape(N, G, 16) for p, _, _ in oss])
    oss_scales = np.stack([s for _, s, _ in oss])
    oss_expected = np.stack([e for _, _, e in oss])

    x = np.clip(rng.normal(0.0, 1.0, size=(T, K)), -4, 4) / 256.0
    x = x.astype(np.float32)
    mx_y = x.astype(np.float64) @ mx_expected.T
    int4_y = x.astype(np.float64) @ int4_expected.T
    assert np.all(np.isfinite(mx_expected)) and np.all(np.isfinite(mx_y))

    f32 = lambda a: np.asarray(a, dtype=np.float32)
    tensors = [
        ("mx.weight_packed", "U8", mx_packed),
        ("mx.weight_scale", "U8", mx_scale),
        ("mx.expected", "F32", f32(mx_expected)),
        ("int4.weight_packed", "I32", int4_packed),
        ("int4.weight_scale", "BF16", int4_scale_bits),
        ("int4.weight_shape", "I64", np.array([N, K], dtype=np.int64)),
        ("int4.expected", "F32", f32(int4_expected)),
        ("gptoss.w_blocks", "U8", oss_blocks),
        ("gptoss.w_scales", "U8", oss_scales),
        ("gptoss.expected", "F32", f32(oss_expected)),
        ("x", "F32", x),
        ("mx.y", "F32", f32(mx_y)),
        ("int4.y", "F32", f32(int4_y)),
    ]
    meta = {"generator": "tools/make_quant_fixture.py", "N": str(N), "K": str(K), "T": str(T), "E": str(E)}
    path = os.path.join(out_dir, "quant_fixture.safetensors")
    write_safetensors(path, tensors, meta)
    print(f"wrote {os.path.normpath(path)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
