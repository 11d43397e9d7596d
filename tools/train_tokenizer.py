#!/usr/bin/python3
"""Trains a byte-level BPE tokenizer on the training split of the corpus (tools/corpus.py) and
writes a standard Hugging Face tokenizer.json + tokenizer_config.json.

  tools/train_tokenizer.py --out checkpoints/tokenizer [--vocab-size 4096]

Algorithm: GPT-2 regex pre-tokenization, ByteLevel alphabet (256 base tokens, ids 0..255 in byte
order), then repeatedly merge the most frequent adjacent pair (ties: the lexicographically smallest
pair) until vocab_size - len(SPECIALS) tokens; pairs seen fewer than 2 times are never merged.
The special tokens get the last ids. Deterministic.
"""
import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
from bpe import B2U, GPT2_PATTERN, pretokenize  # noqa: E402

SPECIALS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}{{ eos_token }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}{{ eos_token }}"
    "{% else %}<|assistant|>{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_bpe(texts, vocab_size, log=True):
    counts = collections.Counter()
    for t in texts:
        counts.update(pretokenize(t))
    words = [list(w) for w in counts]
    freqs = list(counts.values())
    pairs = collections.Counter()
    where = collections.defaultdict(set)
    for wi, (w, f) in enumerate(zip(words, freqs)):
        for a, b in zip(w, w[1:]):
            pairs[(a, b)] += f
            where[(a, b)].add(wi)
    n_merges = vocab_size - 256 - len(SPECIALS)
    merges = []
    while len(merges) < n_merges:
        if not pairs:
            break
        top = max(pairs.values())
        if top < 2:
            break
        best = min(p for p, c in pairs.items() if c == top)
        merges.append(best)
        a, b = best
        new = a + b
        for wi in list(where[best]):
            w, f = words[wi], freqs[wi]
            for x, y in zip(w, w[1:]):
                pairs[(x, y)] -= f
                if pairs[(x, y)] <= 0:
                    del pairs[(x, y)]
                where[(x, y)].discard(wi)
            i, out = 0, []
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[wi] = out
            for x, y in zip(out, out[1:]):
                pairs[(x, y)] += f
                where[(x, y)].add(wi)
        where.pop(best, None)
        if log and len(merges) % 500 == 0:
            print("  %d merges, last %r (count %d)" % (len(merges), new, top), flush=True)
    return merges


def build_json(merges):
    vocab = {B2U[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    n = len(vocab)
    added = [{"id": n + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": dict(bl),
        "post_processor": None,
        "decoder": dict(bl),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": ["%s %s" % m for m in merges]},
    }


def tokenizer_config(model_max_length):
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|eos|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--model-max-length", type=int, default=1024)
    a = ap.parse_args()
    train, _ = corpus.split()
    merges = train_bpe(train, a.vocab_size)
    os.makedirs(a.out, exist_ok=True)
    j = build_json(merges)
    with open(os.path.join(a.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False, indent=1)
    with open(os.path.join(a.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(a.model_max_length), f, ensure_ascii=False, indent=2)
    print("vocab %d (+%d special) written to %s; pre-tokenizer regex %s" % (
        len(j["model"]["vocab"]), len(SPECIALS), a.out, GPT2_PATTERN))


if __name__ == "__main__":
    main()
