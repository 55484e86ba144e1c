"""Tool calling (OpenAI's `tools`) as `ember serve` does it: pure functions, no HTTP, no model.

A model calls tools in the syntax its chat template teaches it; `detect_syntax` reads which from the
template's source: Llama 3.1/3.2 (a bare JSON object `{"name": ..., "parameters": {...}}`), Qwen2.5 and
Hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), Mistral (`[TOOL_CALLS][{"name": ...,
"arguments": {...}}]`). `plan` checks a request's tools and tool_choice against it; `call_grammar` is the
llguidance grammar that makes `required` or a named function certain (the reply is a call in that syntax
whose arguments match the function's JSON schema, then end of sequence); `CallReader` reads calls out of the
model's text as it comes, in any pieces (`parse`: out of a whole reply, the same way), and `message`, `delta`
shape them as OpenAI's responses and stream chunks do.

Every refusal is a `ToolRequestError` naming the request field at fault.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from ember.core.errors import GenerationError
from ember.serving import bounded_json
from ember.serving.constrained import JSON_OPTIONS  # fixed whitespace, as for response_format

JsonObject = dict[str, Any]
_ALPHANUMERIC = string.ascii_letters + string.digits


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
    template_tools = function_tools([_function(tool, index) for index, tool in enumerate(tools)],
                                    "tools.{index}.function")
    functions = {tool["function"]["name"]: tool["function"]["parameters"] for tool in template_tools}
    choice, forced = _choice(tool_choice, functions)
    # A named function is one call (as vLLM makes it): a weak model held to "one or more" may never stop.
    parallel = parallel_tool_calls and syntax.parallel and forced is None
    return ToolPlan(syntax, functions, template_tools, choice, forced, parallel)


def _function(tool: Any, index: int) -> tuple[Any, Any, Any]:
    """(name, description, parameters) of `tools[index]`, in OpenAI's chat shape."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolRequestError(f"tools.{index}: must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
    function = tool["function"]
    return function.get("name"), function.get("description"), function.get("parameters")


def function_tools(functions: Sequence[tuple[Any, Any, Any]], where: str,
                   parameters_key: str = "parameters") -> list[JsonObject]:
    """Tools as chat templates get them (OpenAI's chat shape) from the (name, description, parameters schema) of
    each tool a request offers, in whichever API's shape it came: `where` is the path of tool `{index}` in that
    request and `parameters_key` its schema's field, for the `ToolRequestError` naming what is wrong. A tool
    without parameters takes none."""
    template_tools: list[JsonObject] = []
    names: set[str] = set()
    for index, (name, description, parameters) in enumerate(functions):
        place = where.format(index=index)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolRequestError(f"{place}.name: must be 1 to 64 letters, digits, '_', '.' or '-', got {name!r}",
                                   "tools")
        if name in names:
            raise ToolRequestError(f"{place}.name: {name!r} is given twice", "tools")
        if description is not None and not isinstance(description, str):
            raise ToolRequestError(f"{place}.description: must be a string", "tools")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ToolRequestError(f"{place}.{parameters_key}: must be a JSON schema of an object", "tools")
        names.add(name)
        template_tools.append({"type": "function", "function": {
            "name": name, **({"description": description} if description is not None else {}),
            "parameters": parameters}})
    return template_tools


def _choice(tool_choice: Any, functions: dict[str, JsonObject]) -> tuple[str, str | None]:
    """(choice, forced function name) of a request's tool_choice."""
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("auto", "none", "required"):
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
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
            arguments = bounded_json.loads(arguments)
        except bounded_json.JsonLimitError as err:
            raise ToolRequestError(f"{where}.function.arguments {err}", "messages") from None
    if not isinstance(arguments, dict):
        raise ToolRequestError(f"{where}.function.arguments: must be a JSON object", "messages")
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def call_grammar(tool_plan: ToolPlan) -> str:
    """The llguidance (Lark) grammar of a reply that is only calls: one (or, with parallel calls, one or more)
    in the plan's syntax, each naming an allowed function with arguments its schema accepts."""
    names = [tool_plan.forced] if tool_plan.forced else list(tool_plan.functions)
    key = tool_plan.syntax.arguments_key
    # Each function's schema under the root's $defs, its own references (`#/$defs/Place`, as pydantic writes
    # them) redirected there: a reference resolves against the root of the schema llguidance compiles.
    parameters = {f"function_{index}": _rooted(tool_plan.functions[name], f"#/$defs/function_{index}")
                  for index, name in enumerate(names)}
    calls = [{"type": "object", "properties": {"name": {"const": name}, key: {"$ref": f"#/$defs/function_{index}"}},
              "required": ["name", key], "additionalProperties": False} for index, name in enumerate(names)]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if tool_plan.syntax is MISTRAL:
        array = {"type": "array", "items": call, "minItems": 1, **({} if tool_plan.parallel else {"maxItems": 1})}
        return f'start: "[TOOL_CALLS]" calls\ncalls: %json {_schema_text(array, parameters)}\n'
    if tool_plan.syntax is HERMES:
        repeat = ' ("\\n" tagged)*' if tool_plan.parallel else ""
        return (f'start: tagged{repeat}\ntagged: "<tool_call>\\n" call "\\n</tool_call>"\n'
                f"call: %json {_schema_text(call, parameters)}\n")
    return f"start: call\ncall: %json {_schema_text(call, parameters)}\n"


def _rooted(schema: Any, pointer: str) -> Any:
    """`schema` with each of its local references (`#...`) pointing into `pointer`, where it is placed."""
    if isinstance(schema, dict):
        return {key: pointer + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                else _rooted(value, pointer) for key, value in schema.items()}
    if isinstance(schema, list):
        return [_rooted(value, pointer) for value in schema]
    return schema


def _schema_text(schema: JsonObject, definitions: JsonObject) -> str:
    return json.dumps({**schema, "$defs": definitions, "x-guidance": JSON_OPTIONS})


@dataclass(frozen=True)
class ToolCall:
    """One call read out of a reply."""

    name: str
    arguments: str  # the model's JSON text of the arguments, as OpenAI sends it
    id: str
    complete: bool = True  # False for a call the reply ended in (max_tokens): its arguments are cut off


@dataclass(frozen=True)
class Content:
    """Text of the reply that is not a call."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A call begins: its name is read and its arguments object has begun."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    """The next piece of a call's arguments, as the model wrote it: the pieces join into its JSON text."""

    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    """A call's arguments object is closed."""

    index: int


CallEvent = Content | CallStart | Arguments | CallEnd
_WHITESPACE = " \t\n\r"
_HERMES_CLOSE = "</tool_call>"


class _ObjectScanner:
    """One JSON object read a character at a time: its top-level keys and where each one's value lies. It
    checks the object's own punctuation, not the values inside it (a nested value is only balanced)."""

    def __init__(self) -> None:
        self.chars = ["{"]  # what was read, a list: a string grown a character at a time is quadratic
        self.state = "key_or_end"  # the scanner starts past the opening brace, which `text` holds
        self.depth = 0  # nesting inside an object or array value
        self.in_string = self.escape = False
        self.key: str | None = None
        self.key_start = self.value_start = 0
        self.values: dict[str, tuple[int, int]] = {}  # key -> span of its first value, once it ends

    def __len__(self) -> int:
        return len(self.chars)

    def text(self, start: int = 0, end: int | None = None) -> str:
        """The characters read from `start` to `end`."""
        return "".join(self.chars[start:end])

    @property
    def closed(self) -> bool:
        """Whether the object's closing brace was read."""
        return self.state == "closed"

    def value_just_began(self) -> bool:
        """Whether the last character read began the value of `key`."""
        return self.state in ("string", "nested", "scalar") and self.value_start == len(self.chars) - 1

    def push(self, char: str) -> bool:
        """Read one more character; False (and not read) if it cannot continue a JSON object."""
        position = len(self.chars)
        self.chars.append(char)
        if not self._step(char, position):
            self.chars.pop()
            return False
        return True

    def _step(self, char: str, position: int) -> bool:
        state = self.state
        if state in ("key", "string") or (state == "nested" and self.in_string):
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                return self._string_ended(position)
            return True
        if state == "nested":
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self._value_ended(position + 1)
            return True
        if state == "scalar":
            if char not in _WHITESPACE + ",}":
                return True
            self._value_ended(position)
            state = "after"
        if char in _WHITESPACE:
            return state != "closed"
        return self._punctuation(state, char, position)

    def _punctuation(self, state: str, char: str, position: int) -> bool:
        if state == "key_or_end" and char == '"':
            self.state, self.key_start = "key", position
        elif state in ("key_or_end", "after") and char == "}":
            self.state = "closed"
        elif state == "after" and char == ",":
            self.state = "key_or_end"
        elif state == "colon" and char == ":":
            self.state = "value"
        elif state == "value" and char in '"{[-0123456789tfn':
            self.value_start = position
            self.state = {'"': "string", "{": "nested", "[": "nested"}.get(char, "scalar")
            self.depth = 1 if char in "{[" else 0
        else:
            return False
        return True

    def _string_ended(self, position: int) -> bool:
        if self.state == "nested":
            self.in_string = False
        elif self.state == "string":
            self._value_ended(position + 1)
        else:
            try:
                self.key = json.loads(self.text(self.key_start, position + 1))
            except json.JSONDecodeError:
                return False
            self.state = "colon"
        return True

    def _value_ended(self, end: int) -> None:
        self.values.setdefault(self.key or "", (self.value_start, end))
        self.state = "after"


class CallReader:
    """Reads a reply's calls as its text comes, in any pieces, into `CallEvent`s: content as soon as it cannot
    be the start of a call (trailing whitespace and a possible opener such as `<tool_` are held back), a call's
    start once its name is read and its arguments object begins, its arguments piece by piece as written.

    Text that turns out not to be a call (an unknown name, arguments that are not an object, broken syntax) is
    released as content. Whitespace just before a call, and at the end of a reply with calls, is dropped; after a
    call, what is left of its syntax is dropped (to `</tool_call>`; to the end for Llama 3.x and Mistral, whose
    calls end the reply). A call the reply ends in stays, incomplete; a call syntax begun but not yet read to a
    call when the reply ends is released as content if the reply has no calls, else dropped."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self.plan = tool_plan
        self.syntax = tool_plan.syntax
        self.mode = "text" if tool_plan.returns_calls else "pass"
        self.held = ""  # text mode: whitespace and a possible opener, not yet content
        self.at_start = True  # nothing but whitespace read yet
        self.region = ""  # the text of the call syntax being read, released if it turns out not to be a call
        self.region_calls = 0
        self.in_array = False  # the region is Mistral's array of calls
        self.scanner = _ObjectScanner()  # the JSON object being read (mode "object"), a new one per object
        self.name: str | None = None
        self.arguments_key: str | None = None
        self.sent = 0  # characters of the scanner's text sent as arguments
        self.began = False  # the object being read began a call
        self.tail = ""  # the last characters read while looking for </tool_call>
        self.calls: list[ToolCall] = []
        self.contents: list[str] = []  # all the content read so far, in pieces
        self.content_since_call = False  # text other than whitespace released as content since the last call began
        self.open = False  # a call has begun and its arguments are not closed
        self.events: list[CallEvent] = []

    @property
    def content(self) -> str:
        """All the content read so far."""
        return "".join(self.contents)

    def feed(self, text: str) -> list[CallEvent]:
        """The events `text`, the next piece of the reply, makes."""
        for position, char in enumerate(text):
            if self.mode == "pass":  # no call can follow: the rest is content
                self._content(text[position:])
                break
            self._read(char)
        self._send_arguments()
        return self._take()

    def finish(self) -> list[CallEvent]:
        """The events the end of the reply makes (held text released or dropped; an open call left incomplete)."""
        if self.open:
            self.calls[-1] = ToolCall(self.calls[-1].name, self.calls[-1].arguments, self.calls[-1].id, False)
        elif self.mode == "text" and not self.calls:
            self._content(self.held)
        elif self.mode in ("object", "before_object", "after_marker", "array") and not self.calls:
            self._content(self._region_text())
        self.mode, self.held = "done", ""
        return self._take()

    def read(self, text: str, reason: str | None) -> tuple[list[CallEvent], str | None]:
        """The events of one stream event's `text`, and its finish reason (`finish_reason`'s): the reply's last
        event, whose `reason` is set, also finishes the reading."""
        if reason is None:
            return self.feed(text), None
        return self.feed(text) + self.finish(), self.finish_reason(reason)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason of the reply read (after `finish`): "tool_calls" if it ended on whole calls. A reply
        cut by max_tokens after whole calls, in the syntax of another call not yet named (dropped), ended on whole
        calls too: a weak model held to "one or more calls" may write calls until its token budget runs out."""
        whole = bool(self.calls) and all(call.complete for call in self.calls)
        if reason == "length" and whole and not self.content_since_call:
            return "tool_calls"
        return finish_reason(reason, self.calls)

    def _take(self) -> list[CallEvent]:
        """The events made since the last take, neighbouring content and pieces of one call's arguments joined."""
        taken: list[CallEvent] = []
        for (kind, index), group in groupby(self.events, lambda event: (type(event), getattr(event, "index", 0))):
            if kind is Content:
                taken.append(Content("".join(event.text for event in group if isinstance(event, Content))))
            elif kind is Arguments:
                taken.append(Arguments(index, "".join(event.text for event in group if isinstance(event, Arguments))))
            else:
                taken.extend(group)
        self.events = []
        return taken

    def _content(self, text: str) -> None:
        if not text:
            return
        self.at_start = False
        self.contents.append(text)
        self.events.append(Content(text))
        self.content_since_call = self.content_since_call or bool(text.strip())

    def _read(self, char: str) -> None:
        mode = self.mode
        if mode == "pass":
            self._content(char)
        elif mode == "text":
            self._read_text(char)
        elif mode == "before_object":
            self._read_before(char, "{")
        elif mode == "after_marker":
            self._read_before(char, "[{")
        elif mode == "array":
            self._read_array(char)
        elif mode == "object":
            self._read_object(char)
        elif mode == "to_close":
            self.tail = (self.tail + char)[-len(_HERMES_CLOSE):]
            if self.tail == _HERMES_CLOSE:
                self.mode, self.tail = "text", ""

    def _openers(self, at_start: bool) -> tuple[str, ...]:
        if self.syntax is HERMES:
            return ("<tool_call>",)
        if self.syntax is MISTRAL:  # "[{": a tokenizer whose [TOOL_CALLS] is a special token decodes without it
            return ("[TOOL_CALLS]", "[{") if at_start else ("[TOOL_CALLS]",)
        return ("<|python_tag|>", "{") if at_start else ()  # Llama 3.x: a call is the whole reply

    def _read_text(self, char: str) -> None:
        candidate = self.held + char
        for cut in range(len(candidate) + 1):
            rest = candidate[cut:]
            opener = rest.lstrip(_WHITESPACE)
            if any(known.startswith(opener) for known in self._openers(self.at_start and cut == 0)):
                break
        self._content(candidate[:cut])
        if self.syntax is LLAMA3 and not self.at_start:
            self._content(rest)
            self.mode, self.held = "pass", ""
        elif opener in self._openers(self.at_start):
            self.held, self.at_start = "", False
            self._begin_region(rest[:len(rest) - len(opener)], opener)
        else:
            self.held = rest

    def _begin_region(self, space: str, opener: str) -> None:
        self.region, self.region_calls, self.in_array = space, 0, opener == "[{"
        if opener == "{":
            self.mode = "before_object"
            self._read("{")
        elif opener == "[{":
            self.region += "["
            self.mode = "array"
            self._read("{")
        else:
            self.region += opener
            self.mode = "after_marker" if opener == "[TOOL_CALLS]" else "before_object"

    def _read_before(self, char: str, openings: str) -> None:
        if char in _WHITESPACE:
            self.region += char
        elif char == "[" and "[" in openings:
            self.region += char
            self.mode, self.in_array = "array", True
        elif char == "{":
            self._begin_object()
        else:
            self._fail(char)

    def _read_array(self, char: str) -> None:
        if char in _WHITESPACE + ",":
            self.region += char
        elif char == "{":
            self._begin_object()
        elif char == "]" and self.region_calls:
            self.mode = "done"
        else:
            self._fail(char)

    def _begin_object(self) -> None:
        self.scanner, self.name, self.arguments_key, self.sent, self.began = _ObjectScanner(), None, None, 0, False
        self.mode = "object"

    def _read_object(self, char: str) -> None:
        scanner = self.scanner
        if not scanner.push(char):
            self._fail(char)
            return
        if not self.began:
            if scanner.value_just_began() and scanner.key in ("name", self.syntax.arguments_key, "arguments",
                                                               "parameters"):
                if scanner.key == "name" and char != '"' or scanner.key != "name" and char != "{":
                    self._fail(None)
                    return
                if scanner.key != "name" and self.arguments_key is None:
                    self.arguments_key = scanner.key
            if self.name is None and "name" in scanner.values:
                start, end = scanner.values["name"]
                name = json.loads(scanner.text(start, end))
                if name not in self.plan.functions:
                    self._fail(None)
                    return
                self.name = name
            if self.name is not None and self.arguments_key is not None:
                self._start_call(self.name, self.arguments_key)
        if self.open and self.arguments_key in scanner.values:
            self._send_arguments()
            self.events.append(CallEnd(len(self.calls) - 1))
            self.open = False
        if scanner.closed:
            if not self.began:
                self._fail(None)
            else:
                self.mode = "to_close" if self.syntax is HERMES else "array" if self.in_array else "done"

    def _start_call(self, name: str, arguments_key: str) -> None:
        call = ToolCall(name, "", self.syntax.call_id())
        self.content_since_call = False
        self.calls.append(call)
        self.region_calls += 1
        self.events.append(CallStart(len(self.calls) - 1, call.id, call.name))
        self.open = self.began = True
        self.sent = self.scanner.values.get(arguments_key, (self.scanner.value_start, 0))[0]
        self._send_arguments()

    def _send_arguments(self) -> None:
        if not self.open:
            return
        scanner, key = self.scanner, self.arguments_key
        end = scanner.values[key][1] if key in scanner.values else len(scanner)
        piece, self.sent = scanner.text(self.sent, end), end
        if not piece:
            return
        call = self.calls[-1]
        self.calls[-1] = ToolCall(call.name, call.arguments + piece, call.id)
        self.events.append(Arguments(len(self.calls) - 1, piece))

    def _region_text(self) -> str:
        return self.region + (self.scanner.text() if self.mode == "object" else "")

    def _fail(self, char: str | None) -> None:
        """The syntax being read is not a call: released as content, or dropped after calls it held."""
        if self.region_calls:
            self.mode = "to_close" if self.syntax is HERMES else "done"
            return
        self._content(self._region_text())
        self.mode = "pass" if self.syntax is LLAMA3 else "text"
        self.region = ""
        if char is not None:
            self._read(char)


def read(text: str, tool_plan: ToolPlan) -> CallReader:
    """A reader that has read the whole reply `text` (its events taken)."""
    reader = CallReader(tool_plan)
    reader.feed(text)
    reader.finish()
    return reader


def parse(text: str, tool_plan: ToolPlan) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply, as `CallReader` streams them: the content's pieces joined, each call's
    arguments its pieces joined."""
    reader = read(text, tool_plan)
    return reader.content, reader.calls


def message(content: str, calls: Sequence[ToolCall]) -> JsonObject:
    """A whole response's assistant message: its text, and its calls in OpenAI's shape."""
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls]}


def delta(event: CallEvent) -> JsonObject | None:
    """The stream chunk delta of one reader event, as OpenAI streams calls (None for a call's end, which has
    none): a call's first chunk has its index, id, type, name and empty arguments, the next only its index and
    the next piece of its arguments."""
    if isinstance(event, Content):
        return {"content": event.text}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    if isinstance(event, Arguments):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return None


def finish_reason(reason: str | None, calls: Sequence[ToolCall]) -> str | None:
    """OpenAI's finish reason: "tool_calls" for a reply that ended on its calls, all whole (a call cut off by
    max_tokens leaves "length")."""
    return "tool_calls" if calls and reason == "stop" and all(call.complete for call in calls) else reason
