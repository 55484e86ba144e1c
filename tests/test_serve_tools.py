"""Tool calling through `ember serve`, with the official `openai` client: one tiny random-weight llama served
with the Llama 3.1, Qwen2.5 and Mistral chat templates (tests/tool_templates.py) in turn.

A random model calls nothing of its own accord, so what is checked is what the server guarantees: with
tool_choice "required" or a named function every reply is a call, in the template's syntax, whose arguments
the function's schema accepts (grammar-enforced), streamed or whole; a round trip (call, tool result, answer)
renders as transformers' apply_chat_template renders it; a template without tool syntax and bad tools get a
400 naming the field, and the server goes on. Servers listen on 127.0.0.1 in this process and are stopped by
their own handle; one `ember serve --chat-template` subprocess by its PID.
"""

from __future__ import annotations

import json
from pathlib import Path

import artifact_cache
import jsonschema
import models
import pytest
from helpers import ember_serve, run_main
from tool_templates import TEMPLATES

from ember.runtime import Engine, load_artifact
from ember.serving import Scheduler

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from ember.serving.server import Server  # noqa: E402 - needs FastAPI, checked for above

TIMEOUT = 60  # seconds; catches a hang, never a speed
CONTEXT = 2048
REPEATS = 3
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}
# strict: the openai client's stream helper parses only strict tools' arguments.
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK, "strict": True}}]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]


class ToolServer:
    """A server over its own load of an artifact, chatting with `template` (None: the artifact's own)."""

    def __init__(self, artifact_dir, template: str | None) -> None:
        artifact = load_artifact(artifact_dir)
        if template is not None:
            artifact.tokenizer.use_chat_template(template, "test template")
        self.tokenizer = artifact.tokenizer
        self.scheduler = Scheduler(Engine(artifact))
        self.name = artifact_dir.name
        self.server = Server(self.scheduler, self.name, port=0)
        self.server.start()
        self.client = openai.OpenAI(base_url=self.server.url, api_key="unused", max_retries=0, timeout=TIMEOUT)

    def chat(self, **options):
        return self.client.chat.completions.create(model=self.name, **{"messages": QUESTION, **options})

    def close(self) -> None:
        self.server.stop()
        self.scheduler.close()


@pytest.fixture(scope="session")
def tools_llama(tmp_path_factory) -> Path:
    """The plain tiny llama's shapes with a context of CONTEXT tokens: Llama 3.1's prompt with two tools is
    ~1350 of this tokenizer's (mostly one-character) tokens."""
    from ember.driver.compiler import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("tools-llama")
    model_type, overrides = models.TINY_MODELS["llama"]
    config = models.make_config(model_type, **overrides, max_position_embeddings=CONTEXT)
    model_dir = models.write_model(models.random_model(config), root / "checkpoint")
    options = CompileOptions(prefill_chunk=256, max_batch=4, show_progress=False)
    artifact_cache.build(artifact_cache.artifact_key("tiny-llama-tools", options, [model_dir]), root / "llama-tools",
                         lambda dest: compile_model(model_dir, dest, options))
    return root / "llama-tools"


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(request, tools_llama):
    """The tiny llama served with one family's template."""
    server = ToolServer(tools_llama, TEMPLATES[request.param])
    server.family = request.param
    yield server
    server.close()


def _assert_valid_call(call, names=SCHEMAS) -> dict:
    assert call.type == "function" and call.id and call.function.name in names, call
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_always_returns_a_valid_call(served):
    for seed in range(REPEATS):
        reply = served.chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=100, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        _assert_valid_call(choice.message.tool_calls[0])


def test_required_with_parallel_calls_returns_valid_calls_the_last_cut_off_only_at_length(served):
    reply = served.chat(tools=TOOLS, tool_choice="required", max_tokens=150)
    calls, reason = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
    assert calls and len({call.id for call in calls}) == len(calls) and reason in ("tool_calls", "length"), reply
    for call in calls if reason == "tool_calls" else calls[:-1]:
        _assert_valid_call(call)
    if reason == "length":  # max_tokens cut the last call's arguments off: what was written of them, as OpenAI
        assert calls[-1].function.name in SCHEMAS and calls[-1].function.arguments.startswith("{")


def test_required_streams_a_call_the_client_assembles(served):
    for seed in range(REPEATS):
        with served.client.chat.completions.stream(model=served.name, messages=QUESTION, tools=TOOLS,
                                                   tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                                   seed=seed, stream_options={"include_usage": True}) as stream:
            done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
            final = stream.get_final_completion()
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        arguments = _assert_valid_call(choice.message.tool_calls[0])
        assert choice.message.tool_calls[0].function.parsed_arguments == arguments
        assert [event.name for event in done] == [choice.message.tool_calls[0].function.name]
        assert final.usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_calls_that_function(served, stream):
    options = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "clock"}}, max_tokens=100)
    if stream:
        with served.client.chat.completions.stream(model=served.name, messages=QUESTION, **options) as events:
            message = events.get_final_completion().choices[0].message
    else:
        message = served.chat(**options).choices[0].message
    assert [call.function.name for call in message.tool_calls] == ["clock"]
    _assert_valid_call(message.tool_calls[0])


def test_tool_choice_none_renders_the_tools_but_returns_text(served):
    with_tools = served.chat(tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0)
    without = served.chat(max_tokens=4, temperature=0)
    assert with_tools.choices[0].message.tool_calls is None
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens
    assert with_tools.usage.prompt_tokens == _transformers_prompt_tokens(served, [*QUESTION], TOOLS)


def _transformers_prompt_tokens(served: ToolServer, messages: list[dict], tools: list[dict]) -> int:
    """Tokens of the conversation as transformers renders it with the served template (arguments as objects,
    as the Llama and Qwen templates `tojson` them)."""
    transformers = pytest.importorskip("transformers")
    for message in messages:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    described = [{"type": "function", "function": {key: value for key, value in tool["function"].items()
                                                   if key != "strict"}} for tool in tools]
    text = transformers.PreTrainedTokenizerFast(tokenizer_object=served.tokenizer._tokenizer).apply_chat_template(
        messages, tools=described, chat_template=TEMPLATES[served.family], tokenize=False, add_generation_prompt=True,
        bos_token="<s>", eos_token="</s>")
    return len(served.tokenizer.encode(text, add_special_tokens=False))


def test_a_round_trip_renders_the_tool_result_through_the_template(served):
    tools = TOOLS[1:]
    call = served.chat(tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=60).choices[0].message
    assistant = call.model_dump(exclude_none=True)
    result = {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "It is noon at Oslo harbour."}
    conversation = [*QUESTION, assistant, result]
    answer = served.chat(messages=conversation, tools=tools, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens == _transformers_prompt_tokens(served, json.loads(json.dumps(conversation)),
                                                                     tools)
    shorter = served.chat(messages=[*QUESTION, assistant, {**result, "content": "Noon."}], tools=tools, max_tokens=1)
    assert shorter.usage.prompt_tokens < answer.usage.prompt_tokens  # the result's own text is in the prompt


@pytest.fixture(scope="module")
def plain(tools_llama):
    """The tiny llama with its own chat template, which has no tool-call syntax."""
    server = ToolServer(tools_llama, None)
    yield server
    server.close()


@pytest.fixture(scope="module")
def hermes(tools_llama):
    server = ToolServer(tools_llama, TEMPLATES["hermes"])
    yield server
    server.close()


def _tool(**function) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize("options, param, words", [
    (dict(tools=[_tool(description="no name", parameters=CLOCK)]), "tools", "tools.0.function.name"),
    (dict(tools=[_tool(name="f", parameters={"type": "array"})]), "tools", "tools.0.function.parameters"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "teleport"}}), "tool_choice",
     "no tool is named 'teleport'"),
    (dict(tools=TOOLS, messages=[*QUESTION, {"role": "tool", "content": "42"}]), "messages",
     "messages.1.tool_call_id"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "tool_choice"),
])
def test_bad_tool_requests_get_a_400_naming_the_field_and_the_server_goes_on(hermes, options, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        hermes.chat(max_tokens=4, **options)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and words in error["message"], error
    assert hermes.chat(max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_a_template_without_tool_syntax_is_refused_naming_tools(plain):
    with pytest.raises(openai.BadRequestError) as caught:
        plain.chat(tools=TOOLS, max_tokens=4)
    assert caught.value.body["param"] == "tools" and "tool-call syntax" in caught.value.body["message"]
    assert plain.chat(max_tokens=2).choices[0].finish_reason in ("stop", "length")


def test_cli_serve_chat_template_serves_tool_calls(tools_llama, tmp_path):
    key_file, template = tmp_path / "key", tmp_path / "qwen.jinja"
    key_file.write_text("k\n")
    template.write_text(TEMPLATES["hermes"], encoding="utf-8")
    with ember_serve(tools_llama, key_file, TIMEOUT, "--chat-template", str(template)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=TIMEOUT)
        reply = client.chat.completions.create(model=tools_llama.name, messages=QUESTION,
                                               tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                               max_tokens=100)
        _assert_valid_call(reply.choices[0].message.tool_calls[0])


@pytest.mark.parametrize("content, words", [(None, "not a file"), ("", "the file is empty"),
                                            ("{% if %}", "line 1"), (b"\xff\xfe", "UTF-8")])
def test_cli_serve_refuses_a_bad_chat_template_in_one_line(tiny_llama, tmp_path, capsys, content, words):
    path = tmp_path / "template.jinja"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    result = run_main(capsys, "serve", str(tiny_llama.artifact_dir), "--chat-template", str(path))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("ember: error: --chat-template ") and words in lines[0], lines


CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "weather"}}, "auto": "auto",
           "none": "none"}


def _assembled(chunks) -> dict:
    """A raw chat stream put together by hand, as a client would: content, calls by index (name, arguments),
    finish reason, and which chunks carried what."""
    content, calls, reason, kinds = "", {}, None, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.type == "function" and call.function.arguments == "", call
                calls[call.index] = [call.function.name, ""]
                kinds.append(("start", call.index))
            else:
                assert call.function.name is None and call.function.arguments, call
                calls[call.index][1] += call.function.arguments
                kinds.append(("arguments", call.index))
        kinds.append(("content", None)) if choice.delta.content else None
    return {"content": content, "calls": [tuple(call) for call in calls.values()], "finish_reason": reason,
            "kinds": kinds}


def _whole(message, reason) -> dict:
    return {"content": message.content or "", "finish_reason": reason,
            "calls": [(call.function.name, call.function.arguments) for call in message.tool_calls or []]}


@pytest.mark.parametrize("choice", CHOICES)
def test_a_streamed_reply_assembles_into_the_whole_reply(served, choice):
    options = dict(tools=TOOLS, tool_choice=CHOICES[choice], parallel_tool_calls=False, max_tokens=100,
                   temperature=0)
    whole = served.chat(**options).choices[0]
    expected = _whole(whole.message, whole.finish_reason)
    assert bool(expected["calls"]) == (choice in ("required", "named")), expected
    raw = _assembled(served.chat(stream=True, **options))
    assert {key: raw[key] for key in expected} == expected
    with served.client.chat.completions.stream(model=served.name, messages=QUESTION, **options) as stream:
        try:
            final = stream.get_final_completion().choices[0]
        except openai.LengthFinishReasonError as err:  # the helper's refusal to parse a reply cut off (auto, none)
            final = err.completion.choices[0]  # carries what it assembled
    assert _whole(final.message, final.finish_reason) == expected


def test_a_call_streams_its_arguments_while_they_are_generated(served):
    chunks = list(served.chat(stream=True, tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "weather"}}, max_tokens=100, temperature=0, stream_options={"include_usage": True}))
    assembled = _assembled(chunks)
    (name, arguments), = assembled["calls"]
    pieces = [kind for kind in assembled["kinds"] if kind[0] == "arguments"]
    assert name == "weather" and len(arguments) >= 20 and assembled["finish_reason"] == "tool_calls"
    # Each chunk comes from one decoding step's text: the call's start went out with more than half of the
    # arguments' characters' worth of steps still to come, each in a chunk of its own.
    assert assembled["kinds"][0] == ("start", 0) and len(pieces) > len(arguments) // 2, assembled["kinds"]
    assert chunks[-1].usage.completion_tokens >= len(pieces)


def test_a_call_cut_off_by_max_tokens_streams_what_was_written_and_finishes_on_length(served):
    options = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}, temperature=0)
    whole = served.chat(max_tokens=100, **options)
    for max_tokens in range(whole.usage.completion_tokens - 1, 0, -1):
        cut = served.chat(max_tokens=max_tokens, **options).choices[0]
        if cut.message.tool_calls and cut.message.tool_calls[0].function.arguments.endswith('"city": "'):
            break
    else:
        pytest.fail("no max_tokens cuts the call inside its arguments")
    assert cut.finish_reason == "length" and cut.message.tool_calls[0].function.name == "weather"
    streamed = _assembled(served.chat(stream=True, max_tokens=max_tokens, **options))
    assert streamed["finish_reason"] == "length" and streamed["calls"] == _whole(cut.message, "length")["calls"]
    assert whole.choices[0].message.tool_calls[0].function.arguments.startswith(streamed["calls"][0][1])


def test_the_demo_runs_a_tool_round_trip_as_docs_serving_shows_it(demo_builds):
    """docs/serving.md's example on the demo with the shipped template: `required` gives a valid call, ended as
    "tool_calls" even when the model would go on to a second call it cannot finish within max_tokens (the
    unfinished syntax after a whole call is dropped); the call and its result sent back fit the demo's context,
    and the demo answers in text."""
    import ember

    template = (Path(ember.__file__).parent / "demo_model" / "chat_template_tools.jinja").read_text()
    server = ToolServer(demo_builds.get("cpu", "q0f32"), template)
    try:
        tools = [{"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
            "additionalProperties": False}}}]
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        reply = server.chat(messages=messages, tools=tools, tool_choice="required", max_tokens=64)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        call = choice.message.tool_calls[0]
        assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")
        messages += [{"role": "assistant", "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "12 C and sunny"}]
        answer = server.chat(messages=messages, tools=tools, max_tokens=32, temperature=0)
        assert answer.usage.prompt_tokens + 32 <= 256 and answer.choices[0].message.content
    finally:
        server.close()
