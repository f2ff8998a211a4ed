"""The OpenAI Responses API (issue 51) through the official OpenAI SDK and the OpenAI Agents SDK.

The server runs the simulated executor with `--sim-eos-at-output 5`: every free-text reply is 4
printable bytes and then EOS (under a grammar the simulator writes what the grammar allows, so
JSON answers and tool calls are whole). Numbers are derived by hand: block size 16, one token
per byte, the simulator's template `<|role|>\\ncontent\\n` per message and `<|assistant|>\\n`
as the generation prompt.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pydantic
import pytest
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
    kinds = [type(e) for e in seen]
    deltas = [e for e in seen if isinstance(e, ResponseTextDeltaEvent)]
    assert 1 <= len(deltas) <= 4
    want = [ResponseCreatedEvent, ResponseInProgressEvent, ResponseOutputItemAddedEvent, ResponseContentPartAddedEvent]
    want += [ResponseTextDeltaEvent] * len(deltas)
    want += [ResponseTextDoneEvent, ResponseContentPartDoneEvent, ResponseOutputItemDoneEvent, ResponseCompletedEvent]
    assert kinds == want
    text = "".join(d.delta for d in deltas)
    assert len(text) == 4
    assert final.output_text == text
    done = next(e for e in seen if isinstance(e, ResponseTextDoneEvent))
    assert done.text == text
    # "<|user|>\nstream me\n<|assistant|>\n": 9 + 9 + 1 + 14 = 33 tokens.
    assert final.usage.input_tokens == 33


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


def test_agents_sdk_runs_a_tool_calling_agent_to_completion(rserver):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (tests/e2e/requirements.txt)")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    aclient = openai.AsyncOpenAI(api_key="unused", base_url=f"{rserver.base_url}/v1", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=rserver.model(), openai_client=aclient),
        # The first turn must call the tool (by grammar); the SDK resets the choice after it,
        # and the second turn answers in text.
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200),
    )

    async def run():
        return await Runner.run(agent, "Weather in Paris?", max_turns=4)

    result = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert len(calls) == 1
    assert isinstance(result.final_output, str) and len(result.final_output) == 4
    kinds = [i.type for i in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
