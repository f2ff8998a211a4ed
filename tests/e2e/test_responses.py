"""The OpenAI Responses API (issue 51) through the official OpenAI SDK and the OpenAI Agents SDK.

The main server runs the simulated executor with `--sim-eos-at-output 5`: every free-text reply
is 4 printable bytes and then EOS (under a grammar the simulator writes what the grammar allows,
so JSON answers and tool calls are whole). The agent's server scripts its reply
(`--sim-reply-file`). Numbers are derived by hand: block size 16, one token
per byte, the simulator's template `<|role|>\\ncontent\\n` per message and `<|assistant|>\\n`
as the generation prompt.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from typing import Annotated

import openai
import pydantic
import pytest
import requests
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)

from conftest import start_server

KEY_A, KEY_B = "sk-resp-a", "sk-resp-b"


@pytest.fixture(scope="module")
def rserver():
    s = start_server(["--enable-per-request-metrics", "--sim-eos-at-output", "5"])
    yield s
    s.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(api_key=server.api_key or "unused", base_url=f"{server.base_url}/v1", max_retries=0)


def test_create_answers_with_a_message_and_usage_by_hand(rserver):
    c = client(rserver)
    # "<|user|>\nabcdefgh\n<|assistant|>\n": 9 + 8 + 1 + 14 = 32 tokens, both blocks written.
    r = c.responses.create(model=rserver.model(), input="abcdefgh", max_output_tokens=16, temperature=0)
    assert r.status == "completed"
    assert r.object == "response"
    assert len(r.output) == 1 and r.output[0].type == "message"
    assert len(r.output_text) == 4
    u = r.usage
    assert (u.input_tokens, u.input_tokens_details.cached_tokens, u.input_tokens_details.cache_write_tokens) == (32, 0, 32)
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    # Stored by default: retrieve gives it back.
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text


def test_stream_events_parse_as_the_sdk_types_in_order(rserver):
    c = client(rserver)
    seen = []
    with c.responses.stream(model=rserver.model(), input="stream me", max_output_tokens=16) as s:
        for ev in s:
            seen.append(ev)
        final = s.get_final_response()
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    deltas = [e for e in seen if isinstance(e, ResponseTextDeltaEvent)]
    assert 1 <= len(deltas) <= 4
    want = [ResponseCreatedEvent, ResponseInProgressEvent, ResponseOutputItemAddedEvent, ResponseContentPartAddedEvent]
    want += [ResponseTextDeltaEvent] * len(deltas)
    want += [ResponseTextDoneEvent, ResponseContentPartDoneEvent, ResponseOutputItemDoneEvent, ResponseCompletedEvent]
    # Each event parses as its SDK type (the stream helper's text events subclass them).
    assert len(seen) == len(want) and all(isinstance(e, w) for e, w in zip(seen, want)), [e.type for e in seen]
    text = "".join(d.delta for d in deltas)
    assert len(text) == 4
    assert final.output_text == text
    done = next(e for e in seen if isinstance(e, ResponseTextDoneEvent))
    assert done.text == text
    # "<|user|>\nstream me\n<|assistant|>\n": 9 + 9 + 1 + 14 = 33 tokens.
    assert final.usage.input_tokens == 33


def test_create_with_stream_true_yields_the_sdk_event_types(rserver):
    c = client(rserver)
    events = list(c.responses.create(model=rserver.model(), input="abcdefgh", max_output_tokens=16, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "in_progress"
    assert events[1].type == "response.in_progress"
    last = events[-1]
    assert isinstance(last, ResponseCompletedEvent)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert last.response.output_text == text and len(text) == 4
    # 32 prompt tokens (see the first test); usage only on the last event.
    assert last.response.usage.input_tokens == 32
    assert all(getattr(e, "response", None) is None or e.response.usage is None for e in events[:-1])
    # Streamed responses are stored too.
    assert c.responses.retrieve(last.response.id).output_text == text


def test_streamed_function_call_events(rserver):
    c = client(rserver)
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    seen = []
    with c.responses.stream(
        model=rserver.model(),
        input="Weather in Paris?",
        tools=[tool, {"type": "web_search"}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    ) as s:
        for ev in s:
            seen.append(ev)
        final = s.get_final_response()
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    added = [e for e in seen if isinstance(e, ResponseOutputItemAddedEvent)]
    assert len(added) == 1 and added[0].item.type == "function_call"
    pieces = "".join(e.delta for e in seen if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent))
    done = [e for e in seen if isinstance(e, ResponseFunctionCallArgumentsDoneEvent)]
    assert len(done) == 1 and done[0].arguments == pieces
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert len(json.loads(call.arguments)["city"]) <= 8


class Point(pydantic.BaseModel):
    x: int
    y: int


def test_parse_with_a_pydantic_model(rserver):
    c = client(rserver)
    r = c.responses.parse(model=rserver.model(), input="a point", text_format=Point, max_output_tokens=200)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Point)


def test_previous_response_id_chain_reads_the_retained_kv(rserver):
    c = client(rserver)
    model = rserver.model()
    r1 = c.responses.create(model=model, input="abcdefgh-chain", max_output_tokens=16)
    # "<|user|>\nabcdefgh-chain\n<|assistant|>\n": 9 + 14 + 1 + 14 = 38 tokens.
    assert r1.usage.input_tokens == 38
    # Parked: 38 prompt + the 4 reply tokens (EOS, the last sampled, has no KV) = 42.
    # Turn 2: 38 + 4 + 1 + 9 + 11 + 1 + 14 = 78 tokens, 36 of them new.
    r2 = c.responses.create(model=model, input="hello world", previous_response_id=r1.id, max_output_tokens=16)
    assert r2.previous_response_id == r1.id
    u = r2.usage
    assert u.input_tokens == 78
    assert u.input_tokens_details.cached_tokens == 42
    # Newly full blocks: [32,48) (6 new tokens), [48,64) (16), and [64,78) stays partial.
    assert u.input_tokens_details.cache_write_tokens == 22
    assert r2.model_extra["metrics"]["previous_response"] == {"id": r1.id, "kv": "retained"}
    items = c.responses.input_items.list(r2.id, order="asc")
    texts = [i.content[0].text for i in items.data]
    assert texts == ["abcdefgh-chain", r1.output_text, "hello world"]
    # A foreign id is a 404 in OpenAI's shape.
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=model, input="x", previous_response_id="resp_unknown")
    c.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r1.id)


def test_unknown_ids_are_404_on_every_route(rserver):
    c = client(rserver)
    for call in (
        lambda: c.responses.retrieve("resp_unknown"),
        lambda: c.responses.delete("resp_unknown"),
        lambda: c.responses.input_items.list("resp_unknown"),
        lambda: c.responses.cancel("resp_unknown"),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["message"] == "No response found with id 'resp_unknown'."
        assert e.value.body["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def keyed_server():
    s = start_server([], api_key=f"{KEY_A},{KEY_B}")
    yield s
    s.stop()


def test_responses_are_per_api_key(keyed_server):
    def keyed(key: str) -> openai.OpenAI:
        return openai.OpenAI(api_key=key, base_url=f"{keyed_server.base_url}/v1", max_retries=0)

    a, b = keyed(KEY_A), keyed(KEY_B)
    model = a.models.list().data[0].id
    r = a.responses.create(model=model, input="mine", max_output_tokens=2)
    assert a.responses.retrieve(r.id).id == r.id
    # For the other key it does not exist: not readable, listable, continuable nor deletable.
    for call in (
        lambda: b.responses.retrieve(r.id),
        lambda: b.responses.input_items.list(r.id),
        lambda: b.responses.delete(r.id),
        lambda: b.responses.create(model=model, input="x", previous_response_id=r.id, max_output_tokens=1),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    # Still there for its owner, who deletes it.
    assert [i.content[0].text for i in a.responses.input_items.list(r.id).data] == ["mine"]
    a.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r.id)


AGENT_REPLY = "It is sunny in Paris."


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    reply = tmp_path_factory.mktemp("agent") / "reply.txt"
    reply.write_text(AGENT_REPLY)
    s = start_server(["--sim-reply-file", str(reply), "--enable-per-request-metrics"])
    yield s
    s.stop()


@pytest.mark.parametrize("chained", [False, True], ids=["full-input", "previous-response-id"])
def test_agents_sdk_runs_a_tool_calling_agent_to_completion(agent_server, chained):
    pytest.importorskip("agents", reason="openai-agents is not installed (tests/e2e/requirements.txt)")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: Annotated[str, pydantic.Field(max_length=8)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    aclient = openai.AsyncOpenAI(api_key="unused", base_url=f"{agent_server.base_url}/v1", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=agent_server.model(), openai_client=aclient),
        # Turn one must call the tool: `required` makes the grammar write the call (the scripted
        # reply's bytes where the grammar allows them, the city at most 8 characters). The SDK
        # then resets the choice to auto, and turn two answers with the scripted reply.
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200),
    )
    question = "Weather in Rome?" if chained else "Weather in Paris?"

    async def run():
        return await Runner.run(agent, question, max_turns=4, auto_previous_response_id=chained)

    result = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert len(calls) == 1 and 1 <= len(calls[0]) <= 8
    assert result.final_output == AGENT_REPLY
    kinds = [i.type for i in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    first, second = result.raw_responses
    n1, out1, n2 = first.usage.input_tokens, first.usage.output_tokens, second.usage.input_tokens
    d = second.usage.input_tokens_details
    # Turn one's KV covers its prompt and its call but the last sampled token (EOS has no KV);
    # turn two's prompt starts with exactly those tokens (the call renders back as written).
    kept = n1 + out1 - 1
    stored = client(agent_server).responses.retrieve(second.response_id)
    if chained:
        # Turn two continues turn one's stored response on its retained KV (spec section 5):
        # all of it is cached, and the new tokens in newly full blocks are written.
        assert stored.previous_response_id == first.response_id
        assert stored.model_extra["metrics"]["previous_response"]["kv"] == "retained"
        assert d.cached_tokens == kept
        assert d.cache_write_tokens == max(0, 16 * (n2 // 16) - kept)
    else:
        # A new request: the full blocks of those tokens are read from the prefix cache.
        assert stored.previous_response_id is None
        assert d.cached_tokens == 16 * (kept // 16)
        assert d.cache_write_tokens == 16 * (n2 // 16) - 16 * (kept // 16)


AGENTS_FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "openai_agents_0.25.0_first_request.json"


def test_captured_agents_sdk_request_is_answered(agent_server):
    """The Agents SDK's first request as it sent it (captured with an httpx request hook on the
    SDK's client, openai-agents 0.25.0), replayed without the SDK: a forced strict function tool
    whose call the grammar writes."""
    req = json.loads(AGENTS_FIXTURE.read_text())
    assert req["tool_choice"] == "required" and req["tools"][0]["strict"] is True
    r = requests.post(f"{agent_server.base_url}/v1/responses", json=req, timeout=60)
    assert r.status_code == 200, r.text
    resp = r.json()
    (call,) = resp["output"]
    assert (call["type"], call["name"], call["status"]) == ("function_call", "get_weather", "completed")
    args = json.loads(call["arguments"])
    assert list(args) == ["city"] and 1 <= len(args["city"]) <= 8
    assert resp["usage"]["input_tokens"] == resp["metrics"]["prefix_cache"]["prompt_tokens"]
    # Stored by default: it reads back.
    g = requests.get(f"{agent_server.base_url}/v1/responses/{resp['id']}", timeout=10)
    assert g.status_code == 200 and g.json()["output"] == resp["output"]


@pytest.fixture(scope="module")
def slow_server():
    # 5 ms per decoded token: a long answer is still running when it is cancelled.
    s = start_server(["--sim-decode-us-per-seq", "5000"])
    yield s
    s.stop()


def test_background_response_is_polled_and_cancelled(slow_server):
    c = client(slow_server)
    model = slow_server.model()
    short = c.responses.create(model=model, input="abcdefgh", max_output_tokens=3, background=True)
    assert short.background is True and short.status in ("queued", "in_progress")
    deadline = time.monotonic() + 30
    while (got := c.responses.retrieve(short.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    # The simulator never writes EOS here: the answer is max_output_tokens long.
    assert got.status == "incomplete" and len(got.output_text) == 3
    assert got.usage.input_tokens == 32 and got.usage.output_tokens == 3
    long = c.responses.create(model=model, input="abcdefgh", max_output_tokens=2000, background=True)
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.2)
    assert c.responses.retrieve(long.id).status == "cancelled"
    # Only a background response can be cancelled.
    plain = c.responses.create(model=model, input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(plain.id)


REASONING_REPLY = "<think>Two plus two.</think>It is 4."


@pytest.fixture(scope="module")
def reasoning_server():
    s = start_server(["--reasoning-parser", "qwen3", "--sim-reply", REASONING_REPLY])
    yield s
    s.stop()


def test_reasoning_events_parse_as_the_sdk_types(reasoning_server):
    from openai.types.responses import (
        ResponseReasoningItem,
        ResponseReasoningSummaryPartAddedEvent,
        ResponseReasoningSummaryPartDoneEvent,
        ResponseReasoningSummaryTextDeltaEvent,
        ResponseReasoningSummaryTextDoneEvent,
        ResponseReasoningTextDeltaEvent,
        ResponseReasoningTextDoneEvent,
    )

    c = client(reasoning_server)
    with c.responses.stream(
        model=reasoning_server.model(), input="What is 2 + 2?", max_output_tokens=64, reasoning={"summary": "auto"}
    ) as s:
        seen = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in seen] == list(range(len(seen)))

    def of(t):
        return [e for e in seen if isinstance(e, t)]

    assert "".join(e.delta for e in of(ResponseReasoningTextDeltaEvent)) == "Two plus two."
    assert "".join(e.delta for e in of(ResponseReasoningSummaryTextDeltaEvent)) == "Two plus two."
    assert [e.text for e in of(ResponseReasoningTextDoneEvent)] == ["Two plus two."]
    assert [e.text for e in of(ResponseReasoningSummaryTextDoneEvent)] == ["Two plus two."]
    assert len(of(ResponseReasoningSummaryPartAddedEvent)) == len(of(ResponseReasoningSummaryPartDoneEvent)) == 1
    item = final.output[0]
    assert isinstance(item, ResponseReasoningItem)
    assert [p.text for p in item.summary] == ["Two plus two."]
    assert [p.text for p in item.content] == ["Two plus two."]
    assert final.output_text == "It is 4."
    # 36 scripted tokens and EOS; the block's 28 (tags included) are reasoning.
    assert (final.usage.output_tokens, final.usage.output_tokens_details.reasoning_tokens) == (37, 28)
