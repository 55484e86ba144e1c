"""llama.cpp's utility endpoints as llama-server names them, for the tools written against it: `/tokenize`,
`/detokenize`, `/apply-template`, `/props` and `/lora-adapters` (no HTTP here: the request bodies, their checks,
and the answers).

Where ember differs, it says so rather than pretend: `/detokenize` drops special tokens (the tokenizer's decode, as
every reply's text is made); `/props` reports only what holds for ember.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import Field

from ember.serving.protocol import ApiError, ApiModel, JsonObject, Message, SamplingFields


class TokenizeRequest(ApiModel):
    """The body of POST /tokenize."""

    content: str
    add_special: bool = False  # the model's special tokens (its BOS), as llama-server's default leaves them out
    with_pieces: bool = False  # each token with its text (or its bytes, where they are no whole UTF-8)


class DetokenizeRequest(ApiModel):
    """The body of POST /detokenize."""

    tokens: list[int]


class TemplateRequest(ApiModel):
    """The body of POST /apply-template: a chat request's conversation and tools (the model need not be named)."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool = True


def token_pieces(token_ids: Sequence[int], token_bytes: Sequence[bytes]) -> list[JsonObject]:
    """/tokenize's `with_pieces` answer: each token's id and piece, its text where its bytes are whole UTF-8 and
    the list of its bytes where they are not (a byte-level token holding part of a character), as llama-server."""
    def piece(raw: bytes) -> str | list[int]:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)
    return [{"id": token, "piece": piece(raw)} for token, raw in zip(token_ids, token_bytes)]


def check_token_ids(tokens: Sequence[int], vocab_size: int) -> None:
    """Refuse token ids outside the tokenizer's vocabulary, naming `tokens`."""
    if tokens and not 0 <= min(tokens) <= max(tokens) < vocab_size:
        raise ApiError(400, f"tokens: token ids must be in [0, {vocab_size}), got {min(tokens)}..{max(tokens)}",
                       param="tokens", code="invalid_value")


def props(model_name: str, artifact_path: Path, context_window: int, max_batch: int, chat_template: str | None,
          bos_token: str | None, eos_token: str | None) -> JsonObject:
    """GET /props: the defaults a request's sampling takes (read from the request schema, so they cannot drift), the
    context window, the sequences decoded at once, the artifact and its chat template, and ember's version."""
    defaults = {name: field.default for name, field in SamplingFields.model_fields.items()}
    return {
        "default_generation_settings": {"n_ctx": context_window, "params": {
            "n_predict": -1,  # as llama-server: no limit but the context window
            "temperature": defaults["temperature"], "top_k": defaults["top_k"], "top_p": defaults["top_p"],
            "repeat_penalty": defaults["repetition_penalty"], "presence_penalty": defaults["presence_penalty"],
            "frequency_penalty": defaults["frequency_penalty"]}},
        "total_slots": max_batch, "model_alias": model_name, "model_path": str(artifact_path),
        "chat_template": chat_template or "", "bos_token": bos_token, "eos_token": eos_token,
        "modalities": {"vision": False, "audio": False}, "build_info": f"ember {metadata.version('ember')}"}


def lora_adapters(adapters: Mapping[str, Path]) -> list[JsonObject]:
    """GET /lora-adapters: each loaded adapter's id (what a request's `lora` list names), name and directory, at the
    scale a request that names it by `model` runs it with, as llama-server lists its adapters."""
    return [{"id": index, "name": name, "path": str(path), "scale": 1.0}
            for index, (name, path) in enumerate(adapters.items())]
