"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API with the official `anthropic` client
(`messages.create`, `messages.stream`, `messages.count_tokens`), against the demo model on loopback with its compact
tool template.

A Messages request is generated as the chat request it maps to, so what is checked is that mapping and the answer's
shape: the same greedy text and prompt as /v1/chat/completions for the same conversation, stop sequences reported as
Anthropic reports them, a tool_use -> tool_result round trip whole and streamed, the event stream in the types the
client reads and put together equal to the whole Message, the key taken as `x-api-key` or a bearer token, and errors
in Anthropic's shape, after which the server goes on. Servers run in this process on a free port of 127.0.0.1 and
are stopped by their own handle.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from helpers import Served, assert_declared_fields_only
from tool_templates import TEMPLATES

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from ember.serving import tool_calls  # noqa: E402
from ember.serving.anthropic_messages import MessagesReply, MessagesRequest, call_input  # noqa: E402
from ember.serving.protocol import ApiError, parse_request  # noqa: E402
from ember.serving.scheduler import StreamEvent  # noqa: E402

TIMEOUT = 60  # seconds; catches a hang, never a speed
KEY = "messages-key"
CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOL = {"name": "weather", "description": "Today's weather in a city.", "input_schema": CITY}
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]
GREEDY = {"temperature": 0}  # this client's version no longer takes temperature as an argument
STREAM_EVENTS = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def served(demo_builds):
    """The demo model with its compact Hermes tool template (a round trip fits its 256-token context)."""
    import ember

    template = (Path(ember.__file__).parent / "demo_model" / "chat_template_tools.jinja").read_text()
    with Served(demo_builds.get("cpu", "q0f32"), api_key=KEY) as served:
        served.scheduler.engine.artifact.tokenizer.use_chat_template(template, "the demo's tool template")
        served.anthropic = anthropic.Anthropic(base_url=served.server.page_url.rstrip("/"), api_key=KEY,
                                               max_retries=0, timeout=TIMEOUT)
        yield served


def _create(served: Served, **options):
    return served.anthropic.messages.create(model=served.name, **{"messages": QUESTION, **options})


def _without_ids(value):
    """A Message's JSON without what differs between two answers to one request (ids)."""
    if isinstance(value, dict):
        return {key: _without_ids(item) for key, item in value.items() if key != "id"}
    if isinstance(value, list):
        return [_without_ids(item) for item in value]
    return value


def test_text_is_the_chat_reply_of_the_same_conversation_whole_and_streamed(served):
    messages = [{"role": "user", "content": "Who led Israel?"}]
    chat = served.client.chat.completions.create(model=served.name, max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, *messages])
    whole = _create(served, system="Be brief.", messages=messages, max_tokens=16, extra_body=GREEDY)
    assert [block.type for block in whole.content] == ["text"]
    assert whole.content[0].text == chat.choices[0].message.content
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    usage = whole.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.cache_read_input_tokens > 0 and usage.output_tokens == chat.usage.completion_tokens
    assert_declared_fields_only(Message.model_validate(whole.model_dump()))
    with served.anthropic.messages.stream(model=served.name, system=[{"type": "text", "text": "Be brief."}],
                                          messages=messages, max_tokens=16, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events if event.type != "text"]  # "text": the helper's own, beside each delta
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop",
                                                                                    "message_delta", "message_stop"]
    assert _without_ids(final.model_dump()) == _without_ids(whole.model_dump())


def test_a_stop_sequence_ends_the_reply_and_is_named(served):
    text = _create(served, max_tokens=24, extra_body=GREEDY).content[0].text
    stop = text[6:10]
    cut = _create(served, max_tokens=24, stop_sequences=["never written", stop], extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]
    with served.anthropic.messages.stream(model=served.name, messages=QUESTION, max_tokens=24, stop_sequences=[stop],
                                          extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop,
                                                                               cut.content[0].text)


def _tool_use(message) -> dict:
    """The one tool_use block of a message, its input checked against the tool's schema."""
    (block,) = message.content
    assert (block.type, block.name, message.stop_reason) == ("tool_use", "weather", "tool_use"), message
    jsonschema.validate(block.input, CITY)
    return block.model_dump(exclude_none=True)


def test_a_tool_use_round_trip_renders_as_the_chat_round_trip(served):
    """tool_use, tool_result, answer: the second request renders the call and its result through the template as
    /v1/chat/completions renders the same conversation, and answers with its greedy text; count_tokens counts it."""
    call = _tool_use(_create(served, tools=[TOOL], max_tokens=64,
                             tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    messages = [*QUESTION, {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                              "content": "12 C and sunny"}]}]
    answer = _create(served, messages=messages, tools=[TOOL], max_tokens=16, extra_body=GREEDY)
    chat_tool = {"type": "function", "function": {"name": "weather", "description": TOOL["description"],
                                                  "parameters": CITY}}
    chat = served.client.chat.completions.create(model=served.name, tools=[chat_tool], max_tokens=16, temperature=0,
                                                 messages=[*QUESTION, {"role": "assistant", "tool_calls": [
                                                     {"id": call["id"], "type": "function", "function": {
                                                         "name": "weather", "arguments": json.dumps(call["input"])}}]},
                                                     {"role": "tool", "tool_call_id": call["id"],
                                                      "content": "12 C and sunny"}])
    prompt_tokens = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert prompt_tokens == chat.usage.prompt_tokens
    assert [block.text for block in answer.content] == [chat.choices[0].message.content]
    counted = served.anthropic.messages.count_tokens(model=served.name, messages=messages, tools=[TOOL])
    assert counted.input_tokens == prompt_tokens


def test_a_failed_tool_result_reaches_the_model_as_an_error(served):
    """`is_error: true` renders as the chat tool message "Error: <result>" (counted against chat's own usage of that
    conversation), and differs from the same result that succeeded."""
    call = {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}}

    def counted(is_error: bool) -> int:
        result = {"type": "tool_result", "tool_use_id": "call_1", "content": "no such city", "is_error": is_error}
        messages = [*QUESTION, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
        return served.anthropic.messages.count_tokens(model=served.name, messages=messages, tools=[TOOL]).input_tokens

    chat_tool = {"type": "function", "function": {"name": "weather", "description": TOOL["description"],
                                                  "parameters": CITY}}
    chat = served.client.chat.completions.create(
        model=served.name, tools=[chat_tool], max_tokens=1, temperature=0,
        messages=[*QUESTION, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": json.dumps(call["input"])}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Error: no such city"}])
    assert counted(True) == chat.usage.prompt_tokens
    assert counted(True) != counted(False)


def test_a_streamed_tool_use_arrives_as_input_json_deltas_the_client_parses(served):
    with served.anthropic.messages.stream(model=served.name, messages=QUESTION, tools=[TOOL], max_tokens=64,
                                          tool_choice={"type": "tool", "name": "weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    call = _tool_use(final)
    pieces = [event.delta.partial_json for event in events
              if event.type == "content_block_delta" and event.delta.type == "input_json_delta"]
    assert json.loads("".join(pieces)) == call["input"] and len(pieces) > 1


def test_count_tokens_counts_the_prompt_a_message_would_have(served):
    system = "You are terse."
    counted = served.anthropic.messages.count_tokens(model=served.name, system=system, messages=QUESTION)
    message = _create(served, system=system, max_tokens=1)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    with_tools = served.anthropic.messages.count_tokens(model=served.name, system=system, messages=QUESTION,
                                                        tools=[TOOL])
    assert with_tools.input_tokens > counted.input_tokens


def test_the_key_is_taken_as_x_api_key_or_bearer_and_refused_in_anthropics_shape(served):
    body = json.dumps({"model": served.name, "max_tokens": 1, "messages": QUESTION}).encode()
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        status, message = served.request("POST", "/v1/messages", body, headers)
        assert status == 200 and message["type"] == "message", message
    stranger = anthropic.Anthropic(base_url=served.server.page_url.rstrip("/"), api_key="wrong", max_retries=0,
                                   timeout=TIMEOUT)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        stranger.messages.create(model=served.name, max_tokens=1, messages=QUESTION)
    assert caught.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                            "message": "incorrect API key"}}
    status, error = served.request("POST", "/v1/messages/count_tokens", body, {})
    assert status == 401 and error["error"]["type"] == "authentication_error" and "x-api-key" in error["error"][
        "message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        served.anthropic.messages.create(model="claude-opus", max_tokens=1, messages=QUESTION)
    assert caught.value.body["error"]["type"] == "not_found_error"


BAD_REQUESTS = {
    # name: (fields over a good body, or raw bytes; words in the message)
    "no max_tokens": ({"max_tokens": None}, "max_tokens"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens past the context": ({"max_tokens": 10_000}, "context window"),
    "no messages": ({"messages": []}, "messages"),
    "system role in messages": ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    "image block": ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                    "messages.0.content.0"),
    "tool_use from the user": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "weather", "input": {}}]}]}, "assistant messages"),
    "tool_result from the assistant": ({"messages": [*QUESTION, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "user messages"),
    "tool_result without its id": ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
    "server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    "tool without input_schema": ({"tools": [{"name": "weather"}]}, "input_schema"),
    "tool schema not an object": ({"tools": [{**TOOL, "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
    "tool_choice of no tool": ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "clock"}},
                               "no tool is named 'clock'"),
    "tool_choice of no kind": ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    "temperature above 1": ({"temperature": 1.5}, "temperature"),
    "empty stop sequence": ({"stop_sequences": [""]}, "stop_sequences.0"),
    "malformed JSON": (b'{"model": ', "not valid JSON"),
}


GENERATION_FIELDS = {"max_tokens", "temperature", "stop_sequences"}  # which count_tokens does not read
CASES = [("/v1/messages", case) for case in BAD_REQUESTS] + [
    ("/v1/messages/count_tokens", case) for case, (fields, _words) in BAD_REQUESTS.items()
    if isinstance(fields, bytes) or not GENERATION_FIELDS & set(fields)]


@pytest.mark.parametrize("path, case", CASES, ids=[f"{path} {case}" for path, case in CASES])
def test_bad_requests_get_a_400_in_anthropics_shape_and_the_server_goes_on(served, path, case):
    fields, words = BAD_REQUESTS[case]
    body = fields if isinstance(fields, bytes) else json.dumps(
        {key: value for key, value in {"model": served.name, "max_tokens": 4, "messages": QUESTION, **fields}.items()
         if value is not None}).encode()
    status, answer = served.request("POST", path, body, {"x-api-key": KEY})
    assert status == 400 and answer["type"] == "error" and set(answer) == {"type", "error"}, answer
    assert answer["error"]["type"] == "invalid_request_error" and set(answer["error"]) == {"type", "message"}
    assert words in answer["error"]["message"] and "\n" not in answer["error"]["message"], answer
    assert _create(served, max_tokens=1).stop_reason in ("max_tokens", "end_turn")


# --- the reply's shape, without a model ----------------------------------------------------------------------

def _reply(stream: bool, stop_sequences: list[str] | None = None) -> MessagesReply:
    body = {"model": "m", "max_tokens": 8, "messages": QUESTION, "stream": stream, "tools": [TOOL]}
    if stop_sequences:
        body["stop_sequences"] = stop_sequences
    request = parse_request(json.dumps(body).encode(), MessagesRequest)
    plan = tool_calls.plan([{"type": "function", "function": {"name": "weather", "parameters": CITY}}], "auto", True,
                           TEMPLATES["hermes"])
    return MessagesReply(request, "m", plan, 9, lambda ids: "".join(TOKENS[i] for i in ids))


TOKENS = ["Let me look. ", "<tool_", 'call>\n{"name": "weather", "argu', 'ments": {"city": "Os', 'lo"}}\n</tool_call>',
          "Done", ".", " END", " more"]


def _events(token_ids: list[int], reason: str, text: str | None = None) -> list[StreamEvent]:
    """Events of a reply of `token_ids` (one event each), whose text given out is `text` (all of it by default)."""
    pieces = [TOKENS[i] for i in token_ids]
    if text is not None:
        pieces = [text] + [""] * (len(pieces) - 1)
    events = [StreamEvent(piece, [i], []) for piece, i in zip(pieces, token_ids)]
    last = events[-1]
    last.finish_reason, last.prompt_tokens, last.completion_tokens, last.cached_tokens = reason, 9, len(pieces), 4
    return events


@pytest.mark.parametrize("token_ids, reason, text, stop, blocks, stop_reason", [
    ([0, 1, 2, 3, 4], "stop", None, None, ["text", "tool_use"], "tool_use"),
    ([0, 1, 2, 3], "length", None, None, ["text", "tool_use"], "max_tokens"),
    ([5, 6], "stop", None, None, ["text"], "end_turn"),
    ([5, 6, 7], "stop", "Done.", [" END"], ["text"], "stop_sequence"),
], ids=["text then a call", "cut off in the call", "text", "a stop sequence"])
def test_stream_events_are_the_clients_types_and_end_in_the_whole_message(token_ids, reason, text, stop, blocks,
                                                                          stop_reason):
    streamed = _reply(True, stop)
    sent = streamed.opening() + [piece for event in _events(token_ids, reason, text) for piece in streamed.feed(event)]
    events = []
    for piece in sent:
        kind, data = piece.split("\n")[:2]
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        if payload["type"] != "ping":
            event = STREAM_EVENTS.validate_python(payload)
            assert_declared_fields_only(event)
            events.append(event)
    assert [event.type for event in events if event.type.startswith("message")] == ["message_start", "message_delta",
                                                                                   "message_stop"]
    whole = Message.model_validate(_reply(False, stop).whole(_events(token_ids, reason, text)))
    assert_declared_fields_only(whole)
    assert [block.type for block in whole.content] == blocks and whole.stop_reason == stop_reason
    assert whole.stop_sequence == (stop[0] if stop else None)
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens) == (9 - 4, 4)
    assert events[-2].delta.stop_reason == stop_reason and events[-2].usage.output_tokens == len(token_ids)
    if blocks[-1] == "tool_use":
        # Cut off, the input is what the anthropic client parses of the partial JSON: an unfinished string dropped.
        assert whole.content[-1].input == ({"city": "Oslo"} if reason == "stop" else {})
        deltas = [event.delta.partial_json for event in events if event.type == "content_block_delta"
                  and event.delta.type == "input_json_delta"]
        assert "".join(deltas) == ('{"city": "Oslo"}' if reason == "stop" else '{"city": "Os')


@pytest.mark.parametrize("arguments, complete, expected", [
    ('{"city": "Oslo"}', True, {"city": "Oslo"}),
    ('{"city": "Oslo", "days": [1, 2', False, {"city": "Oslo", "days": [1, 2]}),
    ('{"city": Oslo}', True, {"INVALID_JSON": '{"city": Oslo}'}),
])
def test_a_tool_use_input_is_the_arguments_parsed_partly_or_wrapped(arguments, complete, expected):
    assert call_input(arguments, complete) == expected


def test_a_failure_mid_stream_is_an_error_event():
    [sent] = _reply(True).failure(ApiError(500, "the engine failed", kind="server_error"))
    assert sent == 'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": ' \
                   '"the engine failed"}}\n\n'
