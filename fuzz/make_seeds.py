#!/usr/bin/env python3
"""Seed corpora for the fuzz targets, made at run time from the real files in the repository
(tests/golden, models/) and ../shared/testdata, read in place: nothing is copied into the
repository. Large files are cut down to small valid ones of the same structure (a few tensors of
a real header; a vocabulary of a few hundred entries with the merges among them), since libFuzzer
mutates small inputs far faster.

usage: make_seeds.py ROOT OUT   (ROOT: the repository; OUT: OUT/<target>/ is filled)
"""
import base64, glob, json, os, struct, sys

root, out = sys.argv[1], sys.argv[2]
shared = os.path.join(root, "..", "shared", "testdata")


def put(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def files(*patterns):
    found = []
    for p in patterns:
        found += sorted(glob.glob(os.path.join(root, p)))
    return found


# safetensors: each real file's header with its first 6 tensors, each cut to <= 64 elements.
DT = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
for i, path in enumerate(files("tests/golden/*/*.safetensors", "models/*/model.safetensors")):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data_start = 8 + n
        items = [(k, v) for k, v in header.items() if k != "__metadata__"]
        items.sort(key=lambda kv: kv[1]["data_offsets"][0])
        new, blob = {"__metadata__": {"format": "pt"}}, b""
        for name, info in items[:6]:
            shape = info["shape"]
            keep = [min(d, 8) for d in shape][:2] if shape else []
            count = 1
            for d in keep:
                count *= d
            nbytes = count * DT[info["dtype"]]
            f.seek(data_start + info["data_offsets"][0])
            new[name] = {"dtype": info["dtype"], "shape": keep, "data_offsets": [len(blob), len(blob) + nbytes]}
            blob += f.read(nbytes)
    text = json.dumps(new).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    put("safetensors", f"real{i}.safetensors", struct.pack("<Q", len(text)) + text + blob)

# shard index: real indexes, and a small one cut from each.
for i, path in enumerate(files("tests/golden/*/model.safetensors.index.json", "checkpoints/*/model.safetensors.index.json")):
    raw = open(path, "rb").read()
    put("shard_index", f"real{i}.json", raw)
    index = json.loads(raw)
    small = dict(list(index["weight_map"].items())[:8])
    put("shard_index", f"small{i}.json", json.dumps({"metadata": index.get("metadata", {}), "weight_map": small}, indent=2))

# config.json: every real one.
for i, path in enumerate(files("tests/golden/*/config.json", "models/*/config.json", "checkpoints/*/config.json")):
    put("config", f"real{i}.json", open(path, "rb").read())


def small_tokenizer(tok, keep=400):
    vocab = tok["model"]["vocab"]
    kept = dict(sorted(vocab.items(), key=lambda kv: kv[1])[:keep])
    merges = []
    for m in tok["model"].get("merges", []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in kept and b in kept and a + b in kept:
            merges.append(m)
    tok = dict(tok)
    tok["model"] = dict(tok["model"], vocab=kept, merges=merges)
    tok["added_tokens"] = tok.get("added_tokens", [])[:8]
    return tok


# tokenizer.json (+ "\0" + tokenizer_config.json): each real vocabulary cut to 400 entries.
tok_dirs = files("models/*") + sorted(glob.glob(os.path.join(shared, "tokenizers", "*")))
for d in tok_dirs:
    tj = os.path.join(d, "tokenizer.json")
    if not os.path.exists(tj):
        continue
    name = os.path.basename(d)
    small = json.dumps(small_tokenizer(json.load(open(tj, encoding="utf-8"))), ensure_ascii=False).encode()
    cfg_path = os.path.join(d, "tokenizer_config.json")
    cfg = open(cfg_path, "rb").read() if os.path.exists(cfg_path) else b""
    put("tokenizer_json", f"{name}.json", small + (b"\0" + cfg if cfg else b""))

# tiktoken.model (+ "\0" + tokenizer_config.json): the 256 bytes, then the byte strings of the
# k3-nano vocabulary as ranks, with Kimi-style specials.
byte_decoder = {}
n = 0
bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
cs = bs[:]
for b in range(256):
    if b not in bs:
        bs.append(b)
        cs.append(256 + n)
        n += 1
byte_decoder = {chr(c): b for b, c in zip(bs, cs)}
ranks = [bytes([b]) for b in range(256)]
k3 = os.path.join(root, "models", "k3-nano", "tokenizer.json")
if os.path.exists(k3):
    seen = set(ranks)
    for token, _ in sorted(json.load(open(k3, encoding="utf-8"))["model"]["vocab"].items(), key=lambda kv: kv[1]):
        try:
            raw = bytes(byte_decoder[ch] for ch in token)
        except KeyError:
            continue
        if raw not in seen:
            seen.add(raw)
            ranks.append(raw)
        if len(ranks) >= 600:
            break
model = "".join(f"{base64.b64encode(r).decode()} {i}\n" for i, r in enumerate(ranks))
specials = {str(len(ranks) + i): {"content": c, "special": True} for i, c in enumerate(["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>"])}
cfg = json.dumps({"bos_token": "[BOS]", "eos_token": "[EOS]", "added_tokens_decoder": specials})
put("tiktoken", "k3_ranks.model", model.encode() + b"\0" + cfg.encode())
put("tiktoken", "k3_ranks_noconfig.model", model.encode())

# tokenizer_encode: the texts of the real vocabularies' test cases.
count = 0
for path in sorted(glob.glob(os.path.join(shared, "tokenizers", "*", "*.json"))):
    if os.path.basename(path) in ("tokenizer.json", "tokenizer_config.json"):
        continue
    try:
        cases = json.load(open(path, encoding="utf-8"))
    except Exception:
        continue
    for case in cases if isinstance(cases, list) else cases.get("cases", []):
        if isinstance(case, dict) and isinstance(case.get("text"), str) and count < 400:
            put("tokenizer_encode", f"case{count}.txt", case["text"].encode("utf-8", "surrogatepass"))
            count += 1
put("tokenizer_encode", "mixed.txt", "Hello wörld 你好 😀 <｜begin▁of▁sentence｜>\n\t  x".encode())

# chat templates: the real .jinja files and every tokenizer_config.json's chat_template.
for path in sorted(glob.glob(os.path.join(shared, "chat_templates", "*.jinja"))):
    put("chat_template", os.path.basename(path), open(path, "rb").read())
for d in tok_dirs:
    cfg_path = os.path.join(d, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        t = json.load(open(cfg_path, encoding="utf-8")).get("chat_template")
        if isinstance(t, str):
            put("chat_template", os.path.basename(d) + ".jinja", t)
put("chat_template", "features.jinja",
    "{% macro m(x, y=2) %}{{ x ~ y }}{% endmacro %}{% set ns = namespace(n=0) %}"
    "{% for msg in messages if msg.role != 'system' %}{% set ns.n = ns.n + 1 %}"
    "{{ loop.index }}:{{ msg.role | upper }} {{ msg.content | tojson }}{% if loop.last %}{{ m(ns.n) }}{% endif %}"
    "{% else %}none{% endfor %}{{ tools | length }}{{ '%s-%d' % ('a', 3) }}{{ [1,2,3] | join(',') }}"
    "{{ {'a': 1}.items() | list }}{{ 'x'.split('') if false else 'abc'[1:] }}{% raw %}{{ raw }}{% endraw %}")

# request: the first byte picks the endpoint (0 completions, 1 chat, 2 /tokenize, 3 /detokenize),
# the rest is a body as OpenAI clients and vLLM's extensions send it.
REQUESTS = [
    (0, {"model": "k3-nano", "prompt": "The meaning of life is", "max_tokens": 8, "temperature": 0}),
    (0, {"prompt": ["Love is", "A computer is"], "max_tokens": 4, "n": 2, "seed": 7, "top_p": 0.9, "top_k": 20,
         "min_p": 0.05, "stop": ["\n", "."], "logprobs": 3, "echo": True, "stream": True,
         "stream_options": {"include_usage": True}}),
    (0, {"prompt": [1, 200, 300], "max_tokens": 3, "logit_bias": {"17": -100, "42": 5.5}, "ignore_eos": True,
         "stop_token_ids": [2, 3], "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
         "user": "u"}),
    (0, {"prompt": [[1, 2], [3]], "max_completion_tokens": 2, "min_tokens": 1, "include_stop_str_in_output": True,
         "add_special_tokens": False}),
    (1, {"model": "k3-nano", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}],
         "max_tokens": 5, "logprobs": True, "top_logprobs": 2, "stream": True}),
    (1, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}],
         "add_generation_prompt": False, "continue_final_message": False, "chat_template_kwargs": {"thinking": True},
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
         "tool_choice": "none", "max_completion_tokens": 3}),
    (2, {"prompt": "Hello world", "add_special_tokens": True}),
    (2, {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True}),
    (3, {"tokens": [1, 100, 200, 4095]}),
]
for i, (endpoint, body) in enumerate(REQUESTS):
    put("request", f"body{i}.bin", bytes([endpoint]) + json.dumps(body).encode())
