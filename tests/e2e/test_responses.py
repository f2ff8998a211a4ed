

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
    of = lambda t: [e for e in seen if isinstance(e, t)]  # noqa: E731
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
