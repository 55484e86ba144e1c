"""runtime/tool_calls.py alone, no HTTP: which syntax a template teaches, the checks on tools and tool
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

from ember.runtime import tool_calls
from ember.runtime.tokenizer import Tokenizer
from ember.runtime.tool_calls import ToolRequestError, call_grammar, detect_syntax, parse, plan, template_message

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
    ("assistant", [{"function": {"name": "f", "arguments": "{not json"}}], None, "function.arguments: not JSON"),
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
    from ember.runtime.constrained import JsonConstraints

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
    delta = openai_types.chat_completion_chunk.ChoiceDelta.model_validate(tool_calls.delta_calls(calls))
    assert delta.tool_calls[0].index == 0 and delta.tool_calls[0].function.arguments == '{"zone": "utc"}'
    assert tool_calls.finish_reason("stop", calls) == "tool_calls"
    assert tool_calls.finish_reason("length", calls) == "length" and tool_calls.finish_reason("stop", []) == "stop"
