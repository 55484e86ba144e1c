"""The OpenAI API as `ember serve` speaks it: request bodies and their checks, the sampling parameters they
ask for, and the responses and stream chunks built from a request's events; and what the other APIs' modules
(`responses.py`, `anthropic_messages.py`, `utilities.py`) build on: `ApiModel` for request bodies, the `ChatRequest`
they map onto, `FieldNames` for errors in their own fields' names, `ReplyShape` for their answers.

No HTTP and no event loop here: `serving/server.py` routes requests through these functions, and
tests/test_protocol.py checks them alone against the official `openai` package's types. Every refusal is
an `ApiError` in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`. Needs pydantic (which
FastAPI brings, the `serve` extra); only the server and those modules import this one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, TypeVar, cast

import numpy as np

from ember.core.errors import EmberError, GenerationError
from ember.runtime.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED, SamplingParams, TokenLogprob
from ember.serving import bounded_json, tool_calls
from ember.serving.scheduler import QueueFullError, StreamEvent

try:
    from pydantic import BaseModel, ConfigDict, Field, ValidationError
except ImportError as err:
    raise EmberError(f"ember serve needs FastAPI and uvicorn ({err.name} is missing): "
                     "pip install 'ember[serve]'") from None

JsonObject = dict[str, Any]  # a JSON object: its values are whatever JSON holds
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}  # pydantic's names of union branches in error locations
# What a request's failure never swallows: the process being stopped, and asyncio's and generators' own
# control flow. Anything else, a Rust panic from tokenizers (a BaseException) included, fails one request.
NEVER_CAUGHT = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)
MAX_CHOICES = 16  # `n`, as llama-server bounds it; the artifact's --max-batch may bound it lower
MAX_EMBEDDING_INPUTS = 2048  # inputs in one /v1/embeddings request, OpenAI's limit
MAX_PROMPTS = 64  # prompts in one /v1/completions request: each is a request of the scheduler's queue
MAX_LORA_SCALE = 10.0  # a request's adapter scale, either sign: beyond it an adapter swamps the model it adapts


class ApiError(Exception):
    """A request answered with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> JsonObject:
        """The JSON body of the response."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def internal_error(err: BaseException) -> ApiError:
    """The 500 answering a bug: its type only, never its text or a traceback."""
    return ApiError(500, f"internal error: {type(err).__name__}", kind="server_error")


def request_error(err: BaseException, param: str | None = None) -> ApiError:
    """The answer to a request whose tokenizing, templating or queueing raised `err`: 429 when the queue is
    full, 400 naming `param` for a `GenerationError` (the input's fault), 500 for anything else (a bug)."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, QueueFullError):
        return ApiError(429, str(err), code="queue_full", kind="rate_limit_exceeded")
    if isinstance(err, GenerationError):
        return ApiError(400, str(err), param=param, code="invalid_value")
    return internal_error(err)


def generation_error(err: BaseException) -> ApiError:
    """The answer to a request whose generation failed after it was queued: a 500, whose message is the
    error's own line when it is an `EmberError`."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, EmberError):
        return ApiError(500, str(err), kind="server_error")
    return internal_error(err)


@dataclass(frozen=True)
class FieldNames:
    """What the API a chat came through calls the fields that errors about it name: the same chat is generated
    for /v1/chat/completions, /v1/responses (whose conversation is `input`, its limit `max_output_tokens`, its
    JSON format `text.format`) and /v1/messages."""

    prompt: str = "messages"
    max_tokens: str = "max_tokens"
    response_format: str = "response_format"


CHAT_FIELDS = FieldNames()
COMPLETION_FIELDS = FieldNames(prompt="prompt")


class ApiModel(BaseModel):
    """A request body or a part of one: JSON's types as they are (strict), numbers finite, unknown fields ignored."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(ApiModel):
    include_usage: bool = False


class LoraScale(ApiModel):
    """One entry of llama-server's per-request `lora` list: an adapter by its id (`GET /lora-adapters`) and scale."""

    id: int = Field(ge=0)
    scale: float = Field(1.0, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)


class SamplingFields(ApiModel):
    """Fields common to both completion endpoints, with OpenAI's ranges."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # an extension, as in vLLM
    repetition_penalty: float = Field(1.0, gt=0, le=10)  # an extension, as in vLLM
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=-MAX_SEED, lt=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: JsonObject | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    lora: list[LoraScale] | None = None  # an extension, as in llama-server: the adapter and its scale

    def token_limit(self) -> int | None:
        """The most tokens to generate, if the request set it."""
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """How many likeliest tokens to report beside each one's logprob; None: no logprobs."""
        return None

    def wants_usage(self) -> bool:
        """Whether a stream ends with a chunk of token counts."""
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(ApiModel):
    type: Literal["text"]
    text: str


class Message(ApiModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[JsonObject] | None = None  # an assistant's calls, checked by tool_calls.template_message
    tool_call_id: str | None = None  # the call a tool message answers


class ChatRequest(SamplingFields):
    """The body of POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None  # checked by tool_calls.plan against the chat template
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # OpenAI's older form of tools: refused, naming the newer
    # As in OpenAI's Responses API: "auto" drops the earliest turns to fit the context window (runtime/history.py)
    truncation: Literal["auto", "disabled"] = "disabled"

    def token_limit(self) -> int | None:
        """The most tokens to generate: max_completion_tokens, or the older max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        """How many likeliest tokens to report beside each one's logprob; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    """The body of POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # each choice's text starts with its prompt's
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: None = None

    def logprob_count(self) -> int | None:
        """How many likeliest tokens to report beside each one's logprob; None: no logprobs."""
        return self.logprobs


class EmbeddingRequest(ApiModel):
    """The body of POST /v1/embeddings."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None  # the model's hidden size only: no truncated (Matryoshka) vectors


Request = TypeVar("Request", bound=ApiModel)


def parse_request(body: bytes, schema: type[Request]) -> Request:
    """A request body checked against `schema`, or the `ApiError` that names the field at fault."""
    try:
        data = bounded_json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 text", code="invalid_json") from None
    except bounded_json.JsonLimitError as err:
        raise ApiError(400, f"the request body {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        # Of a union's failed branches, the one that got deepest says most ("content.0.type", not "content"); the
        # branches' own names (`str`, `list[int]`, a model's class name) are no part of the field's path.
        worst = max(err.errors(), key=lambda error: len(error["loc"]))
        where = ".".join(str(part) for part in worst["loc"] if part not in _TYPE_TAGS and "[" not in str(part)
                         and not str(part)[:1].isupper())
        param = str(worst["loc"][0]) if worst["loc"] else None
        raise ApiError(400, f"{where or 'body'}: {worst['msg']}", param=param, code="invalid_value") from None


def check_model(name: str, served: str, adapters: Sequence[str] = ()) -> None:
    """Refuse a model name other than the one served or one of its LoRA adapters', with OpenAI's 404."""
    if name != served and name not in adapters:
        also = f" and its LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
        raise ApiError(404, f"the model {name!r} does not exist; this server has {served!r}{also}",
                       param="model", code="model_not_found")


def adapter_choice(fields: SamplingFields, adapters: Sequence[str]) -> tuple[str, float] | None:
    """The LoRA adapter (name, scale) a request runs with, or None for the base model: the adapter its `model`
    names (as vLLM's clients pick one), at scale 1 or at the scale of its `lora` entry; or the one adapter of
    non-zero scale its `lora` list names by id (llama-server's form). One adapter a request."""
    named = fields.model if fields.model in adapters else None
    chosen = [entry for entry in fields.lora or () if entry.scale != 0]
    if len(chosen) > 1:
        raise ApiError(400, f"lora: {len(chosen)} adapters of non-zero scale; ember applies one adapter a request",
                       param="lora", code="invalid_value")
    if not chosen:
        return None if named is None or fields.lora else (named, 1.0)
    entry = chosen[0]
    if entry.id >= len(adapters):
        raise ApiError(400, f"lora: no adapter has id {entry.id}; this server has {len(adapters)} (GET /lora-adapters)",
                       param="lora", code="invalid_value")
    if named is not None and adapters[entry.id] != named:
        raise ApiError(400, f"lora: id {entry.id} is the adapter {adapters[entry.id]!r}, the request's model is "
                            f"{named!r}", param="lora", code="invalid_value")
    return adapters[entry.id], entry.scale


def chat_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The chat's messages as a chat template takes them, once what ember does not do is refused."""
    if request.functions:
        raise ApiError(400, "functions (OpenAI's deprecated form) are not supported: send tools",
                       param="functions", code="unsupported_value")
    if request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    return template_messages(request.messages)


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """`messages` as a chat template takes them: a developer's as the system's, text parts joined, tool calls with
    their arguments as objects."""
    with tool_errors():
        return [tool_calls.template_message("system" if message.role == "developer" else message.role,
                                            _text(message.content), message.tool_calls, message.tool_call_id, index)
                for index, message in enumerate(messages)]


def _text(content: str | list[TextPart] | None) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content or [])


def chat_tools(request: ChatRequest, chat_template: Any) -> tool_calls.ToolPlan | None:
    """The request's tools and tool_choice checked against the served chat template; None without tools."""
    with tool_errors():
        return tool_calls.plan(request.tools, request.tool_choice, request.parallel_tool_calls, chat_template)


@contextlib.contextmanager
def tool_errors() -> Iterator[None]:
    """A `ToolRequestError` raised inside as the 400 naming its field."""
    try:
        yield
    except tool_calls.ToolRequestError as err:
        raise ApiError(400, str(err), param=err.param, code="invalid_value") from None


def completion_prompts(request: CompletionRequest, vocab_size: int) -> list[str | list[int]]:
    """The prompts of a completion request, each a text to tokenize or token ids checked against the vocabulary;
    `echo` with `logprobs` refused (the prompt's own logprobs would be wanted, and the scheduler's prefill keeps
    only the last position's logits)."""
    if request.echo and request.logprobs is not None:
        raise ApiError(400, "echo: with logprobs it asks for the prompt's logprobs, which ember does not compute "
                            "(prefill keeps only the last position's logits): drop one of them", param="echo",
                       code="unsupported_value")
    # pydantic read the field as one branch of its union: a text, token ids, or a list of either.
    given = request.prompt
    if isinstance(given, list) and given and isinstance(given[0], (str, list)):
        prompts = list(cast("list[str | list[int]]", given))
    else:
        prompts = [cast("str | list[int]", given)]
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompt: {len(prompts)} prompts; at most {MAX_PROMPTS} per request", param="prompt",
                       code="invalid_value")
    for index, prompt in enumerate(prompts):
        where = f"prompt.{index}" if len(prompts) > 1 else "prompt"
        if isinstance(prompt, str):
            continue
        if not prompt:
            raise ApiError(400, f"{where}: the prompt is empty: it needs at least one token", param="prompt",
                           code="invalid_value")
        if not 0 <= min(prompt) <= max(prompt) < vocab_size:
            raise ApiError(400, f"{where}: token ids must be in [0, {vocab_size}), got {min(prompt)}..{max(prompt)}",
                           param="prompt", code="invalid_value")
    return prompts


def check_choices(n: int, max_batch: int, tools: tool_calls.ToolPlan | None = None) -> None:
    """Refuse more choices than the artifact decodes at once, or several whose tool calls would be read."""
    if n > max_batch:
        raise ApiError(400, f"n: {n} choices; this model decodes at most {max_batch} sequences at once "
                            "(compiled --max-batch)", param="n", code="invalid_value")
    if n > 1 and tools is not None and tools.returns_calls:
        raise ApiError(400, "n: several choices of a reply that may call tools are not supported; ask for one",
                       param="n", code="unsupported_value")


def embedding_inputs(request: EmbeddingRequest, vocab_size: int) -> list[str | list[int]]:
    """The inputs of an embeddings request: texts to tokenize, or token ids checked against the vocabulary."""
    # pydantic read the field as one branch of its union: a text, token ids, or a list of either.
    given = request.input
    if isinstance(given, str) or given and isinstance(given[0], int):
        inputs = [cast("str | list[int]", given)]
    else:
        inputs = list(cast("list[str | list[int]]", given))
    if not inputs:
        raise ApiError(400, "input: no inputs given", param="input", code="invalid_value")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise ApiError(400, f"input: {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} per request",
                       param="input", code="invalid_value")
    for index, item in enumerate(inputs):
        if not item:
            raise ApiError(400, f"input.{index}: an input is empty", param="input", code="invalid_value")
        if isinstance(item, list) and not 0 <= min(item) <= max(item) < vocab_size:
            raise ApiError(400, f"input.{index}: token ids must be in [0, {vocab_size}), got {min(item)}..{max(item)}",
                           param="input", code="invalid_value")
    return inputs


def check_embedding_lengths(lengths: Sequence[int], context_window: int) -> None:
    """Refuse an input longer than the context window, naming `input`."""
    for index, length in enumerate(lengths):
        if length > context_window:
            raise ApiError(400, f"input.{index}: {length} tokens, more than this model's context window of "
                                f"{context_window} tokens", param="input", code="context_length_exceeded")


def embedding_response(vectors: Sequence[np.ndarray], model: str, prompt_tokens: int,
                       encoding_format: str) -> JsonObject:
    """The body answering /v1/embeddings: each vector as floats, or as base64 of little-endian float32 (the
    bytes the openai client decodes with numpy)."""
    def encoded(vector: np.ndarray) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
        return [float(x) for x in np.asarray(vector, np.float32)]
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def sampling_params(request: SamplingFields, prompt_len: int, context_window: int, vocab_size: int,
                    names: FieldNames = CHAT_FIELDS) -> SamplingParams:
    """The sampling parameters `request` asks for, for a prompt of `prompt_len` tokens (errors name its fields by
    `names`)."""
    max_tokens = request.token_limit()
    if prompt_len > context_window:
        raise ApiError(400, f"the prompt is {prompt_len} tokens, more than this model's context window of "
                            f"{context_window} tokens", param=names.prompt, code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > context_window:
        raise ApiError(400, f"this model's context window is {context_window} tokens; the prompt is {prompt_len} "
                            f"and {names.max_tokens} {max_tokens}: reduce one of them", param=names.max_tokens,
                       code="context_length_exceeded")
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if not all(stop):
        raise ApiError(400, "stop: strings must not be empty", param="stop", code="invalid_value")
    try:
        return SamplingParams(
            temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
            repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, seed=request.seed, stop_strings=tuple(stop),
            max_new_tokens=max_tokens or context_window - prompt_len or 1, logprobs=request.logprob_count(),
            logit_bias=logit_bias(request.logit_bias, vocab_size))
    except GenerationError as err:
        raise ApiError(400, str(err), code="invalid_value") from None


def logit_bias(biases: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON keys) with ids checked against the vocabulary."""
    if not biases:
        return None
    parsed = {}
    for key, bias in biases.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model's vocabulary "
                                f"(0 to {vocab_size - 1})", param="logit_bias", code="invalid_value")
        parsed[int(key)] = bias
    return parsed


def model_card(name: str, created: int, context_window: int, parent: str | None = None) -> JsonObject:
    """The model object of GET /v1/models/NAME; a LoRA adapter's names its base model as `parent` (as vLLM's)."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "ember", "max_model_len": context_window}
    return card if parent is None else {**card, "parent": parent}


def usage(lasts: Sequence[StreamEvent], choices: int = 1) -> dict[str, int]:
    """The token counts of a request as the last events of its choices have them, `choices` per prompt (choice i
    of prompt p has index p * choices + i): each prompt once."""
    prompt = sum(event.prompt_tokens for event in lasts if event.index % choices == 0)
    completion = sum(event.completion_tokens for event in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_logprobs(items: Sequence[TokenLogprob], token_text: Callable[[int], str]) -> JsonObject:
    """A chat choice's `logprobs`: each token's text, bytes and logprob, with its likeliest alternatives."""
    def entry(token_id: int, logprob: float) -> JsonObject:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(item.token_id, item.logprob),
                         "top_logprobs": [entry(*pair) for pair in item.top]} for item in items]}


def completion_logprobs(items: Sequence[TokenLogprob], offset: int, token_text: Callable[[int], str]) -> JsonObject:
    """A completion choice's `logprobs`, whose text offsets count from `offset` characters into the text."""
    tokens = [token_text(item.token_id) for item in items]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [item.logprob for item in items],
            "top_logprobs": [{token_text(i): lp for i, lp in item.top} for item in items], "text_offset": offsets}


def merge(events: Sequence[StreamEvent]) -> StreamEvent:
    """A whole request's events as one (its text, tokens and logprobs, and the last one's counts)."""
    last = events[-1]
    return StreamEvent("".join(e.text for e in events), [t for e in events for t in e.token_ids],
                       [lp for e in events for lp in e.logprobs], last.finish_reason, last.prompt_tokens,
                       last.completion_tokens, last.index, last.cached_tokens)


class ReplyShape(Protocol):
    """How one API answers a request from the scheduler's events: whole, or as server-sent events (`opening`, then
    what `feed` makes of each event, `failure` if generation fails after the response began, and `closing`)."""

    @property
    def stream(self) -> bool:
        """Whether the request asked for a stream."""
        ...

    def whole(self, events: Sequence[StreamEvent]) -> JsonObject:
        """The response to an unstreamed request, from all its events."""
        ...

    def opening(self) -> list[str]:
        """The stream's first events, before any token."""
        ...

    def feed(self, event: StreamEvent) -> list[str]:
        """The stream's events that `event` makes."""
        ...

    def failure(self, error: ApiError) -> list[str]:
        """The stream's events telling the client that generation failed."""
        ...

    def closing(self) -> list[str]:
        """What ends the stream, whether it ended well or failed."""
        ...


@dataclass(frozen=True)
class Reply:
    """The shape of one OpenAI chat or text completion answer: whole or streamed, with what extras.

    `token_text` names a token id (a tokenizer's decode of it alone) for logprobs."""

    chat: bool
    model: str
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    token_text: Callable[[int], str] = str
    tools: tool_calls.ToolPlan | None = None  # read tool calls out of the reply by this plan
    readers: dict[int, tool_calls.CallReader] = field(default_factory=dict)  # a tool-calling stream's, by choice
    choices: int = 1  # `n` per prompt: events carry the index of their choice, prompt-major
    echo: tuple[str, ...] = ()  # with `echo`, each prompt's text, which its choices' text starts with
    prompts: int = 1  # a text completion's prompts
    ended: list[StreamEvent] = field(default_factory=list)  # a stream's choices' last events, for its usage
    offsets: dict[int, int] = field(default_factory=dict)  # characters streamed so far, by choice
    created: int = field(default_factory=lambda: int(time.time()))
    ident: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def to(cls, request: ChatRequest | CompletionRequest, model: str, token_text: Callable[[int], str],
           tools: tool_calls.ToolPlan | None = None, echo: Sequence[str] = (), prompts: int = 1) -> Reply:
        """How `request` is answered (`tools`: the plan of a chat request's tools; `echo`: the texts of a completion
        request's `prompts` that asked for them back)."""
        return cls(chat=isinstance(request, ChatRequest), model=model, stream=request.stream,
                   include_usage=request.wants_usage(), logprobs=request.logprob_count() is not None,
                   token_text=token_text, tools=tools if tools and tools.returns_calls else None, choices=request.n,
                   echo=tuple(echo), prompts=prompts)

    def head(self) -> JsonObject:
        """The fields every response or chunk of this answer starts with."""
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{self.ident}",
                "object": kind + ".chunk" if self.chat and self.stream else kind,
                "created": self.created, "model": self.model}

    def whole(self, events: Sequence[StreamEvent]) -> JsonObject:
        """The response to an unstreamed request, from all its events."""
        merged = [merge([event for event in events if event.index == index])
                  for index in range(self.prompts * self.choices)]
        return {**self.head(), "choices": [self.choice(one, 0, first=True) for one in merged],
                "usage": usage(merged, self.choices)}

    def opening(self) -> list[str]:
        """Nothing: OpenAI's stream begins with its first chunk."""
        return []

    def feed(self, event: StreamEvent) -> list[str]:
        """The server-sent chunks of `event`."""
        offset = self.offsets.get(event.index, 0)
        chunks = self.chunks(event, offset, event.index not in self.offsets)
        self.offsets[event.index] = offset + len(event.text)
        return [sse(chunk) for chunk in chunks]

    def failure(self, error: ApiError) -> list[str]:
        """The error, in the stream."""
        return [sse(error.body())]

    def closing(self) -> list[str]:
        """OpenAI's `[DONE]`."""
        return [sse("[DONE]")]

    def chunks(self, event: StreamEvent, offset: int, first: bool) -> list[JsonObject]:
        """The stream chunks `event` makes (none, one, or one and the usage chunk after the last); `offset`:
        characters of text streamed before it, `first`: whether no chunk was sent yet."""
        if self.tools is not None:
            return self.tool_chunks(event, first, self.tools)
        chunks = []
        if event.text or event.token_ids or event.finish_reason or first:
            chunk = {**self.head(), "choices": [self.choice(event, offset, first)]}
            if self.include_usage:
                chunk["usage"] = None
            chunks.append(chunk)
        if event.finish_reason is not None:
            self.ended.append(event)
            if self.include_usage and len(self.ended) == self.prompts * self.choices:
                chunks.append({**self.head(), "choices": [], "usage": usage(self.ended, self.choices)})
        return chunks

    def choice(self, event: StreamEvent, offset: int, first: bool = False) -> JsonObject:
        """The choice (`event.index`) of a response or chunk holding `event` (`first`: the choice's first)."""
        logprobs = None
        if self.logprobs:
            logprobs = (chat_logprobs(event.logprobs, self.token_text) if self.chat else
                        completion_logprobs(event.logprobs, offset, self.token_text))
        if not self.chat:
            echoed = self.echo[event.index // self.choices] if first and self.echo else ""
            return {"index": event.index, "text": echoed + event.text, "logprobs": logprobs,
                    "finish_reason": event.finish_reason}
        if not self.stream:
            message, reason = {"role": "assistant", "content": event.text}, event.finish_reason
            if self.tools is not None:
                reader = tool_calls.read(event.text, self.tools)
                message, reason = tool_calls.message(reader.content, reader.calls), reader.finish_reason(reason)
            return {"index": event.index, "message": message, "logprobs": logprobs, "finish_reason": reason}
        delta = {"role": "assistant", "content": event.text} if first else {"content": event.text}
        return {"index": event.index, "delta": delta if event.text or first else {}, "logprobs": logprobs,
                "finish_reason": event.finish_reason}

    def tool_chunks(self, event: StreamEvent, first: bool, tools: tool_calls.ToolPlan) -> list[JsonObject]:
        """A tool-calling stream's chunks: the role first, then the content and calls (of `tools`) a `CallReader`
        reads out of each event's text as it comes (a call once its name is read, then its arguments piece by
        piece), the same as the whole answer's; last the finish reason ("tool_calls" only if the reply ended on
        whole calls) and the usage."""
        if event.index not in self.readers:
            self.readers[event.index] = tool_calls.CallReader(tools)
        reader = self.readers[event.index]
        read, reason = reader.read(event.text, event.finish_reason)
        chunks = [self.delta_chunk({"role": "assistant"})] if first else []
        chunks += [self.delta_chunk(delta) for delta in map(tool_calls.delta, read) if delta is not None]
        if reason is not None:
            chunks.append(self.delta_chunk({}, reason))
            if self.include_usage:
                chunks.append({**self.head(), "choices": [], "usage": usage([event])})
        return chunks

    def delta_chunk(self, delta: JsonObject, finish_reason: str | None = None) -> JsonObject:
        """A chat stream chunk carrying `delta`."""
        chunk = {**self.head(), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason}]}
        return {**chunk, "usage": None} if self.include_usage else chunk


def sse(data: JsonObject | str, event: str | None = None) -> str:
    """One server-sent event carrying `data` (a JSON object, or the stream's closing `[DONE]`), of type `event` if
    given (the Responses and Anthropic streams name each event's type)."""
    named = f"event: {event}\n" if event is not None else ""
    return f"{named}data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
