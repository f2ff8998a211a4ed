"""Gemma 3 270M served by the real binary (`cachet serve --model <gemma file>`), and the
one-line exit-2 error for a model cachet cannot run.

The Gemma tests skip when `~/.cache/cachet/gemma-3-270m-q4_k_m.gguf` (scripts/fetch-gemma3.sh,
run by scripts/test-deps.sh) is absent, except under CI (`CI` set), where its absence fails
them. Expected values come from llama.cpp on the same file: its tokenizer gives the chat
prompt's 16 ids (`llama-tokenize --ids`) and its first 7 greedy tokens (llama-server
`/completion`, temperature 0), and its greedy continuation of "The capital of France is"
(crates/cachet-model/tests/fixtures/gemma3-270m-greedy.json) begins with the 10 tokens
asserted below, which cachet's greedy run shares (crates/cachet-model/tests/real_gemma3.rs).
"""

from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import tempfile

import openai
import pytest

from conftest import BIN, start_server

MODEL = pathlib.Path.home() / ".cache" / "cachet" / "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="module")
def gemma():
    if not MODEL.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{MODEL} not found under CI (scripts/fetch-gemma3.sh fetches it)")
        pytest.skip(f"{MODEL} not found (run scripts/fetch-gemma3.sh)")
    s = start_server(
        [],
        executor_args=["--model", str(MODEL), "--block-size", "16", "--threads", "2"],
    )
    yield s
    s.stop()


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0)


def test_gemma3_completion_is_llama_cpp_greedy(gemma):
    r = client(gemma).completions.create(
        model=gemma.model(), prompt="The capital of France is", max_tokens=10, temperature=0
    )
    # <bos> The capital of France is: 6 ids; llama.cpp's first 10 greedy tokens.
    assert r.usage.prompt_tokens == 6
    assert r.usage.completion_tokens == 10
    assert r.choices[0].text == " the capital of the country of France. It is"
    assert r.choices[0].finish_reason == "length"


def test_gemma3_chat_uses_the_turn_format(gemma):
    # The 270M file is the pretrained model: it echoes the question rather than answering.
    # llama.cpp, given the same turn-format prompt, greedily continues with these 7 tokens
    # (each ahead by at least 0.9 logits; the 8th is a near-tie).
    c = client(gemma)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = c.chat.completions.create(model=gemma.model(), messages=messages, max_tokens=7, temperature=0)
    # <bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n
    assert r.usage.prompt_tokens == 16
    assert r.usage.completion_tokens == 7
    choice = r.choices[0]
    assert choice.message.content == "What is the capital of France?"
    assert choice.finish_reason == "length"
    stream = c.chat.completions.create(
        model=gemma.model(), messages=messages, max_tokens=7, temperature=0, stream=True
    )
    parts, reasons = [], []
    for chunk in stream:
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert "".join(parts) == choice.message.content
    assert reasons == ["length"]


def _gguf(path: pathlib.Path, arch: str, tensor_type: int | None = None) -> None:
    """A minimal GGUF v3: `general.architecture` and, with `tensor_type`, one 32x1 tensor
    of that ggml type id."""

    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    n_tensors = 0 if tensor_type is None else 1
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, 1)
    out += s("general.architecture") + struct.pack("<I", 8) + s(arch)
    if tensor_type is not None:
        out += s("token_embd.weight") + struct.pack("<IQQIQ", 2, 32, 1, tensor_type, 0)
    out += b"\0" * (-len(out) % 32) + b"\0" * 256
    path.write_bytes(out)


@pytest.mark.parametrize(
    "arch,tensor_type,message",
    [
        (
            "mamba9",
            None,
            "cachet: unsupported architecture 'mamba9' (supported: llama, qwen2, qwen3, gemma3)",
        ),
        # ggml type 16 is IQ2_XXS.
        ("llama", 16, "cachet: tensor 'token_embd.weight' has unsupported type IQ2_XXS"),
    ],
)
def test_unsupported_model_is_one_line_and_exit_2(arch, tensor_type, message):
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "model.gguf"
        _gguf(path, arch, tensor_type)
        p = subprocess.run(
            [BIN, "serve", "--model", str(path), "--host", "127.0.0.1", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "RUST_BACKTRACE": "1", "NO_COLOR": "1"},
        )
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(message), p.stderr
    assert "(supported: " in lines[-1]
    assert "backtrace" not in p.stderr.lower() and "panicked" not in p.stderr
    assert "Caused by" not in p.stderr
