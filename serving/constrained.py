"""Constrained output: JSON, or JSON that matches a schema, as a token mask applied before sampling.

OpenAI's `response_format` (`{"type": "json_object"}`, or `{"type": "json_schema",
"json_schema": {"schema": ...}}`) compiles to a grammar with llguidance, the grammar
engine llama.cpp and vLLM use: a Rust wheel with no required dependencies, where
xgrammar needs torch. A `JsonMask` holds one request's matcher; called as the
scheduler's logits processor, it advances the matcher over the tokens sampled since its
last call and sets the logits of every token the grammar forbids to -inf. Once the JSON
is complete the grammar allows only the model's end-of-sequence tokens, so the request
ends with finish reason "stop" (or "length" mid-JSON, if max_tokens runs out first).

Whitespace between JSON tokens is fixed (", " and ": ", none elsewhere) unless the schema's
"x-guidance" options say otherwise: with free whitespace a weak model can pad forever.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from ember.core.errors import GenerationError
from ember.runtime.engine import ArtifactView
from ember.runtime.generate import end_of_sequence_ids

try:
    import llguidance
except ImportError:  # the serve extra brings it; the rest of the runtime runs without it
    _HAVE_LLGUIDANCE = False
else:
    _HAVE_LLGUIDANCE = True

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its stubs only

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class JsonMask:
    """One request's grammar state; as a `LogitsProcessor` it masks every token the grammar forbids."""

    def __init__(self, matcher: Any, param: str = "response_format") -> None:
        self._matcher = matcher
        self._consumed = 0
        self._param = param  # the request field that asked for the grammar

    def __call__(self, generated: list[int], logits: np.ndarray) -> np.ndarray:
        matcher = self._matcher
        matcher.consume_tokens(generated[self._consumed:])
        self._consumed = len(generated)
        allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = allowed[: logits.size].astype(bool)
        if matcher.is_error() or not allowed.any():
            raise GenerationError(f"{self._param}: {_one_line(matcher.get_error() or 'no token can follow')}")
        return np.where(allowed, logits, -np.inf)


class JsonConstraints:
    """Makes `JsonMask`s for one artifact; its llguidance tokenizer is built on first use (about a second
    for a large vocabulary) and shared by every request."""

    def __init__(self, artifact: ArtifactView, vocab_size: int) -> None:
        self.artifact = artifact
        self.vocab_size = vocab_size  # the model's logits, which may be padded beyond the tokenizer's
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def mask(self, response_format: Mapping[str, Any], param: str = "response_format") -> JsonMask | None:
        """A fresh mask for one request, or None for `{"type": "text"}`; a `GenerationError` naming `param` (the
        request field that holds the format: chat's `response_format`, the Responses API's `text.format`) for a
        format or schema that cannot be used."""
        schema = _schema(response_format, param)
        if schema is None:
            return None
        if not _HAVE_LLGUIDANCE:
            raise GenerationError(f"{param}: JSON output needs llguidance: pip install 'ember[serve]'")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        return self._matcher_mask(grammar, param, "invalid JSON schema")

    def grammar_mask(self, lark: str, param: str) -> JsonMask:
        """A fresh mask for one request held to a Lark grammar (llguidance's, `%json {schema}` included); a
        `GenerationError` naming `param` if it cannot be used."""
        if not _HAVE_LLGUIDANCE:
            raise GenerationError(f"{param}: constrained output needs llguidance: pip install 'ember[serve]'")
        return self._matcher_mask(lark, param, "cannot constrain the output to it")

    def _matcher_mask(self, grammar: str, param: str, problem: str) -> JsonMask:
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GenerationError(f"{param}: {problem}: {_one_line(matcher.get_error())}")
        return JsonMask(matcher, param)

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Each token's own bytes, as the grammar engine reads the vocabulary: a byte-level token may hold part of a
        UTF-8 character, which the token decoded alone turns into U+FFFD."""
        if not _HAVE_LLGUIDANCE:
            raise GenerationError("tokens' bytes need llguidance: pip install 'ember[serve]'")
        tokenizer = self._llg_tokenizer()
        return [tokenizer.decode_bytes([token]) for token in token_ids]

    def _llg_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._build_tokenizer()
            return self._tokenizer

    def _build_tokenizer(self) -> Any:
        artifact = self.artifact
        if artifact.tokenizer is None:
            raise GenerationError("response_format: JSON output needs the artifact's tokenizer; it has none")
        eos = sorted(end_of_sequence_ids(artifact))
        if not eos:
            raise GenerationError("response_format: this model has no end-of-sequence token to end the JSON with")
        text = (artifact.path / "tokenizer.json").read_text(encoding="utf-8")
        try:
            return llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
        except ValueError:  # a decoder llguidance cannot invert (e.g. Fuse): hand it each token's text
            wrapped = llguidance.TokenizerWrapper(_TokenTexts(HFTokenizer.from_str(text), eos[0]))
            return llguidance.LLTokenizer(wrapped, n_vocab=self.vocab_size, eos_token=eos)


class _TokenTexts:
    """What `llguidance.TokenizerWrapper` asks of a tokenizer, for one whose tokens each decode to their
    own text (no byte-level or byte-fallback pieces: llguidance reads those from tokenizer.json itself)."""

    def __init__(self, tokenizer: HFTokenizer, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = None
        added = tokenizer.get_added_tokens_decoder()
        self.special_token_ids = [i for i, token in added.items() if token.special]
        self.tokens = [tokenizer.decode([i], skip_special_tokens=False).encode("utf-8")
                       for i in range(tokenizer.get_vocab_size(with_added_tokens=True))]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def _schema(response_format: Mapping[str, Any], param: str) -> dict[str, Any] | None:
    """The JSON schema a response format (the request field `param`) asks for; None for plain text."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise GenerationError(f"{param}: json_schema.schema must be a JSON schema object")
        return dict(schema)
    raise GenerationError(f"{param}: type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _one_line(message: str) -> str:
    return " ".join(str(message).split())
