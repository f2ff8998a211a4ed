#!/usr/bin/env python3
"""Write a llama-architecture GGUF with seeded random F16 weights at a real model's shape
(issue 50, item 3): speed does not depend on weight values, so `cachet bench kernel` and
llama.cpp can be compared at 1 B and 8 B parameters without downloading a model. Quantize the
file with `scripts/peer/quantize-presets.sh` (e.g. PRESETS="Q4_K_M Q8_0").

Shapes (from the models' config.json):
  llama-3.2-1b: hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256, tied
  llama-3.1-8b: hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab 128256
  tiny:         hidden 256, 2 layers, 4 heads, 2 KV heads, FFN 512, vocab 512 (a smoke test)

The vocabulary is synthetic (GPT-2's 256 byte tokens then `<tok_N>`, no merges): text is tokenized byte by
byte, which is all a speed measurement needs. Weights are N(0, 0.02), norms 1.

Usage: random-llama-gguf.py SHAPE OUT.gguf [--seed N] [--yes]
It prints the disk it needs and refuses to start without that much free (or without --yes
when it needs more than 4 GiB). Needs the `gguf` and `numpy` PyPI packages.
"""

import argparse
import os
import shutil
import sys

import numpy as np

SHAPES = {
    "llama-3.2-1b": dict(hidden=2048, layers=16, heads=32, kv=8, ffn=8192, vocab=128256, tied=True),
    "llama-3.1-8b": dict(hidden=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=128256, tied=False),
    "tiny": dict(hidden=256, layers=2, heads=4, kv=2, ffn=512, vocab=512, tied=False),
}


def tensors(s):
    """(name, numpy shape [rows, cols] or [n]) of every tensor, in llama.cpp's names."""
    h, kvd = s["hidden"], s["hidden"] // s["heads"] * s["kv"]
    out = [("token_embd.weight", (s["vocab"], h))]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (h,)),
            (b + "attn_q.weight", (h, h)),
            (b + "attn_k.weight", (kvd, h)),
            (b + "attn_v.weight", (kvd, h)),
            (b + "attn_output.weight", (h, h)),
            (b + "ffn_norm.weight", (h,)),
            (b + "ffn_gate.weight", (s["ffn"], h)),
            (b + "ffn_up.weight", (s["ffn"], h)),
            (b + "ffn_down.weight", (h, s["ffn"])),
        ]
    out.append(("output_norm.weight", (h,)))
    if not s["tied"]:
        out.append(("output.weight", (s["vocab"], h)))
    return out


def byte_tokens():
    """GPT-2's byte-level alphabet (`bytes_to_unicode`): one token per byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=50)
    ap.add_argument("--yes", action="store_true", help="write even when it needs more than 4 GiB")
    a = ap.parse_args()
    s = SHAPES[a.shape]
    ts = tensors(s)
    # Matrices in F16, vectors in F32 (as llama.cpp's converter writes them).
    need = sum(int(np.prod(sh)) * (2 if len(sh) == 2 else 4) for _, sh in ts) + 8 * 2**20
    params = sum(int(np.prod(sh)) for _, sh in ts)
    out_dir = os.path.dirname(os.path.abspath(a.out))
    free = shutil.disk_usage(out_dir).free
    print(
        f"[random-llama-gguf] {a.shape}: {params / 1e9:.2f} B parameters, needs {need / 2**30:.2f} GiB "
        f"in {out_dir} ({free / 2**30:.1f} GiB free); Q4_K_M and Q8_0 copies need about "
        f"{need * 0.30 / 2**30:.1f} and {need * 0.53 / 2**30:.1f} GiB more",
        file=sys.stderr,
    )
    if free < need:
        sys.exit("[random-llama-gguf] not enough free disk")
    if need > 4 * 2**30 and not a.yes:
        sys.exit("[random-llama-gguf] more than 4 GiB: pass --yes to write it")

    import gguf  # imported late: the disk check works without it

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(f"random-{a.shape}")
    w.add_context_length(8192)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s["vocab"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    toks = byte_tokens()
    toks += [f"<tok_{i}>" for i in range(256, s["vocab"])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([gguf.TokenType.NORMAL] * s["vocab"])
    w.add_token_merges([])
    w.add_bos_token_id(s["vocab"] - 2)
    w.add_eos_token_id(s["vocab"] - 1)
    for name, sh in ts:
        dt = np.float16 if len(sh) == 2 else np.float32
        w.add_tensor_info(name, sh, np.dtype(dt), int(np.prod(sh)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(a.seed)
    for name, sh in ts:
        if len(sh) == 1:
            w.write_tensor_data(np.ones(sh, dtype=np.float32))
            continue
        # Row chunks keep the f32 temporaries small at 8 B.
        t = np.empty(sh, dtype=np.float16)
        for r in range(0, sh[0], 4096):
            t[r : r + 4096] = rng.normal(0.0, 0.02, size=(min(4096, sh[0] - r), sh[1]))
        w.write_tensor_data(t)
        del t
    w.close()
    print(f"[random-llama-gguf] wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
