#!/usr/bin/env python3
"""Record llama.cpp's greedy continuations of Gemma 3 270M (the fixture of
crates/cachet-model/tests/real_gemma3.rs).

Starts the pinned peer's llama-server (scripts/peer/build-llama.sh) on a free loopback port
with the model file, and for each prompt asks /tokenize (with BOS, as /completion adds it) and
/completion (temperature 0, top_k 1, EOS ignored, no prompt cache), then writes
crates/cachet-model/tests/fixtures/gemma3-270m-greedy.json:
  {"model": file name, "sha256": ..., "peer": llama-server --version,
   "cases": [{"name", "prompt", "prompt_tokens", "n_predict", "tokens", "text"}]}

Usage: python3 scripts/peer/record-gemma3-fixture.py [MODEL] [OUT]
"""
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

HOME = os.path.expanduser("~")
MODEL = sys.argv[1] if len(sys.argv) > 1 else f"{HOME}/.cache/cachet/gemma-3-270m-q4_k_m.gguf"
OUT = sys.argv[2] if len(sys.argv) > 2 else "crates/cachet-model/tests/fixtures/gemma3-270m-greedy.json"
SERVER = f"{HOME}/.cache/cachet/peer/bin/llama-server"


def long_prompt():
    """About 3,000 tokens (six windows of 512): numbered facts, then the next one begun."""
    lines = [f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(1, 301)]
    return "\n".join(lines) + "\nFact 301: the number 301 is"


CASES = [
    ("capital", "The capital of France is", 32),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', 32),
    ("story", "Once upon a time, in a small village by the sea,", 32),
    ("long", long_prompt(), 16),
]


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    version = subprocess.run([SERVER, "--version"], capture_output=True, text=True)
    proc = subprocess.Popen(
        [SERVER, "-m", MODEL, "--host", "127.0.0.1", "--port", str(port), "-c", "8192",
         "-t", "2", "-np", "1", "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.5)
        cases = []
        for name, prompt, n in CASES:
            ptoks = post(port, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
            r = post(port, "/completion", {
                "prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
            })
            cases.append({"name": name, "prompt": prompt, "prompt_tokens": ptoks,
                          "n_predict": n, "tokens": r["tokens"], "text": r["content"]})
            print(f"{name}: {len(ptoks)} prompt tokens -> {r['content']!r}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait()
    sha = hashlib.sha256(open(MODEL, "rb").read()).hexdigest()
    peer = (version.stdout + version.stderr).strip().splitlines()
    with open(OUT, "w") as f:
        json.dump({"model": os.path.basename(MODEL), "sha256": sha, "peer": peer,
                   "cases": cases}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
