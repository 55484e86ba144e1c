"""Tokenizer, special tokens and chat template from a checkpoint's tokenizer files.

Encoding goes through the `tokenizers` library with the checkpoint's own
post-processor (so BOS handling matches Hugging Face's fast tokenizer); the chat
template is the checkpoint's Jinja template, compiled once and rendered in a sandbox
that also bounds its time and output (`_BoundedEnvironment`): a template is code from
whoever published the checkpoint.
"""

from __future__ import annotations

import contextvars
import functools
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from tokenizers import Tokenizer as HFTokenizer

from ember.core.errors import ArtifactError, GenerationError
from ember.core.tokenizer_files import default_chat_template

RENDER_SECONDS = 1.0  # a real chat template renders in milliseconds
RENDER_CHARS = 2**20  # plus twice the conversation's own text


class Tokenizer:
    """Text <-> token ids, plus the model's special tokens and chat template."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], generation: dict[str, Any],
                 config_name: str = "tokenizer_config.json") -> None:
        self._tokenizer = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = default_chat_template(config.get("chat_template"))
        eos_ids = generation.get("eos_token_id")
        if eos_ids is None and self.eos_token is not None:
            eos_ids = tokenizer.token_to_id(self.eos_token)
        self.eos_token_ids = tuple([eos_ids] if isinstance(eos_ids, int) else eos_ids or ())
        self._template_name = f"{config_name}: chat template"
        self._template, self._template_error = _compile_template(self.chat_template, self._template_name)

    @classmethod
    def from_dir(cls, path: Path) -> "Tokenizer":
        """Load `tokenizer.json` and, if present, `tokenizer_config.json` and `generation_config.json`."""
        try:
            tokenizer = HFTokenizer.from_file(str(Path(path) / "tokenizer.json"))
        except Exception as err:  # tokenizers raises a bare Exception for a bad file
            raise ArtifactError(f"{path / 'tokenizer.json'}: cannot load tokenizer: {err}") from None
        config_path = Path(path) / "tokenizer_config.json"
        return cls(tokenizer, _read_optional_json(config_path), _read_optional_json(path / "generation_config.json"),
                   str(config_path))

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, if the model has one."""
        return None if self.bos_token is None else self._tokenizer.token_to_id(self.bos_token)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, including added ones."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token's text and id, added tokens included."""
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        check_text(text, "the text to encode")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def check_chat_template(self) -> None:
        """Raise `GenerationError` if the model has no chat template or it does not compile."""
        if self._template_error:
            raise GenerationError(self._template_error)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's chat template, within `RENDER_SECONDS` and
        `RENDER_CHARS` plus twice the conversation's characters."""
        self.check_chat_template()
        given = sum(len(str(value)) for message in messages for value in message.values())
        budget = _Budget(time.monotonic() + RENDER_SECONDS, RENDER_CHARS + 2 * given)
        token = _BUDGET.set(budget)
        pieces, length = [], 0
        try:
            for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=self.bos_token or "", eos_token=self.eos_token or ""):
                length += len(piece)
                budget.check(length)
                pieces.append(piece)
        except _TemplateRaised as err:
            raise GenerationError(f"{self._template_name} refused the conversation: {_one_line(str(err))}") from None
        except _OverBudget as err:
            raise GenerationError(f"{self._template_name}: {err}") from None
        except RecursionError:
            raise GenerationError(f"{self._template_name}: recursion too deep") from None
        except MemoryError:
            raise GenerationError(f"{self._template_name}: ran out of memory rendering it") from None
        except Exception as err:  # anything else the template's code raised is the template's fault
            raise GenerationError(f"{self._template_name}: {type(err).__name__}: {_one_line(str(err))}") from None
        finally:
            _BUDGET.reset(token)
        return "".join(pieces)


def check_text(text: str, what: str) -> None:
    """Raise `GenerationError` if `text` holds lone surrogates: bytes that were not UTF-8
    (Python decodes command lines and some streams with surrogate escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise GenerationError(f"{what} is not valid UTF-8 text") from None


@dataclass
class _Budget:
    """What one rendering may still spend."""

    deadline: float
    max_chars: int

    def check(self, chars: int = 0) -> None:
        if chars > self.max_chars:
            raise _OverBudget(f"its text would exceed {self.max_chars} characters")
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"rendering took more than {RENDER_SECONDS:g} s")

    def check_value(self, value: Any) -> Any:
        if isinstance(value, str):
            self.check(len(value))
        return value


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


class _OverBudget(Exception):
    """The template ran past its time or size bound."""


class _TemplateRaised(Exception):
    """The template called raise_exception (a conversation it does not accept)."""


def _budget() -> _Budget:
    return _BUDGET.get()


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles every `{% for %}` to iterate through `environment.bounded_iter`, so a loop
    without calls or output (`{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}`)
    still meets the deadline at each step."""

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None)
        super().visit_For(node, frame)


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox (no attribute access to internals, range() of at most 10**5
    items), plus: every call, attribute, item, filter and loop step checks the rendering's
    deadline; `*` and `**` refuse results past the size bound before computing them; calls
    and filters refuse numbers past it (`'x'.ljust(10**9)`, `'x'|center(10**9)`); strings
    read or returned past it are refused."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.globals["raise_exception"] = _raise_template_error
        self.filters = {name: _bounded(function) for name, function in self.filters.items()}

    @staticmethod
    def bounded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
        """`iterable`, checking the deadline at each item."""
        budget = _budget()
        for item in iterable:
            budget.check()
            yield item

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.check()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
                    budget.check(len(sequence) * count)
        elif isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and left.bit_length() * right > 8 * budget.max_chars:
                raise _OverBudget(f"{left} ** {right} is too large")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().check()
        return _budget().check_value(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().check()
        return _budget().check_value(super().getitem(obj, argument))

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_arguments(args, kwargs)
        return _budget().check_value(super().call(__context, __obj, *args, **kwargs))


def _bounded(function: Any) -> Any:
    """A Jinja filter that checks the rendering's budget before and after it runs."""
    @functools.wraps(function)  # keeps `jinja_pass_arg` (pass_context and the like)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        return _budget().check_value(function(*args, **kwargs))

    return bounded


def _check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    budget = _budget()
    budget.check()
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and abs(value) > budget.max_chars:
            raise _OverBudget(f"the argument {value} is too large")


def _compile_template(source: Any, name: str) -> tuple[jinja2.Template | None, str]:
    """The compiled template and "", or None and why it cannot be used."""
    if not source:
        return None, "this model has no chat template (tokenizer_config.json has no 'chat_template')"
    if not isinstance(source, str):
        return None, f"{name}: expected a string, got {type(source).__name__}"
    try:
        return _BoundedEnvironment().from_string(source), ""
    except jinja2.TemplateSyntaxError as err:
        return None, f"{name}: line {err.lineno}: {_one_line(err.message or str(err))}"
    except (RecursionError, MemoryError, SyntaxError, ValueError) as err:  # nested too deep for Python's compiler
        return None, f"{name}: cannot compile it ({type(err).__name__})"


def _raise_template_error(message: str) -> None:
    raise _TemplateRaised(message)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: malformed JSON: {err}") from None
