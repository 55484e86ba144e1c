"""POST /v1/responses: OpenAI's Responses API with the official `openai` client (`responses.create`,
`responses.stream`) and the Agents SDK, against the demo model on loopback with its compact tool template.

A Responses request is generated as the chat request it maps to, so what is checked is that mapping and the answer's
shape: the same greedy text and prompt tokens as /v1/chat/completions for the same conversation, text formats held by
the grammar, a function-tool round trip (call, function_call_output, answer) whole and streamed, the event stream in
the types the client reads and put together equal to the whole Response, and a 400 in OpenAI's shape naming the field
for what ember cannot do, after which the server goes on. Servers run in this process on a free port of 127.0.0.1
and are stopped by their own handle.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from helpers import Served, assert_declared_fields_only
from tool_templates import TEMPLATES

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import BaseModel, TypeAdapter  # noqa: E402

from ember.serving import tool_calls  # noqa: E402
from ember.serving.protocol import parse_request  # noqa: E402
from ember.serving.responses import ResponsesReply, ResponsesRequest  # noqa: E402
from ember.serving.scheduler import StreamEvent  # noqa: E402

TIMEOUT = 60  # seconds; catches a hang, never a speed
KEY = "responses-key"
CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOL = {"type": "function", "name": "weather", "description": "Today's weather in a city.", "parameters": CITY,
        "strict": True}
FORECAST = {"type": "object", "properties": {"sky": {"enum": ["sun", "rain"]}}, "required": ["sky"],
            "additionalProperties": False}
QUESTION = "Weather in Oslo?"
STREAM_EVENTS = TypeAdapter(ResponseStreamEvent)


class Forecast(BaseModel):
    sky: Literal["sun", "rain"]


@pytest.fixture(scope="module")
def served(demo_builds):
    """The demo model with its compact Hermes tool template (a round trip fits its 256-token context)."""
    import ember

    template = (Path(ember.__file__).parent / "demo_model" / "chat_template_tools.jinja").read_text()
    with Served(demo_builds.get("cpu", "q0f32"), api_key=KEY) as served:
        served.scheduler.engine.artifact.tokenizer.use_chat_template(template, "the demo's tool template")
        yield served


def _chat_of(served: Served, messages: list[dict], **options):
    return served.client.chat.completions.create(model=served.name, messages=messages, **options)


def _without_ids(value):
    """A Response's JSON without what differs between two answers to one request (ids, call ids, times)."""
    if isinstance(value, dict):
        return {key: _without_ids(item) for key, item in value.items() if key not in ("id", "call_id", "created_at")}
    if isinstance(value, list):
        return [_without_ids(item) for item in value]
    return value


def test_text_is_the_chat_reply_of_the_same_conversation_whole_and_streamed(served):
    options = dict(model=served.name, instructions="Be brief.", input="Who led Israel?", max_output_tokens=16,
                   temperature=0)
    chat = _chat_of(served, [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Who led Israel?"}], max_tokens=16, temperature=0)
    whole = served.client.responses.create(**options)
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                     chat.usage.completion_tokens)
    assert whole.usage.input_tokens_details.cached_tokens > 0  # the chat's prompt was cached a moment ago
    cut = chat.choices[0].finish_reason == "length"
    assert whole.status == ("incomplete" if cut else "completed")
    assert (whole.incomplete_details.reason if cut else whole.incomplete_details) == ("max_output_tokens" if cut
                                                                                        else None)
    assert_declared_fields_only(Response.model_validate(whole.model_dump()))
    with served.client.responses.stream(**options) as stream:
        events = list(stream)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:4]] == ["response.created", "response.in_progress",
                                                    "response.output_item.added", "response.content_part.added"]
    assert events[-1].type == ("response.incomplete" if cut else "response.completed")
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and len(deltas) > 1
    assert [event.text for event in events if event.type == "response.output_text.done"] == [whole.output_text]
    assert _without_ids(events[-1].response.model_dump()) == _without_ids(whole.model_dump())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_format_holds_the_text_to_the_schema(served, stream):
    text = {"format": {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}}
    if stream:
        with served.client.responses.stream(model=served.name, input="Sky today?", text_format=Forecast,
                                            max_output_tokens=32) as events:
            response = events.get_final_response()
        assert isinstance(response.output_parsed, Forecast)
    else:
        response = served.client.responses.create(model=served.name, input="Sky today?", text=text,
                                                  max_output_tokens=32)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), FORECAST)
    loose = served.client.responses.create(model=served.name, input="Sky today?", max_output_tokens=48,
                                           text={"format": {"type": "json_object"}})
    assert loose.output_text.startswith("{")


def _call(response) -> dict:
    """The one function call of a response, its arguments checked against the tool's schema."""
    (call,) = response.output
    assert (call.type, call.name, call.status) == ("function_call", "weather", "completed"), call
    jsonschema.validate(json.loads(call.arguments), CITY)
    return call.model_dump(exclude_none=True)


def test_a_function_tool_round_trip_renders_as_the_chat_round_trip(served):
    """Call, function_call_output, answer: the second request renders the call and its result through the template
    as /v1/chat/completions renders the same conversation, and answers with its greedy text."""
    call = _call(served.client.responses.create(model=served.name, input=QUESTION, tools=[TOOL],
                                                tool_choice="required", parallel_tool_calls=False,
                                                max_output_tokens=64))
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "12 C and sunny"}
    answer = served.client.responses.create(model=served.name, input=[{"role": "user", "content": QUESTION}, call,
                                                                       result], tools=[TOOL], max_output_tokens=16,
                                            temperature=0)
    chat_tool = {"type": "function", "function": {key: TOOL[key] for key in ("name", "description", "parameters")}}
    chat = _chat_of(served, [{"role": "user", "content": QUESTION},
                             {"role": "assistant", "tool_calls": [{"id": call["call_id"], "type": "function",
                                                                   "function": {"name": "weather",
                                                                                "arguments": call["arguments"]}}]},
                             {"role": "tool", "tool_call_id": call["call_id"], "content": "12 C and sunny"}],
                    tools=[chat_tool], max_tokens=16, temperature=0)
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == chat.choices[0].message.content


def test_a_streamed_call_arrives_in_pieces_the_client_parses(served):
    with served.client.responses.stream(model=served.name, input=QUESTION, tools=[TOOL], max_output_tokens=64,
                                        tool_choice={"type": "function", "name": "weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = _call(final)
    pieces = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call["arguments"] and len(pieces) > 1
    assert final.output[0].parsed_arguments == json.loads(call["arguments"])  # the client parses a strict tool's
    assert [event.type for event in events if "output_item" in event.type] == ["response.output_item.added",
                                                                               "response.output_item.done"]


def test_an_agents_sdk_agent_runs_three_turns_with_a_function_tool(served):
    """The Agents SDK's OpenAIResponsesModel against ember: a call (tool_choice required), the tool's output and a
    structured answer in one run, then a follow-up question over the whole conversation (ember keeps nothing: the
    SDK sends it back), each turn a Response whose status the SDK accepts."""
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel

    cities: list[str] = []

    @agents.function_tool
    def weather(city: Literal["Oslo", "Rome"]) -> str:
        """Today's weather in a city."""
        cities.append(city)
        return "12 C and sunny"

    async def conversation():
        agents.set_tracing_disabled(True)
        client = served.async_client()
        try:
            model = OpenAIResponsesModel(model=served.name, openai_client=client)
            settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                            temperature=0)
            agent = agents.Agent(name="forecaster", instructions="Answer briefly.", tools=[weather], model=model,
                                 output_type=Forecast, model_settings=settings)
            first = await agents.Runner.run(agent, QUESTION, max_turns=3)
            follow_up = first.to_input_list() + [{"role": "user", "content": "And tomorrow?"}]
            second = await agents.Runner.run(
                agent.clone(model_settings=agents.ModelSettings(tool_choice="none", max_tokens=32, temperature=0)),
                follow_up, max_turns=3)
            return first, second
        finally:
            await client.close()

    first, second = asyncio.run(asyncio.wait_for(conversation(), TIMEOUT))
    assert len(cities) == 1 and len(first.raw_responses) == 2 and len(second.raw_responses) == 1
    assert isinstance(first.final_output, Forecast) and isinstance(second.final_output, Forecast)
    assert [item.type for item in first.new_items] == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    # The third turn's prompt holds the first two turns' whole conversation.
    assert second.raw_responses[0].usage.input_tokens > first.raw_responses[1].usage.input_tokens


BAD_REQUESTS = {
    # name: (fields over a good body, param, words in the message)
    "previous_response_id": ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    "conversation": ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    "no input items": ({"input": []}, "input", "input"),
    "unknown item type": ({"input": [{"type": "reasoning", "summary": []}]}, "input", "function_call_output item"),
    "image part": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
                   "input.0"),
    "call without call_id": ({"input": [{"type": "function_call", "name": "weather", "arguments": "{}"}]}, "input",
                             "call_id"),
    "arguments not JSON": ({"input": [{"type": "function_call", "call_id": "c", "name": "weather",
                                       "arguments": "{"}]}, "input", "input.0.arguments"),
    "arguments not an object": ({"input": [{"type": "function_call", "call_id": "c", "name": "weather",
                                            "arguments": "[1]"}]}, "input", "JSON object"),
    "hosted tool": ({"tools": [{"type": "web_search"}]}, "tools", "tools.0"),
    "bad tool name": ({"tools": [{**TOOL, "name": "a b"}]}, "tools", "tools.0.name"),
    "tool twice": ({"tools": [TOOL, TOOL]}, "tools", "tools.1.name"),
    "tool parameters not an object": ({"tools": [{**TOOL, "parameters": {"type": "array"}}]}, "tools",
                                      "tools.0.parameters"),
    "tool_choice of no tool": ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "clock"}},
                               "tool_choice", "no tool is named 'clock'"),
    "tool_choice of another shape": ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools"}}, "tool_choice",
                                     "tool_choice"),
    "format of no kind": ({"text": {"format": {"type": "xml"}}}, "text", "text.format"),
    "json_schema without name": ({"text": {"format": {"type": "json_schema", "schema": FORECAST}}}, "text", "name"),
    "invalid schema": ({"text": {"format": {"type": "json_schema", "name": "f", "schema": {"type": "nonsense"}}}},
                       "text.format", "invalid JSON schema"),
    "max_output_tokens zero": ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    "max_output_tokens past the context": ({"max_output_tokens": 10_000}, "max_output_tokens", "context window"),
    "temperature above 2": ({"temperature": 3}, "temperature", "temperature"),
    "stream a string": ({"stream": "yes"}, "stream", "stream"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_a_400_in_openais_shape_naming_the_field_and_the_server_goes_on(served, case):
    fields, param, words = BAD_REQUESTS[case]
    body = {"model": served.name, "input": QUESTION, "max_output_tokens": 4, **fields}
    status, answer = served.request("POST", "/v1/responses", json.dumps(body).encode(),
                                    {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and set(answer) == {"error"}, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert words in error["message"] and "\n" not in error["message"], error
    assert served.client.responses.create(model=served.name, input="Hi", max_output_tokens=2).status == "incomplete"


def test_the_model_and_the_api_key_are_checked(served):
    with pytest.raises(openai.NotFoundError) as caught:
        served.client.responses.create(model="gpt-5", input="Hi", max_output_tokens=2)
    assert caught.value.body["param"] == "model"
    stranger = openai.OpenAI(base_url=served.server.url, api_key="wrong", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        stranger.responses.create(model=served.name, input="Hi", max_output_tokens=2)


# --- the reply's shape, without a model ----------------------------------------------------------------------

def _reply(body: dict, template: str = TEMPLATES["hermes"]) -> ResponsesReply:
    request = parse_request(json.dumps({"model": "m", "input": "hi", **body}).encode(), ResponsesRequest)
    tools = [{"type": "function", "function": {"name": tool["name"], "parameters": tool["parameters"]}}
             for tool in body.get("tools", [])]
    plan = tool_calls.plan(tools or None, "auto", True, template)
    return ResponsesReply(request, "m", plan)


PIECES = ["Let me look. ", "<tool_", 'call>\n{"name": "weather", "argu', 'ments": {"city": "Os', 'lo"}}\n</tool_call>']


def _events(pieces: list[str], reason: str) -> list[StreamEvent]:
    events = [StreamEvent(piece, [index], []) for index, piece in enumerate(pieces)]
    last = events[-1]
    last.finish_reason, last.prompt_tokens, last.completion_tokens, last.cached_tokens = reason, 9, len(pieces), 4
    return events


@pytest.mark.parametrize("pieces, reason, kinds, status", [
    (PIECES, "stop", ["message", "function_call"], "completed"),
    (PIECES[:4], "length", ["message", "function_call"], "incomplete"),
    (["Just text"], "stop", ["message"], "completed"),
    ([""], "stop", ["message"], "completed"),
], ids=["text then a call", "cut off in the call", "text", "nothing"])
def test_stream_events_are_the_clients_types_and_end_in_the_whole_response(pieces, reason, kinds, status):
    streamed = _reply({"tools": [TOOL], "stream": True})
    sent = streamed.opening() + [text for event in _events(pieces, reason) for text in streamed.feed(event)]
    events = []
    for text in sent:
        kind, data = text.split("\n")[:2]
        event = STREAM_EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {event.type}"
        assert_declared_fields_only(event)
        events.append(event)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert (events[-1].type, final.status) == (f"response.{status}", status)
    assert [item.type for item in final.output] == kinds
    assert (final.usage.input_tokens, final.usage.input_tokens_details.cached_tokens) == (9, 4)
    whole = Response.model_validate(_reply({"tools": [TOOL]}).whole(_events(pieces, reason)))
    assert _without_ids(whole.model_dump()) == _without_ids(final.model_dump())
    if kinds[-1] == "function_call":
        call = final.output[-1]
        assert call.status == ("completed" if reason == "stop" else "incomplete")
        assert call.arguments == ('{"city": "Oslo"}' if reason == "stop" else '{"city": "Os')
        assert final.output[0].content[0].text == "Let me look."


def test_a_failure_mid_stream_is_an_error_event_and_the_response_failed():
    from ember.serving.protocol import ApiError

    reply = _reply({"stream": True})
    failed = [json.loads(text.split("\n")[1].removeprefix("data: "))
              for text in reply.failure(ApiError(500, "the engine failed", kind="server_error"))]
    assert [event["type"] for event in failed] == ["error", "response.failed"]
    response = STREAM_EVENTS.validate_python(failed[1]).response
    assert response.status == "failed" and response.error.message == "the engine failed"
