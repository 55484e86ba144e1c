"""serving/tool_calls.py alone, no HTTP: which syntax a template teaches, the checks on tools and tool
messages, rendering compared with transformers' apply_chat_template on the same template, the call grammar
driven by random logits through the real token mask, and calls read back out of text, shaped as the
official `openai` package's types parse them."""

from __future__ import annotations

import json

import jsonschema
import models
import numpy as np
import pytest
from tool_templates import TEMPLATES

from ember.runtime.tokenizer import Tokenizer
from ember.serving import tool_calls
from ember.serving.tool_calls import ToolRequestError, call_grammar, detect_syntax, parse, plan, template_message

openai_types = pytest.importorskip("openai.types.chat")
pytest.importorskip("llguidance")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
             "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.mark.parametrize("family", TEMPLATES)
def test_each_family_template_is_recognised(family):
    assert detect_syntax(TEMPLATES[family]).name == family


def test_a_template_without_tool_syntax_is_refused_naming_tools():
    assert detect_syntax(models.CHAT_TEMPLATE) is None
    with pytest.raises(ToolRequestError) as caught:
        plan(TOOLS, "auto", True, models.CHAT_TEMPLATE)
    assert caught.value.param == "tools" and "tool-call syntax" in str(caught.value)


def _tool(**function) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize("tools, choice, param, words", [
    ([_tool(description="no name")], "auto", "tools", "tools.0.function.name"),
    ([_tool(name="a b")], "auto", "tools", "tools.0.function.name"),
    ([_tool(name="f", parameters={"type": "string"})], "auto", "tools", "tools.0.function.parameters"),
    ([_tool(name="f", parameters=[1])], "auto", "tools", "tools.0.function.parameters"),
    ([{"type": "retrieval"}], "auto", "tools", "tools.0"),
    ([_tool(name="f"), _tool(name="f")], "auto", "tools", "given twice"),
    ([_tool(name="f")], {"type": "function", "function": {"name": "g"}}, "tool_choice", "no tool is named 'g'"),
    ([_tool(name="f")], "always", "tool_choice", "tool_choice"),
    ([_tool(name="f")], {"type": "function"}, "tool_choice", "tool_choice"),
    ([_tool(name="f")], {"type": "function", "function": "f"}, "tool_choice", "tool_choice"),
    ([_tool(name="f")], {"type": "function", "function": ["f"]}, "tool_choice", "tool_choice"),
    ([_tool(name="f")], ["auto"], "tool_choice", "tool_choice"),
    (None, "required", "tool_choice", "needs tools"),
])
def test_bad_tools_and_tool_choice_name_their_field(tools, choice, param, words):
    with pytest.raises(ToolRequestError) as caught:
        plan(tools, choice, True, TEMPLATES["hermes"])
    assert caught.value.param == param and words in str(caught.value)


@pytest.mark.parametrize("role, calls, call_id, words", [
    ("tool", None, None, "messages.3.tool_call_id"),
    ("user", [{"function": {"name": "f", "arguments": "{}"}}], None, "only assistant messages"),
    ("assistant", [{"function": {"arguments": "{}"}}], None, "messages.3.tool_calls.0.function.name"),
    ("assistant", [{"function": {"name": "f", "arguments": "{not json"}}], None,
     "function.arguments is not valid JSON"),
    ("assistant", [{"function": {"name": "f", "arguments": '{"a": ' * 100_000}}], None, "64 levels deep"),
    ("assistant", [{"function": {"name": "f", "arguments": '{"a": ' + "9" * 5000 + "}"}}], None, "64 digits"),
    ("assistant", [{"function": {"name": "f", "arguments": '{"a": NaN}'}}], None, "NaN, which is not JSON"),
    ("assistant", [{"function": {"name": "f", "arguments": "[1]"}}], None, "must be a JSON object"),
])
def test_bad_tool_messages_name_the_message(role, calls, call_id, words):
    with pytest.raises(ToolRequestError) as caught:
        template_message(role, "x", calls, call_id, 3)
    assert caught.value.param == "messages" and words in str(caught.value)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    models.write_tokenizer(directory)
    return directory


@pytest.mark.parametrize("family", TEMPLATES)
def test_a_round_trip_renders_as_transformers_renders_it(family, tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    template = TEMPLATES[family]
    tool_plan = plan(TOOLS[:1], "auto", True, template)
    call_id = tool_plan.syntax.call_id()
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [template_message("user", "Weather in Oslo?", None, None, 0),
                template_message("assistant", "", [call], None, 1),
                template_message("tool", "minus 3 and snow", None, call_id, 2)]
    ours = Tokenizer.from_dir(tokenizer_dir)
    ours.use_chat_template(template, family)
    rendered = ours.apply_chat_template(messages, tools=tool_plan.template_tools)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)).apply_chat_template(
        messages, tools=tool_plan.template_tools, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert rendered == theirs
    assert "minus 3 and snow" in rendered and "The weather in a city" in rendered and "Oslo" in rendered


def _constrained_texts(artifact, grammar: str, count: int, seed: int = 0) -> list[str]:
    """`count` texts sampled from random logits through the token mask of `grammar`, each to end of sequence."""
    from ember.serving.constrained import JsonConstraints

    constraints, rng, texts = JsonConstraints(artifact, models.VOCAB_SIZE), np.random.default_rng(seed), []
    for _ in range(count):
        mask, generated = constraints.grammar_mask(grammar, "tool_choice"), []
        while True:
            logits = mask(generated, rng.normal(0, 3, models.VOCAB_SIZE).astype(np.float32))
            token = int(np.argmax(logits))
            if token == models.EOS_ID:
                break
            generated.append(token)
            assert len(generated) < 400, artifact.tokenizer.decode(generated)
        texts.append(artifact.tokenizer.decode(generated))
    return texts


@pytest.mark.parametrize("family", TEMPLATES)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_the_call_grammar_yields_only_valid_calls(family, choice, tiny_llama):
    tool_plan = plan(TOOLS, choice, False, TEMPLATES[family])
    for text in _constrained_texts(tiny_llama.artifact, call_grammar(tool_plan), 8):
        content, calls = parse(text, tool_plan)
        assert content == "" and len(calls) == 1, text
        assert calls[0].name == tool_plan.forced or tool_plan.forced is None
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


def _pydantic_tool() -> tuple[dict, dict]:
    """A tool whose parameters pydantic wrote (`model_json_schema()`: a nested model as `$defs` and `$ref`)."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict

    class Place(BaseModel):
        model_config = ConfigDict(extra="forbid")  # else random logits write extra keys until the test's bound
        city: Literal["oslo", "rome"]
        zone: Literal["utc", "cet"]

    class Trip(BaseModel):
        model_config = ConfigDict(extra="forbid")
        start: Place
        stops: list[Place]

    schema = Trip.model_json_schema()
    assert "$defs" in schema and "$ref" in json.dumps(schema)
    return {"type": "function", "function": {"name": "plan_trip", "parameters": schema}}, schema


@pytest.mark.parametrize("family", TEMPLATES)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "plan_trip"}}])
def test_parameters_with_defs_and_refs_constrain_calls_as_pydantic_wrote_them(family, choice, tiny_llama):
    """`$ref`s into the parameters' own `$defs` resolve in the call grammar (they point into the function's schema,
    not the grammar's root), and every constrained call validates against pydantic's schema."""
    tool, schema = _pydantic_tool()
    tool_plan = plan([tool, *TOOLS], choice, False, TEMPLATES[family])
    for text in _constrained_texts(tiny_llama.artifact, call_grammar(tool_plan), 6):
        content, calls = parse(text, tool_plan)
        assert content == "" and len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments), schema if calls[0].name == "plan_trip"
                            else SCHEMAS[calls[0].name])


def test_parallel_calls_in_hermes_syntax_parse_in_order():
    tool_plan = plan(TOOLS, "required", True, TEMPLATES["hermes"])
    assert '("\\n" tagged)*' in call_grammar(tool_plan)
    text = ('Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>')
    content, calls = parse(text, tool_plan)
    assert content == "Let me look." and [call.name for call in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome", "days": 2}


@pytest.mark.parametrize("family, text, names", [
    ("llama3", '{"name": "get_time", "parameters": {"zone": "cet"}}', ["get_time"]),
    ("llama3", '<|python_tag|>{"name": "get_time", "arguments": {"zone": "cet"}}', ["get_time"]),
    ("llama3", "It is sunny.", []),
    ("llama3", '{"name": "no_such_tool", "parameters": {}}', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}]', ["get_time"]),
    ("mistral", '[{"name": "get_time", "arguments": {"zone": "utc"}}]', ["get_time"]),  # [TOOL_CALLS] decoded away
    ("mistral", "[TOOL_CALLS][{broken", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}, {"name": "get_t', ["get_time"]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n<tool_call>\n{"na',
     ["get_time"]),  # max_tokens cut the second call off: the whole first one stands
    ("hermes", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"zone\"}\n</tool_call>", []),
])
def test_calls_are_read_out_of_free_text(family, text, names):
    content, calls = parse(text, plan(TOOLS, "auto", True, TEMPLATES[family]))
    assert [call.name for call in calls] == names
    assert content == ("" if names else text)


def test_tool_choice_none_never_returns_calls():
    tool_plan = plan(TOOLS, "none", True, TEMPLATES["hermes"])
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    assert parse(text, tool_plan) == (text, []) and not tool_plan.enforced


@pytest.mark.parametrize("family, pattern", [("mistral", r"[A-Za-z0-9]{9}"), ("hermes", r"call_[A-Za-z0-9]{24}")])
def test_call_ids_take_the_form_the_family_templates_accept(family, pattern):
    import re

    assert re.fullmatch(pattern, detect_syntax(TEMPLATES[family]).call_id())


def test_messages_and_chunks_parse_as_the_openai_types():
    calls = [tool_calls.ToolCall("get_time", '{"zone": "utc"}', "call_1")]
    message = openai_types.ChatCompletionMessage.model_validate(tool_calls.message("", calls))
    assert message.content is None and message.tool_calls[0].function.name == "get_time"
    start = openai_types.chat_completion_chunk.ChoiceDelta.model_validate(
        tool_calls.delta(tool_calls.CallStart(1, "call_1", "get_time")))
    assert start.tool_calls[0].index == 1 and start.tool_calls[0].function.name == "get_time"
    assert start.tool_calls[0].id == "call_1" and start.tool_calls[0].function.arguments == ""
    piece = openai_types.chat_completion_chunk.ChoiceDelta.model_validate(
        tool_calls.delta(tool_calls.Arguments(1, '{"zone": ')))
    assert piece.tool_calls[0].id is None and piece.tool_calls[0].function.arguments == '{"zone": '
    assert tool_calls.delta(tool_calls.CallEnd(1)) is None
    assert tool_calls.finish_reason("stop", calls) == "tool_calls"
    assert tool_calls.finish_reason("length", calls) == "length" and tool_calls.finish_reason("stop", []) == "stop"


STREAMED_TEXTS = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro\\"m\\u00e9 {x}", "days": 2}}\n'
               '</tool_call>\n'),
    ("hermes", 'Before <tool_call>{"name": "get_weather", "arguments": {"city": "A\\\\", "days": 1}}</tool_call> '
               'after, <tool_ and < tool_call> too'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "zone"}\n</tool_call> text'),
    ("hermes", '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n<tool_call>\n{"na'),
    ("llama3", '{"name": "get_time", "parameters": {"zone": "cet"}}'),
    ("llama3", ' <|python_tag|>{"type": "function", "name": "get_time", "arguments": {"zone": "cet"}}'),
    ("llama3", '{"parameters": {"zone": [1, {"a": "}"}]}, "name": "get_time"}'),
    ("llama3", '{"answer": 42} is not a call'),
    ("llama3", "It is sunny {not a call}."),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}, '
                '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}]'),
    ("mistral", '[{"name": "get_time", "arguments": {"zone": "utc"}}]'),
    ("mistral", "[TOOL_CALLS][{broken"),
    ("mistral", "[TOOLS] is [text]"),
    ("mistral", '[TOOL_CALLS]{"name": "get_time", "arguments": {"zone": "ut'),
]


def _assembled(events) -> tuple[str, list[tuple[int, str, str, str]], list[int]]:
    """(content, [(index, id, name, arguments)], ended indexes) of a stream of reader events."""
    content, calls, ended = "", {}, []
    for event in events:
        if isinstance(event, tool_calls.Content):
            content += event.text
        elif isinstance(event, tool_calls.CallStart):
            calls[event.index] = [event.index, event.id, event.name, ""]
        elif isinstance(event, tool_calls.Arguments):
            calls[event.index][3] += event.text
        else:
            ended.append(event.index)
    return content, [tuple(call) for call in calls.values()], ended


def _read_in_pieces(text: str, tool_plan, cuts) -> tuple[tool_calls.CallReader, list]:
    reader, events, start = tool_calls.CallReader(tool_plan), [], 0
    for cut in [*cuts, len(text)]:
        events += reader.feed(text[start:cut])
        start = cut
    return reader, events + reader.finish()


@pytest.mark.parametrize("family, text", STREAMED_TEXTS)
def test_text_read_in_any_pieces_gives_the_calls_and_content_of_the_whole(family, text):
    tool_plan = plan(TOOLS, "auto", True, TEMPLATES[family])
    whole_content, whole_calls = parse(text, tool_plan)
    rng = np.random.default_rng(0)
    splits = [range(1, len(text)), *[sorted(rng.choice(len(text), 5, replace=False)) for _ in range(20)]]
    for cuts in splits:
        reader, events = _read_in_pieces(text, tool_plan, cuts)
        content, calls, ended = _assembled(events)
        assert content == whole_content, (text, cuts)
        assert [(name, arguments) for _, _, name, arguments in calls] == \
               [(call.name, call.arguments) for call in whole_calls], (text, cuts)
        assert [call.name for call in reader.calls] == [call.name for call in whole_calls]
        assert ended == [i for i, call in enumerate(whole_calls) if call.complete]
        for call in reader.calls:
            if call.complete:  # the model's own argument text, whole
                assert call.arguments in text and isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("family, text, content, names", [
    ("hermes", STREAMED_TEXTS[0][1], "Let me look.", ["get_time", "get_weather"]),
    ("hermes", STREAMED_TEXTS[1][1], "Before after, <tool_ and < tool_call> too", ["get_weather"]),
    ("hermes", STREAMED_TEXTS[2][1], STREAMED_TEXTS[2][1], []),
    ("llama3", STREAMED_TEXTS[6][1], "", ["get_time"]),
    ("llama3", STREAMED_TEXTS[7][1], "", ["get_time"]),
    ("llama3", STREAMED_TEXTS[8][1], STREAMED_TEXTS[8][1], []),
    ("mistral", STREAMED_TEXTS[10][1], "Sure.", ["get_time", "get_weather"]),
    ("mistral", STREAMED_TEXTS[13][1], STREAMED_TEXTS[13][1], []),
])
def test_whole_replies_read_into_content_and_calls(family, text, content, names):
    read_content, calls = parse(text, plan(TOOLS, "auto", True, TEMPLATES[family]))
    assert read_content == content and [call.name for call in calls] == names


def test_arguments_stream_as_the_model_writes_them_and_the_pieces_join_into_them():
    tool_plan = plan(TOOLS, "auto", True, TEMPLATES["hermes"])
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Troms\\u00f8", "days": 4}}\n</tool_call>'
    reader, events = _read_in_pieces(text, tool_plan, range(1, len(text)))
    kinds = [type(event).__name__ for event in events]
    assert kinds[0] == "CallStart" and kinds[-1] == "CallEnd" and kinds.count("Arguments") > 10
    pieces = [event.text for event in events if isinstance(event, tool_calls.Arguments)]
    assert "".join(pieces) == reader.calls[0].arguments == '{"city": "Troms\\u00f8", "days": 4}'
    start = text.index('"arguments": {') + len('"arguments": {')
    first, _ = _read_in_pieces(text[:start], tool_plan, [])  # the call is out once its arguments begin
    assert [call.name for call in first.calls] == ["get_weather"] and not first.calls[0].complete


@pytest.mark.parametrize("family, piece, held, then, released", [
    ("hermes", "Hello <tool_", "Hello", "x", " <tool_x"),
    ("hermes", "Hello  ", "Hello", "there", "  there"),
    ("mistral", "Look: [TOOL_", "Look:", "S]", " [TOOL_S]"),
    ("mistral", "  [", "", "1", "  [1"),
    ("llama3", " <|python", "", "!", " <|python!"),
    ("llama3", "Sunny <tool_", "Sunny <tool_", "x", "x"),
])
def test_only_what_could_begin_a_call_is_held_back(family, piece, held, then, released):
    reader = tool_calls.CallReader(plan(TOOLS, "auto", True, TEMPLATES[family]))
    assert _assembled(reader.feed(piece))[0] == held
    assert _assembled(reader.feed(then))[0] == released


def test_an_unknown_function_is_released_as_text_once_its_name_is_read():
    reader = tool_calls.CallReader(plan(TOOLS, "auto", True, TEMPLATES["hermes"]))
    text = '<tool_call>\n{"name": "no_such_tool", "argu'
    assert _assembled(reader.feed(text)) == (text, [], [])


def test_a_call_cut_off_stays_incomplete_and_the_reply_does_not_end_on_calls():
    tool_plan = plan(TOOLS, "auto", True, TEMPLATES["mistral"])
    reader = tool_calls.read('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "ut', tool_plan)
    assert reader.calls[0].arguments == '{"zone": "ut' and not reader.calls[0].complete
    assert reader.finish_reason("length") == "length" and reader.finish_reason("stop") == "stop"
    whole = tool_calls.read('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}]', tool_plan)
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "tool_calls"


@pytest.mark.parametrize(("family", "text", "reason"), [
    # max_tokens ran out as a second call began, its name not yet written: the reply ended on its whole call
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n<tool_call>\n{"na',
     "tool_calls"),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}, {"name": "get_', "tool_calls"),
    # ...or in text written after it, or inside a second call whose name was read
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\nThe time is', "length"),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {"zo', "length"),
])
def test_a_reply_cut_after_whole_calls_ends_on_them(family, text, reason):
    reader = tool_calls.read(text, plan(TOOLS, "required", True, TEMPLATES[family]))
    assert reader.finish_reason("length") == reason
