#!/usr/bin/python3
"""Byte-level BPE (GPT-2 style) used by the trainer: the ByteLevel alphabet, the GPT-2
pre-tokenizer regex, and an encoder/decoder for a Hugging Face tokenizer.json
(model BPE + pre_tokenizer ByteLevel(use_regex=true) + decoder ByteLevel + added tokens)."""
import json

import regex

# GPT-2's pre-tokenization pattern (ByteLevel pre-tokenizer with use_regex=true)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PAT = regex.compile(GPT2_PATTERN)


def bytes_to_unicode():
    """The ByteLevel alphabet: printable latin-1 bytes map to themselves, the other 68 bytes to
    U+0100.. in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


B2U = bytes_to_unicode()
U2B = {v: k for k, v in B2U.items()}


def pretokenize(text):
    """text -> list of ByteLevel-mapped words."""
    return ["".join(B2U[b] for b in w.encode("utf-8")) for w in PAT.findall(text)]


class Tokenizer:
    def __init__(self, vocab, merges, added):
        self.vocab = vocab  # str -> id
        self.inv = {i: s for s, i in vocab.items()}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.added = added  # content -> id
        for c, i in added.items():
            self.inv[i] = c
        self.special_re = regex.compile("(" + "|".join(regex.escape(c) for c in
                                                       sorted(added, key=len, reverse=True)) + ")") if added else None
        self.cache = {}

    @staticmethod
    def load(path):
        with open(path, encoding="utf-8") as f:
            j = json.load(f)
        m = j["model"]
        merges = [x if isinstance(x, str) else " ".join(x) for x in m["merges"]]
        added = {t["content"]: t["id"] for t in j.get("added_tokens", [])}
        return Tokenizer(m["vocab"], merges, added)

    def _bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            best, bi = None, -1
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best):
                    best, bi = r, i
            if best is None:
                break
            parts[bi:bi + 2] = [parts[bi] + parts[bi + 1]]
        ids = [self.vocab[p] for p in parts]
        self.cache[word] = ids
        return ids

    def encode(self, text, specials=True):
        out = []
        chunks = self.special_re.split(text) if (specials and self.special_re) else [text]
        for ch in chunks:
            if not ch:
                continue
            if specials and ch in self.added:
                out.append(self.added[ch])
                continue
            for w in pretokenize(ch):
                out.extend(self._bpe(w))
        return out

    def decode(self, ids):
        s = []
        buf = bytearray()
        for i in ids:
            t = self.inv[int(i)]
            if t in self.added:
                s.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                s.append(t)
            else:
                buf.extend(U2B[c] for c in t)
        s.append(buf.decode("utf-8", errors="replace"))
        return "".join(s)

    def __len__(self):
        return len(self.inv)
