"""Tool calling (OpenAI's `tools`) as `ember serve` does it: pure functions, no HTTP, no model.

A model calls tools in the syntax its chat template teaches it; `detect_syntax` reads which from the
template's source: Llama 3.1/3.2 (a bare JSON object `{"name": ..., "parameters": {...}}`), Qwen2.5 and
Hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), Mistral (`[TOOL_CALLS][{"name": ...,
"arguments": {...}}]`). `plan` checks a request's tools and tool_choice against it; `call_grammar` is the
llguidance grammar that makes `required` or a named function certain (the reply is a call in that syntax
whose arguments match the function's JSON schema, then end of sequence); `parse` reads calls back out of
the model's text, and `message`, `delta_calls` shape them as OpenAI's responses and stream chunks do.

Every refusal is a `ToolRequestError` naming the request field at fault.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ember.core.errors import GenerationError
from ember.runtime.constrained import JSON_OPTIONS  # fixed whitespace, as for response_format

JsonObject = dict[str, Any]
_ALPHANUMERIC = string.ascii_letters + string.digits
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class ToolRequestError(GenerationError):
    """A request's tools, tool_choice or tool messages that cannot be used; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSyntax:
    """How one family of chat templates writes a tool call."""

    name: str
    arguments_key: str  # the key of a call's arguments: "parameters" (Llama 3.x) or "arguments"
    parallel: bool  # whether the syntax holds several calls in one reply

    def call_id(self) -> str:
        """A fresh tool call id, of the form the family's templates accept (Mistral's: 9 letters or digits)."""
        if self.name == "mistral":
            return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
        return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


LLAMA3 = ToolSyntax("llama3", "parameters", parallel=False)
HERMES = ToolSyntax("hermes", "arguments", parallel=True)
MISTRAL = ToolSyntax("mistral", "arguments", parallel=True)


def detect_syntax(template: Any) -> ToolSyntax | None:
    """The tool-call syntax a chat template's source teaches its model; None if it has none ember knows."""
    if not isinstance(template, str):
        return None
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|start_header_id|>" in template and "ipython" in template:
        return LLAMA3
    return None


@dataclass(frozen=True)
class ToolPlan:
    """What one request asked of tools: the functions (name -> JSON schema of their arguments), the tools as
    the chat template gets them, and the choice: "auto", "none", "required", or one function's name."""

    syntax: ToolSyntax
    functions: dict[str, JsonObject]
    template_tools: list[JsonObject]
    choice: str
    forced: str | None = None
    parallel: bool = True

    @property
    def enforced(self) -> bool:
        """Whether the reply must be a call (tool_choice required or a named function)."""
        return self.choice == "required" or self.forced is not None

    @property
    def returns_calls(self) -> bool:
        """Whether calls are read out of the reply (every choice but "none")."""
        return self.choice != "none"


def plan(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool, template: Any) -> ToolPlan | None:
    """A request's tools checked against the served chat template; None when it sends none."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolRequestError("tool_choice: needs tools", "tool_choice")
        return None
    syntax = detect_syntax(template)
    if syntax is None:
        raise ToolRequestError("tools: this model's chat template has no tool-call syntax ember knows (Llama 3.1/3.2, "
                               "Qwen2.5/Hermes <tool_call>, Mistral [TOOL_CALLS]); serve it with --chat-template "
                               "FILE holding one", "tools")
    functions, template_tools = {}, []
    for index, tool in enumerate(tools):
        name, parameters, described = _function(tool, index)
        if name in functions:
            raise ToolRequestError(f"tools.{index}.function.name: {name!r} is given twice", "tools")
        functions[name] = parameters
        template_tools.append({"type": "function", "function": described})
    choice, forced = _choice(tool_choice, functions)
    # A named function is one call (as vLLM makes it): a weak model held to "one or more" may never stop.
    parallel = parallel_tool_calls and syntax.parallel and forced is None
    return ToolPlan(syntax, functions, template_tools, choice, forced, parallel)


def _function(tool: Any, index: int) -> tuple[str, JsonObject, JsonObject]:
    """(name, parameters schema, function object for the template) of `tools[index]`."""
    where = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolRequestError(f"{where}: must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise ToolRequestError(f"{where}.function.name: must be 1 to 64 letters, digits, '_', '.' or '-', "
                               f"got {name!r}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolRequestError(f"{where}.function.description: must be a string", "tools")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolRequestError(f"{where}.function.parameters: must be a JSON schema of an object", "tools")
    described = {"name": name, **({"description": description} if description is not None else {}),
                 "parameters": parameters}
    return name, parameters, described


def _choice(tool_choice: Any, functions: dict[str, JsonObject]) -> tuple[str, str | None]:
    """(choice, forced function name) of a request's tool_choice."""
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("auto", "none", "required"):
        return tool_choice, None
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(name, str)):
        raise ToolRequestError("tool_choice: must be 'auto', 'none', 'required' or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in functions:
        raise ToolRequestError(f"tool_choice: no tool is named {name!r} (tools: {', '.join(functions)})",
                               "tool_choice")
    return "function", name


def template_message(role: str, content: str, tool_calls: Sequence[Any] | None, tool_call_id: str | None,
                     index: int) -> JsonObject:
    """`messages[index]` as chat templates expect it, as transformers' apply_chat_template passes it: an
    assistant's calls under `tool_calls` (arguments parsed into objects, as Llama's and Qwen's templates
    `tojson` them), a tool result with its `tool_call_id`. Keys are present only when given: templates test
    `'tool_calls' in message`."""
    where = f"messages.{index}"
    message: JsonObject = {"role": role, "content": content}
    if role == "tool":
        if not tool_call_id:
            raise ToolRequestError(f"{where}.tool_call_id: a tool message needs the id of the call it answers",
                                   "messages")
        message["tool_call_id"] = tool_call_id
    if tool_calls:
        if role != "assistant":
            raise ToolRequestError(f"{where}.tool_calls: only assistant messages carry tool calls", "messages")
        message["tool_calls"] = [_template_call(call, f"{where}.tool_calls.{i}") for i, call in enumerate(tool_calls)]
    return message


def _template_call(call: Any, where: str) -> JsonObject:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolRequestError(f"{where}.function.name: a tool call needs its function's name", "messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolRequestError(f"{where}.function.arguments: not JSON", "messages") from None
    if not isinstance(arguments, dict):
        raise ToolRequestError(f"{where}.function.arguments: must be a JSON object", "messages")
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def call_grammar(tool_plan: ToolPlan) -> str:
    """The llguidance (Lark) grammar of a reply that is only calls: one (or, with parallel calls, one or more)
    in the plan's syntax, each naming an allowed function with arguments its schema accepts."""
    names = [tool_plan.forced] if tool_plan.forced else list(tool_plan.functions)
    key = tool_plan.syntax.arguments_key
    calls = [{"type": "object", "properties": {"name": {"const": name}, key: tool_plan.functions[name]},
              "required": ["name", key], "additionalProperties": False} for name in names]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if tool_plan.syntax is MISTRAL:
        array = {"type": "array", "items": call, "minItems": 1, **({} if tool_plan.parallel else {"maxItems": 1})}
        return f'start: "[TOOL_CALLS]" calls\ncalls: %json {_schema_text(array)}\n'
    if tool_plan.syntax is HERMES:
        repeat = ' ("\\n" tagged)*' if tool_plan.parallel else ""
        return (f'start: tagged{repeat}\ntagged: "<tool_call>\\n" call "\\n</tool_call>"\n'
                f"call: %json {_schema_text(call)}\n")
    return f"start: call\ncall: %json {_schema_text(call)}\n"


def _schema_text(schema: JsonObject) -> str:
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS})


@dataclass(frozen=True)
class ToolCall:
    """One call read out of a reply."""

    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str


def parse(text: str, tool_plan: ToolPlan) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply: the calls in the plan's syntax that name one of its functions with object
    arguments, and the text around them; all text and no calls when there are none (or tool_choice is none)."""
    if not tool_plan.returns_calls:
        return text, []
    syntax = tool_plan.syntax
    if syntax is HERMES:
        found = [_json_prefix(match.group(1)) for match in _HERMES_CALL.finditer(text)]
        if len(found) > 1 and found[-1] is None and not text.rstrip().endswith("</tool_call>"):
            found.pop()  # a last call cut off by max_tokens: the whole ones before it stand
        rest = _HERMES_CALL.sub("", text) if found else text
    elif syntax is MISTRAL:
        before, marker, after = text.partition("[TOOL_CALLS]")
        if not marker and text.lstrip().startswith("[{"):  # a tokenizer whose [TOOL_CALLS] is a special token
            before, marker, after = "", "[TOOL_CALLS]", text  # decodes without it
        found, rest = (_json_items(after) if marker else [None]), before
    else:
        body = text.strip().removeprefix("<|python_tag|>")
        found, rest = [_json_prefix(body)], ""
    calls = [_call(item, syntax) for item in found]
    if not calls or None in calls or not all(call.name in tool_plan.functions for call in calls):
        return text, []
    return rest.strip(), calls


def _json_prefix(text: str) -> Any:
    """The JSON value `text` starts with (after whitespace), or None."""
    try:
        return json.JSONDecoder().raw_decode(text.lstrip())[0]
    except json.JSONDecodeError:
        return None


def _json_items(text: str) -> list[Any]:
    """The whole items of the JSON array `text` starts with (or its one object), even if max_tokens cut the
    array off after them; [None] if there is no whole item."""
    decoder, text, items = json.JSONDecoder(), text.lstrip(), []
    if not text.startswith("["):
        return [_json_prefix(text)]
    position = 1
    while True:
        position = len(text) - len(text[position:].lstrip(", \n\t"))
        if position >= len(text) or text[position] == "]":
            return items or [None]
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return items or [None]
        items.append(item)


def _call(item: Any, syntax: ToolSyntax) -> ToolCall | None:
    """A call from its parsed JSON, or None if it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(syntax.arguments_key, item.get("arguments", item.get("parameters")))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False), syntax.call_id())


def message(content: str, calls: Sequence[ToolCall]) -> JsonObject:
    """A whole response's assistant message: its text, and its calls in OpenAI's shape."""
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls]}


def delta_calls(calls: Sequence[ToolCall]) -> JsonObject:
    """A stream chunk's delta carrying `calls` whole, each with its index, as the openai client assembles them."""
    return {"tool_calls": [{"index": i, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}
                           for i, call in enumerate(calls)]}


def finish_reason(reason: str | None, calls: Sequence[ToolCall]) -> str | None:
    """OpenAI's finish reason: "tool_calls" for a reply that ended on its calls."""
    return "tool_calls" if calls and reason == "stop" else reason
