#!/usr/bin/env python3
"""Writes the committed seeds of the `gguf` and `tokenizer` fuzz targets (GGUF v3 files small
enough to mutate: a tiny llama model with a byte-level tokenizer, a SentencePiece-style
tokenizer, a qwen2 header). Run from this folder: python3 make_seeds.py"""

import struct
from pathlib import Path

U32, I32, F32, BOOL, STR, ARR, U64 = 4, 5, 6, 7, 8, 9, 10


def s(b):
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def val(t, v):
    if t == U32:
        return struct.pack("<I", v)
    if t == I32:
        return struct.pack("<i", v)
    if t == F32:
        return struct.pack("<f", v)
    if t == BOOL:
        return bytes([v])
    if t == STR:
        return s(v)
    if t == U64:
        return struct.pack("<Q", v)
    raise ValueError(t)


def kv(key, t, v, elem=None):
    out = s(key) + struct.pack("<I", t)
    if t == ARR:
        out += struct.pack("<IQ", elem, len(v)) + b"".join(val(elem, x) for x in v)
    else:
        out += val(t, v)
    return out


def gguf(meta, tensors=(), align=32):
    """tensors: (name, dims (ggml order: innermost first), f32 data)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta)
    offset, infos, blobs = 0, b"", []
    for name, dims, data in tensors:
        infos += s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", 0, offset)  # type 0 = F32
        blob = struct.pack(f"<{len(data)}f", *data)
        blob += b"\0" * (-len(blob) % align)
        blobs.append(blob)
        offset += len(blob)
    out += infos
    out += b"\0" * (-len(out) % align)
    return out + b"".join(blobs)


BYTE_VOCAB = ["<|im_start|>", "<|im_end|>", "H", "e", "l", "o", "Ġ", "w", "r", "d", "He", "ll", "Ġw", "1", "2"]
BYTE_MERGES = ["H e", "l l", "Ġ w"]


def byte_tokenizer(pre="smollm"):
    return [
        kv("tokenizer.ggml.model", STR, "gpt2"),
        kv("tokenizer.ggml.pre", STR, pre),
        kv("tokenizer.ggml.tokens", ARR, BYTE_VOCAB, STR),
        kv("tokenizer.ggml.merges", ARR, BYTE_MERGES, STR),
        kv("tokenizer.ggml.token_type", ARR, [3, 3] + [1] * (len(BYTE_VOCAB) - 2), I32),
        kv("tokenizer.ggml.bos_token_id", U32, 0),
        kv("tokenizer.ggml.eos_token_id", U32, 1),
        kv("tokenizer.chat_template", STR, "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"),
    ]


def tiny_llama():
    v, h, f, heads = len(BYTE_VOCAB), 4, 8, 2
    meta = [
        kv("general.architecture", STR, "llama"),
        kv("general.alignment", U32, 32),
        kv("llama.block_count", U32, 1),
        kv("llama.embedding_length", U32, h),
        kv("llama.feed_forward_length", U32, f),
        kv("llama.attention.head_count", U32, heads),
        kv("llama.attention.head_count_kv", U32, 1),
        kv("llama.context_length", U32, 64),
    ] + byte_tokenizer()
    w = lambda n: [((i * 7919) % 13 - 6) / 10 for i in range(n)]  # noqa: E731
    hd = h // heads
    tensors = [
        ("token_embd.weight", [h, v], w(h * v)),
        ("blk.0.attn_norm.weight", [h], [1.0] * h),
        ("blk.0.attn_q.weight", [h, h], w(h * h)),
        ("blk.0.attn_k.weight", [h, hd], w(h * hd)),
        ("blk.0.attn_v.weight", [h, hd], w(h * hd)),
        ("blk.0.attn_output.weight", [h, h], w(h * h)),
        ("blk.0.ffn_norm.weight", [h], [1.0] * h),
        ("blk.0.ffn_gate.weight", [h, f], w(h * f)),
        ("blk.0.ffn_up.weight", [h, f], w(h * f)),
        ("blk.0.ffn_down.weight", [f, h], w(f * h)),
        ("output_norm.weight", [h], [1.0] * h),
    ]
    return gguf(meta, tensors)


def spm():
    toks = ["<unk>", "<s>", "</s>", "<0x41>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"]
    return gguf([
        kv("tokenizer.ggml.model", STR, "llama"),
        kv("tokenizer.ggml.tokens", ARR, toks, STR),
        kv("tokenizer.ggml.scores", ARR, [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -1.5, -2.5, -0.5], F32),
        kv("tokenizer.ggml.token_type", ARR, [2, 3, 3, 6, 1, 1, 1, 1, 1, 1], I32),
        kv("tokenizer.ggml.bos_token_id", U32, 1),
        kv("tokenizer.ggml.eos_token_id", U32, 2),
        kv("tokenizer.ggml.add_space_prefix", BOOL, 1),
    ])


def main():
    here = Path(__file__).resolve().parent
    g = here / "seeds" / "gguf"
    g.mkdir(parents=True, exist_ok=True)
    (g / "tiny_llama.gguf").write_bytes(tiny_llama())
    (g / "byte_tokenizer.gguf").write_bytes(gguf(byte_tokenizer("llama-bpe")))
    (g / "spm_tokenizer.gguf").write_bytes(spm())
    (g / "qwen2_header.gguf").write_bytes(gguf([kv("general.architecture", STR, "qwen2"), kv("qwen2.block_count", U32, 2)]))
    t = here / "seeds" / "tokenizer"
    t.mkdir(parents=True, exist_ok=True)
    sep = b"\xff"
    vocab = sep.join(x.encode() for x in BYTE_VOCAB)
    merges = sep.join(x.encode() for x in BYTE_MERGES)
    # flags bos eos 0xFE tokens 0xFE merges 0xFE text
    (t / "byte_level").write_bytes(bytes([0b0010100, 0, 1]) + b"\xfe" + vocab + b"\xfe" + merges + b"\xfe" + b"Hello world 12")
    spm_vocab = sep.join(x.encode() for x in ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab"])
    (t / "spm").write_bytes(bytes([0b0100011, 1, 2]) + b"\xfe" + spm_vocab + b"\xfe\xfe" + b"ab a b")
    (t / "template").write_bytes(bytes([0b1000000, 0, 1]) + b"\xfe" + vocab + b"\xfe" + merges + b"\xfe" + b"{{ messages[0].content }}{% for x in range(3) %}{{ x }}{% endfor %}")


if __name__ == "__main__":
    main()
