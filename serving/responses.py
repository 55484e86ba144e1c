"""OpenAI's Responses API (`POST /v1/responses`) as `ember serve` speaks it.

A request is read into the `ChatRequest` that /v1/chat/completions builds (`chat_request`): `instructions` as a
system message, `input` items as chat messages (a `function_call` as an assistant's tool call, its
`function_call_output` as a tool message), `tools` in chat's shape, `text.format` as `response_format`,
`max_output_tokens` as `max_tokens`; the server renders, constrains and generates it as it does a chat. The answer
is a Response object, or its typed event stream (`ResponsesReply`), whose output items (a message, function calls)
come from the same `CallReader` that reads chat's tool calls, so a streamed reply put together equals the whole one.

Stateless: nothing is stored, whatever `store` says; `previous_response_id` and `conversation` are refused, and the
client sends the whole conversation in `input` each time (as the Agents SDK does unless told otherwise).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from ember.serving import bounded_json, tool_calls
from ember.serving.protocol import (
    ApiError,
    ApiModel,
    ChatRequest,
    FieldNames,
    JsonObject,
    Message,
    merge,
    sse,
    tool_errors,
)
from ember.serving.scheduler import StreamEvent

# What the Responses API calls the chat fields that errors name.
RESPONSES_FIELDS = FieldNames(prompt="input", max_tokens="max_output_tokens", response_format="text.format")


class TextContent(ApiModel):
    """A text part of an input message (`input_text`) or of an assistant's earlier output (`output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(ApiModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]


class FunctionCallItem(ApiModel):
    """A call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(ApiModel):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextContent]


def _item_type(item: Any) -> Any:
    """The tag of an input item: its `type`, `message` when it has none (the easy form `{"role", "content"}`)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                      Discriminator(_item_type, custom_error_type="invalid_item", custom_error_message=(
                          "must be a message, function_call or function_call_output item"))]


class FunctionTool(ApiModel):
    """A function the model may call, in the Responses API's shape (chat's nests these under `function`)."""

    type: Literal["function"]
    name: Any  # checked by tool_calls.function_tools, as chat's are
    description: Any = None
    parameters: Any = None
    strict: bool | None = None


class NamedFunction(ApiModel):
    type: Literal["function"]
    name: str


class PlainText(ApiModel):
    type: Literal["text"]


class JsonObjectFormat(ApiModel):
    type: Literal["json_object"]


class JsonSchemaFormat(ApiModel):
    type: Literal["json_schema"]
    name: str
    json_schema: JsonObject = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(ApiModel):
    format: Annotated[PlainText | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")] | None = None


class ResponsesRequest(ApiModel):
    """The body of POST /v1/responses."""

    model: str
    input: Annotated[list[InputItem], Field(min_length=1)] | str
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool = False
    store: bool | None = None  # nothing is stored either way
    previous_response_id: str | None = None  # refused: nothing is stored
    conversation: Any = None  # refused: nothing is stored
    metadata: dict[str, str] | None = None


def chat_request(request: ResponsesRequest) -> ChatRequest:
    """The chat request a Responses request asks for, or the `ApiError` naming the field ember cannot use."""
    for stateful in ("previous_response_id", "conversation"):
        if getattr(request, stateful) is not None:
            raise ApiError(400, f"{stateful}: ember keeps no responses (it is stateless): send the whole conversation "
                                "in input", param=stateful, code="unsupported_value")
    tools = None
    if request.tools:
        with tool_errors():
            tools = tool_calls.function_tools(
                [(tool.name, tool.description, tool.parameters) for tool in request.tools], "tools.{index}")
    tool_choice = request.tool_choice
    # `text.format` shapes the reply's text; a reply that tool_choice makes a call has none, so it is not applied
    # then (chat refuses the two together; the Agents SDK sends its output type's format with every turn).
    forced = bool(tools) and (tool_choice == "required" or isinstance(tool_choice, NamedFunction))
    messages = ([Message(role="system", content=request.instructions)] if request.instructions else []) + \
        _messages(request.input)
    return ChatRequest.model_validate({
        "model": request.model, "messages": messages, "max_tokens": request.max_output_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p, "stream": request.stream,
        "response_format": None if forced else _response_format(request.text), "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": tool_choice.name}}
        if isinstance(tool_choice, NamedFunction) else tool_choice,
        "parallel_tool_calls": request.parallel_tool_calls, "truncation": request.truncation or "disabled"})


def _response_format(text: TextOptions | None) -> JsonObject | None:
    """Chat's `response_format` of a `text.format`."""
    spec = text.format if text is not None else None
    if isinstance(spec, JsonSchemaFormat):
        return {"type": "json_schema", "json_schema": {"name": spec.name, "schema": spec.json_schema}}
    if isinstance(spec, JsonObjectFormat):
        return {"type": "json_object"}
    return None


def _messages(given: str | list[Any]) -> list[Message]:
    """Chat messages of `input`: a text is one user message; calls join the assistant message they follow."""
    if isinstance(given, str):
        return [Message(role="user", content=given)]
    messages: list[Message] = []
    for index, item in enumerate(given):
        if isinstance(item, MessageItem):
            messages.append(Message(role=item.role, content=_text(item.content)))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(Message(role="tool", content=_text(item.output), tool_call_id=item.call_id))
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item.arguments, index)}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(Message(role="assistant", content=None, tool_calls=[call]))
    return messages


def _text(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _arguments(text: str, index: int) -> JsonObject:
    """A call's arguments, a JSON object's text, as the object (chat templates write them out again)."""
    try:
        arguments = bounded_json.loads(text)
    except bounded_json.JsonLimitError as err:
        raise ApiError(400, f"input.{index}.arguments {err}", param="input", code="invalid_value") from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"input.{index}.arguments: must be a JSON object", param="input", code="invalid_value")
    return arguments


class ResponsesReply:
    """A Response object and its event stream, built from a request's events: the reply's text and calls as a
    `CallReader` reads them (or its text alone, without tools) become output items, each opened, written and closed
    by typed events, each event numbered by `sequence_number`. The whole reply is the stream's last Response."""

    def __init__(self, request: ResponsesRequest, model: str, tools: tool_calls.ToolPlan | None) -> None:
        self.request = request
        self.model = model
        self.stream = request.stream
        self.reader = tool_calls.CallReader(tools) if tools is not None and tools.returns_calls else None
        self.ident = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.output: list[JsonObject] = []
        self.writing: JsonObject | None = None  # the output item being written, the last of `output`
        self.sequence = 0
        self.status = "in_progress"
        self.usage: JsonObject | None = None

    def whole(self, events: Sequence[StreamEvent]) -> JsonObject:
        """The Response of an unstreamed request."""
        self.feed(merge(events))
        return self.response()

    def opening(self) -> list[str]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, event: StreamEvent) -> list[str]:
        """The events one of the scheduler's events makes; after its last, the closing items and the Response."""
        read: list[tool_calls.CallEvent] = [tool_calls.Content(event.text)]
        reason = event.finish_reason
        if self.reader is not None:
            read, reason = self.reader.read(event.text, reason)
        sent = [text for piece in read for text in self._read(piece)]
        if reason is None:
            return sent
        if not self.output:  # a reply of nothing is one empty message
            sent += self._open_message()
        incomplete = reason == "length"
        sent += self._close(incomplete)
        self.status = "incomplete" if incomplete else "completed"
        cached = event.cached_tokens
        self.usage = {"input_tokens": event.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                      "output_tokens": event.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": event.prompt_tokens + event.completion_tokens}
        return [*sent, self._event(f"response.{self.status}", response=self.response())]

    def failure(self, error: ApiError) -> list[str]:
        """OpenAI's `error` event, then the Response failed."""
        self.status = "failed"
        return [self._event("error", code=error.code or error.kind, message=error.message, param=error.param),
                self._event("response.failed", response=self.response(error))]

    def closing(self) -> list[str]:
        return []

    def response(self, error: ApiError | None = None) -> JsonObject:
        """The Response object as it stands."""
        request = self.request
        tool_choice = request.tool_choice.model_dump() if isinstance(request.tool_choice, NamedFunction) \
            else request.tool_choice or "auto"
        return {
            "id": self.ident, "object": "response", "created_at": self.created, "status": self.status,
            "model": self.model, "output": self.output,
            "error": None if error is None else {"code": "server_error", "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "tool_choice": tool_choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "text": {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)
                     if request.text is not None and request.text.format is not None else {"type": "text"}},
            "truncation": request.truncation or "disabled", "usage": self.usage, "metadata": request.metadata or {}}

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(data, kind)

    def _read(self, piece: tool_calls.CallEvent) -> list[str]:
        """The events of one piece of the reply, as a `CallReader` read it."""
        item = self.writing
        if isinstance(piece, tool_calls.Content):
            if not piece.text:
                return []
            sent = [] if item is not None and item["type"] == "message" else [*self._close(), *self._open_message()]
            part = self.output[-1]["content"][0]
            part["text"] += piece.text
            return [*sent, self._event("response.output_text.delta", item_id=self.output[-1]["id"],
                                       output_index=len(self.output) - 1, content_index=0, delta=piece.text,
                                       logprobs=[])]
        if isinstance(piece, tool_calls.CallStart):
            call = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                    "call_id": piece.id, "name": piece.name, "arguments": ""}
            return [*self._close(), *self._open(call)]
        if isinstance(piece, tool_calls.Arguments) and item is not None:
            item["arguments"] += piece.text
            return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=len(self.output) - 1, delta=piece.text)]
        return self._close() if isinstance(piece, tool_calls.CallEnd) else []

    def _open(self, item: JsonObject) -> list[str]:
        self.output.append(item)
        self.writing = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item={**item, "content": []} if item["type"] == "message" else dict(item))]

    def _open_message(self) -> list[str]:
        message: JsonObject = {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress", "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        sent = self._open(message)
        return [*sent, self._event("response.content_part.added", item_id=message["id"],
                                   output_index=len(self.output) - 1, content_index=0,
                                   part={**message["content"][0]})]

    def _close(self, incomplete: bool = False) -> list[str]:
        """The events that end the item being written (`incomplete`: the reply was cut off in it)."""
        item, self.writing = self.writing, None
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = "incomplete" if incomplete else "completed"
        if item["type"] == "message":
            part = item["content"][0]
            sent = [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=dict(part))]
        else:
            sent = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"])]
        return [*sent, self._event("response.output_item.done", output_index=index, item=dict(item))]
