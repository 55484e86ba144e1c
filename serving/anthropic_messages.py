"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as `ember serve` speaks it.

A request is read into the `ChatRequest` that /v1/chat/completions builds (`chat_request`): `system` as a system
message, text blocks as message text, an assistant's `tool_use` blocks as its tool calls and a user's `tool_result`
blocks as tool messages, `tools` (`input_schema`) in chat's shape, `tool_choice` `auto`/`any`/`tool`/`none` as chat's
`auto`/`required`/a named function/`none`, `stop_sequences` as `stop`; the server renders, constrains and generates
it as it does a chat. The answer is a Message, or its event stream (`MessagesReply`), whose content blocks come
from the same `CallReader` that reads chat's tool calls. Errors have Anthropic's shape (`error_body`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import Field

from ember.serving import tool_calls
from ember.serving.protocol import (
    ApiError,
    ApiModel,
    ChatRequest,
    JsonObject,
    Message,
    merge,
    sse,
    tool_errors,
)
from ember.serving.scheduler import StreamEvent

# Anthropic's error type for each status ember answers with.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
               500: "api_error"}
# A reply's finish reason (chat's, tool calls read) as Anthropic's stop reason; "stop" is "stop_sequence" when one
# of the request's stop sequences ended it.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(error: ApiError) -> JsonObject:
    """The body of an error response in Anthropic's shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


class TextBlock(ApiModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(ApiModel):
    """A call the model made earlier, in an assistant message."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: JsonObject


class ToolResultBlock(ApiModel):
    """The result of a call, in a user message. Chat templates have no place for `is_error`: a failed call's result
    reaches the model as its tool message prefixed `ERROR_PREFIX`."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False


ERROR_PREFIX = "Error: "


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(ApiModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(ApiModel):
    """A function the model may call, in Anthropic's shape (a client tool; server tools have other types)."""

    type: Literal["custom"] | None = None
    name: Any  # checked by tool_calls.function_tools, as chat's are
    description: Any = None
    input_schema: Any


class AutoChoice(ApiModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class AnyChoice(ApiModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoice(ApiModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class NoChoice(ApiModel):
    type: Literal["none"]


class CountTokensRequest(ApiModel):
    """The body of POST /v1/messages/count_tokens: a conversation, without generation's fields."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: Annotated[AutoChoice | AnyChoice | ToolChoice | NoChoice, Field(discriminator="type")] | None = None


class MessagesRequest(CountTokensRequest):
    """The body of POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False


def chat_request(request: CountTokensRequest) -> ChatRequest:
    """The chat request a Messages (or count_tokens) request asks for, or the `ApiError` naming what is wrong."""
    tools = None
    if request.tools:
        with tool_errors():
            tools = tool_calls.function_tools(
                [(tool.name, tool.description, tool.input_schema) for tool in request.tools], "tools.{index}",
                "input_schema")
    choice = request.tool_choice
    system = [Message(role="system", content=_text(request.system))] if request.system else []
    sampling: dict[str, Any] = {}
    if isinstance(request, MessagesRequest):
        sampling = {"max_tokens": request.max_tokens, "stop": request.stop_sequences, "stream": request.stream,
                    "temperature": request.temperature, "top_p": request.top_p or 1.0, "top_k": request.top_k or 0}
    one_call = isinstance(choice, AutoChoice | AnyChoice | ToolChoice) and choice.disable_parallel_tool_use
    return ChatRequest.model_validate({"model": request.model, "messages": system + _messages(request.messages),
                                       "tools": tools, "tool_choice": _tool_choice(choice),
                                       "parallel_tool_calls": not one_call, **sampling})


def _tool_choice(choice: AutoChoice | AnyChoice | ToolChoice | NoChoice | None) -> str | JsonObject | None:
    """Chat's tool_choice of Anthropic's: `any` is `required`, `tool` a named function."""
    if isinstance(choice, ToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type] if choice is not None else None


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _messages(given: Sequence[InputMessage]) -> list[Message]:
    """Chat messages of Anthropic's: an assistant's text and calls in one message; a user's tool results each a tool
    message, in their place among its text."""
    messages: list[Message] = []
    for index, message in enumerate(given):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) \
            else message.content
        if message.role == "assistant":
            calls = [{"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
                     for block in blocks if isinstance(block, ToolUseBlock)]
            if any(isinstance(block, ToolResultBlock) for block in blocks):
                raise ApiError(400, f"messages.{index}.content: tool_result blocks belong in user messages",
                               param="messages", code="invalid_value")
            messages.append(Message(role="assistant", content="".join(block.text for block in blocks
                                                                      if isinstance(block, TextBlock)),
                                    tool_calls=calls or None))
            continue
        text: list[str] = []
        for block in blocks:
            if isinstance(block, ToolUseBlock):
                raise ApiError(400, f"messages.{index}.content: tool_use blocks belong in assistant messages",
                               param="messages", code="invalid_value")
            if isinstance(block, ToolResultBlock):
                if text:
                    messages.append(Message(role="user", content="".join(text)))
                    text = []
                content = ERROR_PREFIX * block.is_error + _text(block.content)
                messages.append(Message(role="tool", content=content, tool_call_id=block.tool_use_id))
            else:
                text.append(block.text)
        if text or not blocks:
            messages.append(Message(role="user", content="".join(text)))
    return messages


def call_input(arguments: str, complete: bool) -> JsonObject:
    """A `tool_use` block's `input`: the call's arguments parsed, partly when the reply was cut off in them (as the
    `anthropic` client parses a stream's partial JSON); arguments the model wrote that are no JSON object (nothing
    holds it to JSON under tool_choice auto) wrapped as Anthropic's docs suggest, `{"INVALID_JSON": text}`."""
    try:
        parsed = pydantic_core.from_json(arguments, allow_partial=not complete)
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"INVALID_JSON": arguments}


class MessagesReply:
    """A Message and its event stream, built from a request's events: the reply's text and calls as a `CallReader`
    reads them (or its text alone, without tools) become content blocks, each started, written and stopped by
    events. `decode` (the tokenizer's) finds which of `stop_sequences` ended a reply."""

    def __init__(self, request: MessagesRequest, model: str, tools: tool_calls.ToolPlan | None, prompt_tokens: int,
                 decode: Callable[[list[int]], str]) -> None:
        self.stream = request.stream
        self.model = model
        self.stop_sequences = request.stop_sequences or []
        self.reader = tool_calls.CallReader(tools) if tools is not None and tools.returns_calls else None
        self.prompt_tokens = prompt_tokens
        self.decode = decode
        self.ident = f"msg_{uuid.uuid4().hex}"
        self.content: list[JsonObject] = []
        self.arguments: list[str] = []  # each tool_use block's arguments as written, by block (text blocks: "")
        self.writing: JsonObject | None = None  # the block being written, the last of `content`
        self.text: list[str] = []  # the reply's text, calls included, and its tokens, to tell a stop sequence
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: JsonObject = {"input_tokens": prompt_tokens, "output_tokens": 0}

    def whole(self, events: Sequence[StreamEvent]) -> JsonObject:
        """The Message answering an unstreamed request."""
        self.feed(merge(events))
        return self.message()

    def message(self) -> JsonObject:
        """The Message as it stands."""
        return {"id": self.ident, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self.usage}

    def opening(self) -> list[str]:
        return [_event("message_start", message=self.message()), _event("ping")]

    def feed(self, event: StreamEvent) -> list[str]:
        """The events one of the scheduler's events makes; after its last, the stop reason and usage."""
        self.text.append(event.text)
        self.token_ids += event.token_ids
        read: list[tool_calls.CallEvent] = [tool_calls.Content(event.text)]
        reason = event.finish_reason
        if self.reader is not None:
            read, reason = self.reader.read(event.text, reason)
        sent = [text for piece in read for text in self._read(piece)]
        if reason is None:
            return sent
        sent += self._stop(complete=reason != "length")
        self.stop_reason = STOP_REASONS.get(reason, "end_turn")
        if reason == "stop":
            self.stop_sequence = self._stop_sequence()
            self.stop_reason = "end_turn" if self.stop_sequence is None else "stop_sequence"
        cached = event.cached_tokens
        self.usage = {"input_tokens": event.prompt_tokens - cached, "output_tokens": event.completion_tokens,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
        return [*sent, _event("message_delta", delta={"stop_reason": self.stop_reason,
                                                      "stop_sequence": self.stop_sequence}, usage=self.usage),
                _event("message_stop")]

    def failure(self, error: ApiError) -> list[str]:
        return [sse(error_body(error), "error")]

    def closing(self) -> list[str]:
        return []

    def _stop_sequence(self) -> str | None:
        """The stop sequence that ended the reply: the one its tokens' text holds where the text given out ends
        (the scheduler gives out the text before a stop string)."""
        given = "".join(self.text)
        generated = self.decode(self.token_ids)
        rest = generated[len(given):] if generated.startswith(given) else ""
        return next((stop for stop in self.stop_sequences if rest.startswith(stop)), None)

    def _read(self, piece: tool_calls.CallEvent) -> list[str]:
        """The events of one piece of the reply, as a `CallReader` read it."""
        block = self.writing
        if isinstance(piece, tool_calls.Content):
            if not piece.text:
                return []
            sent = [] if block is not None and block["type"] == "text" else \
                [*self._stop(), *self._start({"type": "text", "text": ""})]
            self.content[-1]["text"] += piece.text
            return [*sent, _event("content_block_delta", index=len(self.content) - 1,
                                  delta={"type": "text_delta", "text": piece.text})]
        if isinstance(piece, tool_calls.CallStart):
            return [*self._stop(), *self._start({"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})]
        if isinstance(piece, tool_calls.Arguments) and block is not None:
            self.arguments[-1] += piece.text
            return [_event("content_block_delta", index=len(self.content) - 1,
                           delta={"type": "input_json_delta", "partial_json": piece.text})]
        return self._stop() if isinstance(piece, tool_calls.CallEnd) else []

    def _start(self, block: JsonObject) -> list[str]:
        self.content.append(block)
        self.arguments.append("")
        self.writing = block
        return [_event("content_block_start", index=len(self.content) - 1, content_block=dict(block))]

    def _stop(self, complete: bool = True) -> list[str]:
        """The event that ends the block being written; a tool_use block gets its input (`complete`: False if the
        reply was cut off in it)."""
        block, self.writing = self.writing, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = call_input(self.arguments[-1], complete)
        return [_event("content_block_stop", index=len(self.content) - 1)]


def _event(kind: str, **fields: Any) -> str:
    return sse({"type": kind, **fields}, kind)
