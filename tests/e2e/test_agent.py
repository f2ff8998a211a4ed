"""The agent API end to end, against `cachet serve` on the simulated executor, through the real
clients: the OpenAI SDK's `.parse()` with a Pydantic model, tool loops (call, tool result, final
answer) through the OpenAI SDK (streaming and not) and the Anthropic SDK, LangChain's
`bind_tools` and `with_structured_output`, `logit_bias`, count_tokens, the Claude Code billing
line, and a walk of both SDKs' request schemas against the server's field table (README).

The simulated model writes random printable text; every structured answer here is valid only
because the grammar forced it.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex

import anthropic
import pytest
import requests
from openai import OpenAI
from pydantic import BaseModel, Field

from conftest import start_server

ROOT = pathlib.Path(__file__).resolve().parents[2]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "now",
        "description": "The time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


class Weather(BaseModel):
    city: str
    temperature_c: int
    sunny: bool


def oai(server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_openai_parse_with_a_pydantic_model(plain_server):
    c = oai(plain_server)
    r = c.chat.completions.parse(
        model=plain_server.model(),
        messages=[{"role": "user", "content": "Weather in Oslo as JSON."}],
        response_format=Weather,
        max_tokens=1500,
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, Weather), msg.content
    assert json.loads(msg.content) == msg.parsed.model_dump()
    # json_object: any object.
    r = c.chat.completions.create(
        model=plain_server.model(),
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=1500,
        seed=3,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_an_unsupported_schema_feature_is_a_400_naming_it(plain_server):
    r = requests.post(
        f"{plain_server.base_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "object", "if": {"properties": {}}}},
            },
        },
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format"
    assert "if" in err["message"], err


def _check_weather_call(call):
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    return args


def test_openai_tool_loop_non_streaming(plain_server):
    c = oai(plain_server)
    model = plain_server.model()
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(
        model=model, messages=msgs, tools=[WEATHER, CLOCK], tool_choice="required",
        parallel_tool_calls=False, max_tokens=400,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    calls = ch.message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "now")
    # Named: exactly that function, arguments per its schema.
    r = c.chat.completions.create(
        model=model, messages=msgs, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=400,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    call = ch.message.tool_calls[0]
    _check_weather_call(call)
    # The result goes back; the final answer is text.
    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    r = c.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], max_tokens=16)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length")
    assert ch.message.tool_calls is None and ch.message.content
    # The history reached the prompt in the generic format.
    rendered = requests.post(
        f"{plain_server.base_url}/v1/chat/completions/render",
        json={"messages": msgs, "tools": [WEATHER]}, timeout=30,
    ).json()["prompt"]
    assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": " in rendered
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in rendered
    assert "# Tools" in rendered and "get_weather" in rendered


def test_openai_tool_loop_streaming(plain_server):
    c = oai(plain_server)
    model = plain_server.model()
    msgs = [{"role": "user", "content": "Weather in Rome?"}]
    stream = c.chat.completions.create(
        model=model, messages=msgs, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=400, stream=True,
    )
    ids, name, args, finish, pieces = set(), None, "", None, 0
    for chunk in stream:
        ch = chunk.choices[0]
        for tc in ch.delta.tool_calls or []:
            assert tc.index == 0
            if tc.id:
                ids.add(tc.id)
            if tc.function and tc.function.name:
                name = tc.function.name
            if tc.function and tc.function.arguments:
                args += tc.function.arguments
                pieces += 1
        if ch.finish_reason:
            finish = ch.finish_reason
    assert finish == "tool_calls" and name == "get_weather" and len(ids) == 1
    assert pieces > 1, "arguments arrive incrementally"
    parsed = json.loads(args)
    assert set(parsed) == {"city"}
    call_id = ids.pop()
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "22 C"},
    ]
    text = "".join(
        (ch.choices[0].delta.content or "")
        for ch in c.chat.completions.create(model=model, messages=msgs, tools=[WEATHER],
                                            max_tokens=12, stream=True)
        if ch.choices
    )
    assert text


def test_anthropic_tool_loop(plain_server):
    c = anthropic.Anthropic(base_url=plain_server.base_url, api_key="unused", max_retries=0)
    model = plain_server.model()
    tools = [{
        "name": "get_weather", "description": "Current weather",
        "input_schema": WEATHER["function"]["parameters"],
    }]
    msgs = [{"role": "user", "content": "Weather in Lima?"}]
    m = c.messages.create(model=model, max_tokens=400, messages=msgs, tools=tools,
                          tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) >= 1 and uses[0].name == "get_weather"
    assert set(uses[0].input) == {"city"}
    msgs += [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": uses[0].id, "content": "19 C"}]},
    ]
    final = c.messages.create(model=model, max_tokens=16, messages=msgs, tools=tools)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.content[0].type == "text" and final.content[0].text
    # Streaming: input_json_delta pieces build the same kind of input.
    with c.messages.stream(model=model, max_tokens=400, messages=msgs[:1], tools=tools,
                           tool_choice={"type": "tool", "name": "get_weather"}) as s:
        kinds = [e.type for e in s]
        fm = s.get_final_message()
    assert "input_json" in kinds or "content_block_delta" in kinds
    assert fm.stop_reason == "tool_use"
    use = next(b for b in fm.content if b.type == "tool_use")
    assert use.name == "get_weather" and set(use.input) == {"city"}
    # count_tokens counts what /v1/messages runs (tools included).
    n_plain = c.messages.count_tokens(model=model, messages=msgs[:1]).input_tokens
    n_tools = c.messages.count_tokens(model=model, messages=msgs[:1], tools=tools).input_tokens
    assert n_tools > n_plain > 0


def test_langchain_bind_tools_and_structured_output(plain_server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=f"{plain_server.base_url}/v1", api_key="unused",
                     model=plain_server.model(), max_tokens=400, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Bern?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"]["city"], str)
    out = llm.with_structured_output(Weather).invoke("Weather in Bern as JSON")
    assert isinstance(out, Weather)


def test_logit_bias_forces_and_bans_on_the_simulator(plain_server):
    c = oai(plain_server)
    model = plain_server.model()
    # Byte tokenizer: byte b is token b + 3. +100 on "Z" forces it.
    z = ord("Z") + 3
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=5, logit_bias={str(z): 100})
    assert r.choices[0].message.content == "ZZZZZ"
    base = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=20).choices[0].message.content
    banned = {str(ord(ch) + 3): -100 for ch in set(base)}
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=20, logit_bias=banned)
    assert not set(r.choices[0].message.content) & set(base)
    for bad in ({"abc": 1}, {str(z): 101}, {"99999": 1}):
        e = requests.post(f"{plain_server.base_url}/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "x"}], "logit_bias": bad})
        assert e.status_code == 400 and e.json()["error"]["param"] == "logit_bias", e.text


def test_claude_code_billing_line_is_removed_and_said(server):
    base = server.base_url
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=fa690;"},
        {"type": "text", "text": "You are a helpful assistant. " * 8},
    ]
    body = {"model": server.model(), "max_tokens": 4, "system": system,
            "messages": [{"role": "user", "content": "hello there"}]}
    r1 = requests.post(f"{base}/v1/messages", json=body, timeout=30).json()
    body["system"][0]["text"] = body["system"][0]["text"].replace("fa690", "0aaa9")
    r2 = requests.post(f"{base}/v1/messages", json=body, timeout=30).json()
    assert r1["metrics"]["billing_header_removed"] is True
    assert r2["usage"]["cache_read_input_tokens"] > 0, r2["usage"]
    n1 = requests.post(f"{base}/v1/messages/count_tokens", json=body, timeout=30).json()
    body["system"] = system[1:]
    n2 = requests.post(f"{base}/v1/messages/count_tokens", json=body, timeout=30).json()
    assert n1 == n2


# --- every field of the SDKs' request schemas -----------------------------------------------

def readme_table(route: str) -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- fields:{route} -->\n(.*?)<!-- /fields:{route} -->", text, re.S)
    assert m, f"README has no generated field table for {route}"
    rows = {}
    for line in m.group(1).splitlines():
        cell = re.match(r"\| `([a-z_]+)` \| (.*) \|$", line)
        if cell:
            rows[cell.group(1)] = cell.group(2)
    return rows


CHAT_SAMPLES = {
    "audio": {"voice": "alloy", "format": "mp3"},
    "frequency_penalty": 0.5,
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logit_bias": {"40": 1},
    "logprobs": True,
    "max_completion_tokens": 4,
    "max_tokens": 4,
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "moderation": {"enabled": True},
    "n": 1,
    "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "x"},
    "presence_penalty": 0.5,
    "prompt_cache_key": "k",
    "prompt_cache_options": {"x": 1},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "response_format": {"type": "text"},
    "safety_identifier": "s",
    "seed": 1,
    "service_tier": "auto",
    "stop": ["zz"],
    "store": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "tool_choice": "none",
    "tools": [WEATHER],
    "top_logprobs": 2,
    "top_p": 0.9,
    "user": "u",
    "verbosity": "low",
    "web_search_options": {},
}
COMPLETION_SAMPLES = {
    "best_of": 2, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"40": 1}, "logprobs": 2,
    "max_tokens": 4, "n": 1, "presence_penalty": 0.5, "seed": 1, "stop": ["zz"],
    "stream_options": {"include_usage": True}, "suffix": "end", "temperature": 0.5, "top_p": 0.9,
    "user": "u",
}
MESSAGE_SAMPLES = {
    "cache_control": {"type": "ephemeral"}, "container": "c", "diagnostics": {"x": 1},
    "inference_geo": "us", "metadata": {"user_id": "u"}, "output_config": {"effort": "low"},
    "service_tier": "auto", "speed": "fast", "stop_sequences": ["zz"],
    "system": "Be brief.", "thinking": {"type": "enabled", "budget_tokens": 1024},
    "tool_choice": {"type": "auto"},
    "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    "user_profile_id": "p", "workspace_id": "w",
}


def sdk_fields():
    from anthropic.types import message_create_params as am
    from openai.types import completion_create_params as oc
    from openai.types.chat import completion_create_params as cc

    return {
        "chat": (set(cc.CompletionCreateParamsBase.__annotations__) - {"messages", "model"},
                 CHAT_SAMPLES, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        "completions": (set(oc.CompletionCreateParamsBase.__annotations__) - {"prompt", "model"},
                        COMPLETION_SAMPLES, "/v1/completions", {"prompt": "hi", "max_tokens": 4}),
        "messages": (set(am.MessageCreateParamsBase.__annotations__) - {"messages", "model", "max_tokens"},
                     MESSAGE_SAMPLES, "/v1/messages",
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    }


@pytest.mark.parametrize("route", ["chat", "completions", "messages"])
def test_every_sdk_request_field_is_implemented_ignored_or_rejected(plain_server, route):
    fields, samples, path, base = sdk_fields()[route]
    table = readme_table(route)
    missing = sorted(f for f in fields if f not in table)
    assert not missing, f"{route}: fields the SDK sends that the README table does not cover: {missing}"
    no_sample = sorted(f for f in fields if f not in samples)
    assert not no_sample, f"{route}: add a sample value for {no_sample}"
    for f in sorted(fields):
        body = dict(base)
        body[f] = samples[f]
        if f == "top_logprobs":
            body["logprobs"] = True
        if f == "stream_options":
            body["stream"] = True
        r = requests.post(f"{plain_server.base_url}{path}", json=body, timeout=30)
        what = table[f]
        if what.startswith("400 when set"):
            assert r.status_code == 400, (f, r.status_code, r.text)
            err = r.json()["error"]
            if route != "messages":
                assert err["param"] == f, (f, err)
            assert f in err["message"], (f, err)
        else:
            assert r.status_code == 200, (f, what, r.text[:300])
    # A field in no table at all is a 400 naming it.
    r = requests.post(f"{plain_server.base_url}{path}", json={**base, "frobnicate": 1}, timeout=30)
    assert r.status_code == 400 and "frobnicate" in r.text


def test_loglikelihood_request_shape_of_lm_evaluation_harness(plain_server):
    """`local-completions`: a list of prompts, echo, logprobs 1, max_tokens 0."""
    prompts = ["The capital of France is Paris", "Two plus two is four"]
    r = requests.post(f"{plain_server.base_url}/v1/completions", timeout=60, json={
        "model": plain_server.model(), "prompt": prompts, "echo": True, "logprobs": 1,
        "max_tokens": 0, "temperature": 0,
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for p, c in zip(prompts, body["choices"]):
        assert c["text"] == p
        lp = c["logprobs"]
        # The byte tokenizer: one token per byte.
        assert lp["tokens"] == list(p)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(x, float) and x < 0 for x in lp["token_logprobs"][1:])
        # The top 1 and the prompt token itself (OpenAI's "up to logprobs + 1").
        for tok, tlp, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert 1 <= len(top) <= 2 and top[tok] == tlp, (tok, tlp, top)
        assert lp["text_offset"] == list(range(len(p)))
        assert c["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    # Asked twice, the same numbers (the prompt is computed, never read from the cache).
    again = requests.post(f"{plain_server.base_url}/v1/completions", timeout=60, json={
        "prompt": prompts[0], "echo": True, "logprobs": 1, "max_tokens": 0}).json()
    assert again["choices"][0]["logprobs"]["token_logprobs"] == body["choices"][0]["logprobs"]["token_logprobs"]
    # vLLM's prompt_logprobs.
    v = requests.post(f"{plain_server.base_url}/v1/completions", timeout=60, json={
        "prompt": "abc", "prompt_logprobs": 0, "max_tokens": 1}).json()
    plp = v["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 3
    assert list(plp[1]) == [str(ord("b") + 3)]


def test_n_choices_from_one_prefill(server):
    c = oai(server)
    r = c.chat.completions.create(model=server.model(), n=3, max_tokens=6, temperature=1.0,
                                  messages=[{"role": "user", "content": "Say something."}])
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in r.choices}) > 1, "independent draws"
    assert r.usage.completion_tokens == 18
    single = c.chat.completions.create(model=server.model(), max_tokens=6,
                                       messages=[{"role": "user", "content": "Say something else."}])
    assert r.usage.prompt_tokens == single.usage.prompt_tokens - len(" else")
    stream = c.chat.completions.create(model=server.model(), n=2, max_tokens=4, stream=True,
                                       messages=[{"role": "user", "content": "Go."}])
    seen, finished = set(), set()
    for chunk in stream:
        for ch in chunk.choices:
            seen.add(ch.index)
            if ch.finish_reason:
                finished.add(ch.index)
    assert seen == finished == {0, 1}


REAL = os.environ.get("CACHET_E2E_REAL_MODEL") == "1"


@pytest.fixture(scope="module")
def real_server():
    s = start_server(["--enable-per-request-metrics"],
                     executor_args=shlex.split(os.environ.get("CACHET_E2E_MODEL_ARGS", "")))
    yield s
    s.stop()


@pytest.mark.skipif(not REAL, reason="set CACHET_E2E_REAL_MODEL=1 (and CACHET_E2E_MODEL_ARGS)")
def test_prompt_logprobs_are_the_models_own(real_server):
    """Echoed prompt logprobs (one prefill over the whole prompt, every position's logits) equal
    the model's next-token distribution after each prefix computed directly: a fresh prefill of
    the prefix alone (its own cache salt: nothing read from the cache), its last logits' top 20."""
    base = real_server.base_url
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = requests.post(f"{base}/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    assert len(ids) > 8
    r = requests.post(f"{base}/v1/completions", timeout=120, json={
        "prompt": ids, "echo": True, "logprobs": 5, "max_tokens": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    # The prompt was computed, not read (spec section 2), yet it was written.
    assert r["metrics"]["prefix_cache"]["cached_tokens"] == 0
    assert r["metrics"]["prefix_cache"]["computed_tokens"] == len(ids)
    vllm = requests.post(f"{base}/v1/completions", timeout=120, json={
        "prompt": ids, "prompt_logprobs": 5, "max_tokens": 1}).json()["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    own_checked = 0
    for i in range(1, len(ids)):
        d = requests.post(f"{base}/v1/completions", timeout=120, json={
            "prompt": ids[:i], "max_tokens": 1, "logprobs": 20, "temperature": 0,
            "cache_salt": f"direct-{i}"}).json()
        assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        direct = d["choices"][0]["logprobs"]["top_logprobs"][0]  # token text -> logprob
        echoed = lp["top_logprobs"][i]
        assert len(echoed) >= 1 and lp["tokens"][i] in echoed
        for text, v in echoed.items():
            if text == lp["tokens"][i] and text not in direct:
                continue  # the prompt token itself, ranked below the direct top 20
            assert text in direct, (i, text, echoed, direct)
            assert abs(direct[text] - v) < 2e-3, (i, text, v, direct[text])
        # The prompt token's own logprob, where the direct top 20 holds it.
        want = direct.get(lp["tokens"][i])
        if want is not None:
            assert abs(lp["token_logprobs"][i] - want) < 2e-3, (i, lp["tokens"][i])
            own_checked += 1
        # vLLM's shape: keyed by token id, the prompt token first, with its rank.
        entry = vllm[i][str(ids[i])]
        assert abs(entry["logprob"] - lp["token_logprobs"][i]) < 1e-6
        assert entry["decoded_token"] == lp["tokens"][i]
    assert own_checked >= len(ids) // 2, own_checked


# Bounded: llguidance bounds what the schema bounds, and a tiny greedy model left free writes
# digits until max_tokens.
class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=1000)


@pytest.mark.skipif(not REAL, reason="set CACHET_E2E_REAL_MODEL=1 (and CACHET_E2E_MODEL_ARGS)")
def test_grammar_forced_answers_from_the_real_model(real_server):
    """SmolLM2-135M writes free text when asked for JSON or a call; the grammar makes every
    answer valid: a Pydantic object, a named call, Anthropic's forced tool_use, a regex."""
    c = oai(real_server)
    model = real_server.model()
    r = c.chat.completions.parse(model=model, max_tokens=120, response_format=City, temperature=0,
                                 messages=[{"role": "user", "content": "A large city in Japan, as JSON."}])
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and len(city.name) <= 20 and 0 <= city.population_millions <= 1000
    r = c.chat.completions.create(
        model=model, max_tokens=80, temperature=0, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert r.choices[0].finish_reason == "tool_calls"
    _check_weather_call(r.choices[0].message.tool_calls[0])
    a = anthropic.Anthropic(base_url=real_server.base_url, api_key="unused", max_retries=0)
    m = a.messages.create(model=model, max_tokens=80,
                          messages=[{"role": "user", "content": "Weather in Lima?"}],
                          tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
                          tool_choice={"type": "any", "disable_parallel_tool_use": True},
                          extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use", m
    use = next(b for b in m.content if b.type == "tool_use")
    assert use.name == "get_weather" and set(use.input) == {"city"} and len(use.input["city"]) <= 12
    t = requests.post(f"{real_server.base_url}/v1/completions", timeout=60, json={
        "prompt": "The year the first moon landing happened:", "guided_regex": "[12][0-9]{3}",
        "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
    assert re.fullmatch(r"[12][0-9]{3}", t), t
