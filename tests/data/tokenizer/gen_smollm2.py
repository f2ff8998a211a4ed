#!/usr/bin/env python3
"""Generates smollm2.json: expected token ids for tricky strings under the tokenizer stored in
SmolLM2-135M-Instruct.Q4_1.gguf, from two implementations that share no code with cachet:

1. a pure-Python byte-level BPE written here (GPT-2 bytes<->unicode table, the `smollm`
   pre-tokenizer = every digit alone, then GPT-2's regex via the `regex` module, then rank-ordered
   merges; control tokens (token_type 3) are split out first), and
2. the HuggingFace `tokenizers` Python package with a tokenizer.json assembled here from the same
   GGUF fields (BPE + Sequence[Digits(individual_digits), ByteLevel] + ByteLevel decoder +
   special added tokens).

The GGUF fields are read with the `gguf` PyPI package (llama.cpp's reader). The script fails
unless both implementations agree on every string.

    python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install gguf tokenizers regex
    /tmp/tokvenv/bin/python tests/data/tokenizer/gen_smollm2.py [path/to/model.gguf]
"""
import json
import os
import sys

import gguf
import regex
from tokenizers import Tokenizer

CASES = [
    "Hello world",
    "Hello, world! How are you?",
    " leading space",
    "double  spaces   and    more",
    "trailing space ",
    "line one\nline two\n\nline four\r\n",
    "\n\n\n",
    "12345 3.14 1,000,000 and 2024-01-01",
    "Café naïve résumé façade Ångström",
    "日本語のテキストと中文文本",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "def f(x):\n    if x > 0:\n        return x ** 2\n\treturn -x",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after special<|im_end|>",
    "it's they're we've I'm you'll he'd DON'T",
    "   ",
    "a",
    "",
    "Ünïcödé ß ẞ Ω ∑ ∞ → ←",
    "https://example.com/path?q=1&r=two#frag",
]

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def load(path):
    r = gguf.GGUFReader(path)
    f = r.fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    merges = f["tokenizer.ggml.merges"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    pre = f["tokenizer.ggml.pre"].contents()
    assert pre == "smollm", pre
    return tokens, merges, types


class PyBpe:
    def __init__(self, tokens, merges, types):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
        self.specials = [t for t, ty in zip(tokens, types) if ty == 3]
        self.b2u = bytes_to_unicode()
        self.pat = regex.compile(GPT2_PAT)
        self.special_re = regex.compile("(" + "|".join(regex.escape(s) for s in sorted(self.specials, key=len, reverse=True)) + ")")

    def bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            best = None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
        return [self.vocab[p] for p in parts]

    def encode(self, text):
        ids = []
        for seg in self.special_re.split(text):
            if seg == "":
                continue
            if seg in self.specials:
                ids.append(self.vocab[seg])
                continue
            # smollm: Digits(individual_digits=True) then ByteLevel's GPT-2 regex.
            pieces = []
            for chunk in regex.split(r"(\p{N})", seg):
                if chunk:
                    pieces.extend(self.pat.findall(chunk))
            for p in pieces:
                word = "".join(self.b2u[b] for b in p.encode("utf-8"))
                ids.extend(self.bpe(word))
        return ids


def hf_tokenizer(tokens, merges, types):
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty == 3
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": list(merges),
        },
    }
    return Tokenizer.from_str(json.dumps(spec))


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/cachet/SmolLM2-135M-Instruct.Q4_1.gguf")
    tokens, merges, types = load(path)
    py = PyBpe(tokens, merges, types)
    hf = hf_tokenizer(tokens, merges, types)
    out = []
    for text in CASES:
        a = py.encode(text)
        b = hf.encode(text, add_special_tokens=False).ids
        if a != b:
            sys.exit(f"implementations disagree on {text!r}:\n  python bpe: {a}\n  tokenizers: {b}")
        assert hf.decode(b, skip_special_tokens=False) == text, text
        out.append({"text": text, "ids": a})
    assert out[0]["ids"][0] == 19556, out[0]
    dst = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2.json")
    with open(dst, "w", encoding="utf-8") as f:
        json.dump({"model": os.path.basename(path), "generator": "gen_smollm2.py", "cases": out}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(out)} cases to {dst}")


if __name__ == "__main__":
    main()
