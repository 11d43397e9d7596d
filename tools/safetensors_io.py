#!/usr/bin/python3
"""Minimal safetensors reader/writer (no third-party `safetensors` package).

File layout: 8-byte little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
header padded with spaces to a multiple of 8, then the raw little-endian tensor bytes.

Tensors are handled as torch tensors. BF16 is bit-cast through int16; F8_E4M3 is exposed as
uint8 codes (torch 1.13 has no float8 dtype) -- see fp8.py for encoding/decoding.
"""
import json
import os
import struct

import numpy as np
import torch

# dtype string -> (torch dtype used for storage, element size)
_DT = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "U8": (torch.uint8, 1),
    "F8_E4M3": (torch.uint8, 1),
}
_TORCH2DT = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}


def tensor_bytes(t):
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def bytes_to_tensor(buf, dtype, shape):
    tdt, _ = _DT[dtype]
    if tdt == torch.bfloat16:
        arr = np.frombuffer(buf, dtype=np.int16).copy()
        return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
    npdt = {torch.float32: np.float32, torch.float16: np.float16, torch.int32: np.int32,
            torch.int64: np.int64, torch.uint8: np.uint8}[tdt]
    arr = np.frombuffer(buf, dtype=npdt).copy()
    return torch.from_numpy(arr).reshape(shape)


class Entry:
    """One tensor to write: name, dtype string, shape, and either a tensor or a producer
    (a zero-argument function returning the tensor), so huge files can be streamed."""

    def __init__(self, name, dtype, shape, tensor=None, producer=None):
        self.name, self.dtype, self.shape = name, dtype, list(shape)
        self.tensor, self.producer = tensor, producer

    def nbytes(self):
        n = 1
        for s in self.shape:
            n *= s
        return n * _DT[self.dtype][1]

    def get(self):
        t = self.tensor if self.tensor is not None else self.producer()
        assert list(t.shape) == self.shape, (self.name, list(t.shape), self.shape)
        assert _DT[self.dtype][0] == t.dtype, (self.name, t.dtype, self.dtype)
        return t


def entry(name, t, dtype=None):
    """Entry from a ready tensor; dtype defaults from the torch dtype (uint8 -> U8)."""
    return Entry(name, dtype or _TORCH2DT[t.dtype], t.shape, tensor=t)


def write_safetensors(path, entries, metadata=None):
    header = {}
    off = 0
    for e in entries:
        n = e.nbytes()
        header[e.name] = {"dtype": e.dtype, "shape": e.shape, "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((8 - len(hj) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for e in entries:
            b = tensor_bytes(e.get())
            assert len(b) == e.nbytes(), e.name
            f.write(b)
    os.replace(tmp, path)


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n).decode("utf-8"))
    return h, 8 + n


def read_safetensors(path):
    """Returns (dict name -> (dtype string, tensor), metadata dict)."""
    h, base = read_header(path)
    meta = h.pop("__metadata__", {}) or {}
    out = {}
    with open(path, "rb") as f:
        for name, info in h.items():
            b, e = info["data_offsets"]
            f.seek(base + b)
            out[name] = (info["dtype"], bytes_to_tensor(f.read(e - b), info["dtype"], info["shape"]))
    return out, meta


def read_checkpoint_dir(d):
    """All tensors of an HF checkpoint dir (single model.safetensors or sharded with index)."""
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fn in files:
        t, _ = read_safetensors(os.path.join(d, fn))
        out.update(t)
    return out
