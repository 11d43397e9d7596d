#!/usr/bin/python3
"""Training corpus for the shipped models: the fortune cookie databases of the Debian packages
`fortunes-min` and `fortunes` (fortune-mod 1.99.1, BSD license; see models/README.md),
/usr/share/games/fortunes/*. Each file is a list of quotes separated by lines holding a single
"%"; the separators are stripped and each quote becomes one document. `ascii-art` is skipped
(pictures, not prose). Exact duplicates are dropped. Split: a document goes to validation when
md5(text) mod 20 == 0 (5%, deterministic, independent of file order)."""
import hashlib
import os

FORTUNE_DIR = "/usr/share/games/fortunes"
SKIP = {"ascii-art"}


def documents():
    docs, seen = [], set()
    for fn in sorted(os.listdir(FORTUNE_DIR)):
        p = os.path.join(FORTUNE_DIR, fn)
        if "." in fn or fn in SKIP or os.path.islink(p) or not os.path.isfile(p):
            continue
        with open(p, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        for q in text.replace("\r\n", "\n").split("\n%\n"):
            q = q.strip("\n").rstrip()
            if q.startswith("%"):
                q = q[1:].strip("\n")
            if len(q) < 2 or q in seen:
                continue
            seen.add(q)
            docs.append(q)
    return docs


def is_val(doc):
    return int(hashlib.md5(doc.encode("utf-8")).hexdigest(), 16) % 20 == 0


def split():
    train, val = [], []
    for d in documents():
        (val if is_val(d) else train).append(d)
    return train, val


if __name__ == "__main__":
    tr, va = split()
    print("train docs %d (%d chars), val docs %d (%d chars)" % (
        len(tr), sum(map(len, tr)), len(va), sum(map(len, va))))
    print(tr[0][:200])
