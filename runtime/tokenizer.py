"""Tokenizer, special tokens and chat template from a checkpoint's tokenizer files.

Encoding goes through the `tokenizers` library with the checkpoint's own
post-processor (so BOS handling matches Hugging Face's fast tokenizer); the chat
template is the checkpoint's Jinja template, compiled once and rendered in a sandbox
that also bounds its time and output (`_BoundedEnvironment`): a template is code from
whoever published the checkpoint.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import json
import re
import string
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

from ember.core.errors import ArtifactError, EmberError, GenerationError
from ember.core.tokenizer_files import default_chat_template, tokenizer_json_problem

RENDER_SECONDS = 1.0  # a real chat template renders in milliseconds
RENDER_CHARS = 2**20  # plus twice the conversation's own text
DEFAULT_CONTEXT_TOKENS = 1 << 17  # when the caller does not say how many tokens a text may fill
TEXT_SLACK_BYTES = 4096


class Tokenizer:
    """Text <-> token ids, plus the model's special tokens and chat template."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], generation: dict[str, Any],
                 config_name: str = "tokenizer_config.json", context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> None:
        self._tokenizer = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = default_chat_template(config.get("chat_template"))
        eos_ids = generation.get("eos_token_id")
        if eos_ids is None and self.eos_token is not None:
            eos_ids = tokenizer.token_to_id(self.eos_token)
        self.eos_token_ids = tuple([eos_ids] if isinstance(eos_ids, int) else eos_ids or ())
        self._template_name = f"{config_name}: chat template"
        longest = max((len(token.encode("utf-8", "replace")) for token in self.vocabulary()), default=1)
        # No text longer than this can fit the context; refusing it first bounds what encoding may cost.
        self.max_text_bytes = context_tokens * max(longest, 4) + TEXT_SLACK_BYTES

    @classmethod
    def from_dir(cls, path: Path, context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> "Tokenizer":
        """Load `tokenizer.json` (within `tokenizer_files`' bounds) and, if present, `tokenizer_config.json` and
        `generation_config.json`; `context_tokens` is the most tokens a text may fill."""
        tokenizer_path = Path(path) / "tokenizer.json"
        try:
            text = tokenizer_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ArtifactError(f"{tokenizer_path}: cannot read it: {_one_line(str(err))}") from None
        try:
            problem = tokenizer_json_problem(json.loads(text))
        except (json.JSONDecodeError, RecursionError):
            problem = None  # tokenizers says what is wrong with it below
        if problem:
            raise ArtifactError(f"{tokenizer_path}: {problem}")
        with _tokenizer_failures(f"{tokenizer_path}: cannot load tokenizer", ArtifactError):
            tokenizer = HFTokenizer.from_str(text)
        config_path = Path(path) / "tokenizer_config.json"
        return cls(tokenizer, _read_optional_json(config_path), _read_optional_json(path / "generation_config.json"),
                   str(config_path), context_tokens)

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
        """Token ids of `text`, refused before encoding if it is longer than the context could hold."""
        check_text(text, "the text to encode")
        size = len(text.encode("utf-8"))
        if size > self.max_text_bytes:
            raise GenerationError(f"the text to encode is {size} bytes, more than the context could hold "
                                  f"(at most {self.max_text_bytes}); shorten it")
        with _tokenizer_failures("the tokenizer failed on the text", GenerationError):
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        with _tokenizer_failures("the tokenizer failed to decode the tokens", GenerationError):
            return self._tokenizer.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def _compiled_template(self) -> tuple[jinja2.Template | None, str]:
        """The chat template compiled on first use: a generate that never chats never runs its code."""
        return _compile_template(self.chat_template, self._template_name)

    def check_chat_template(self) -> None:
        """Raise `GenerationError` if the model has no chat template or it does not compile."""
        self._chat_template()

    def _chat_template(self) -> jinja2.Template:
        """The compiled chat template; a `GenerationError` if the model has none or it does not compile."""
        template, error = self._compiled_template
        if template is None:
            raise GenerationError(error)
        return template

    def use_chat_template(self, source: str, name: str) -> None:
        """Render chats with `source` (from the file `name`) instead of the model's own template; a
        `GenerationError` naming the file if it does not compile."""
        self.chat_template, self._template_name = source, name
        self.__dict__.pop("_compiled_template", None)
        self.check_chat_template()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render a conversation (and the tools it may call, as transformers passes them) with the model's chat
        template, within `RENDER_SECONDS` and `RENDER_CHARS` plus twice the conversation's characters."""
        template = self._chat_template()
        given = sum(len(str(value)) for message in messages for value in message.values()) + len(str(tools or ""))
        budget = _Budget(time.monotonic() + RENDER_SECONDS, RENDER_CHARS + 2 * given)
        token = _BUDGET.set(budget)
        pieces, length = [], 0
        try:
            for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
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


@contextlib.contextmanager
def _tokenizer_failures(what: str, error: type[EmberError]) -> Iterator[None]:
    """Any failure inside `tokenizers` (its Rust panics are BaseExceptions) as one line of `error`; an
    interrupt or an exit goes on as it is."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # noqa: BLE001 - pyo3's PanicException derives from BaseException
        lines = str(err).strip().splitlines() or [type(err).__name__]
        raise error(f"{what}: {_one_line(lines[0])}") from None


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


class _OverBudget(Exception):  # noqa: N818 - private, never seen outside
    """The template ran past its time or size bound."""


class _TemplateRaised(Exception):  # noqa: N818
    """The template called raise_exception (a conversation it does not accept)."""


def _budget() -> _Budget:
    return _BUDGET.get()


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles every `{% for %}` to iterate through `environment.bounded_iter`, so a loop
    without calls or output (`{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}`)
    still meets the deadline at each step, and every `~` to join through
    `environment.bounded_pieces`, which measures the pieces before they are joined."""

    def visit_For(self, node: nodes.For, frame: Any) -> None:  # noqa: N802 - Jinja's visitor names
        node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None)
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:  # noqa: N802
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"{join}(environment.bounded_pieces((")
        for piece in node.nodes:
            self.visit(piece, frame)
            self.write(", ")
        self.write(")))")


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox (no attribute access to internals, range() of at most 10**5
    items) without `lipsum` and without constant folding (nothing runs at compile time), plus:
    every call, attribute, item, filter and loop step checks the rendering's deadline; `*`,
    `**`, `+`, `~`, `%` formatting, `str.format`, and the calls that multiply text (replace,
    join, indent, wordwrap, expandtabs) refuse results past the size bound before building them;
    calls and filters refuse numbers past it (`'x'.ljust(10**9)`) and arguments holding more
    text than it; strings read or returned past it are refused."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, optimized=False)
        del self.globals["lipsum"]  # builds any amount of text in one call that no deadline can interrupt
        self.globals["raise_exception"] = _raise_template_error
        self.globals["strftime_now"] = _strftime_now
        self.filters["tojson"] = _tojson  # transformers' own: key order kept, no HTML escapes, indent and separators
        self.filters = {name: _bounded(function, name) for name, function in self.filters.items()}

    @staticmethod
    def bounded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
        """`iterable`, checking the deadline at each item."""
        budget = _budget()
        for item in iterable:
            budget.check()
            yield item

    @staticmethod
    def bounded_pieces(pieces: tuple[Any, ...]) -> tuple[Any, ...]:
        """The pieces of `a ~ b`, refused if joining them would pass the size bound."""
        _budget().check(_text_size(pieces))
        return pieces

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.check()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(count, int):
                    budget.check(len(sequence) * count)
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > \
                    8 * budget.max_chars:
                raise _OverBudget("the product is too large")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                budget.check(len(left) + len(right))
        elif operator == "%":
            if isinstance(left, str):
                budget.check(_percent_format_size(left, right))
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

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        pattern, is_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(wrapper)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            _budget().check(_brace_format_size(pattern, args[0] if is_map and args else (args, kwargs)))
            return _budget().check_value(wrapper(*args, **kwargs))

        return bounded

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_arguments(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        return _budget().check_value(super().call(__context, __obj, *args, **kwargs))


def _bounded(function: Any, name: str) -> Any:
    """A Jinja filter that checks the rendering's budget before and after it runs."""
    @functools.wraps(function)  # keeps `jinja_pass_arg` (pass_context and the like)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        values = [arg for arg in args if not isinstance(arg, (jinja2.runtime.Context, jinja2.nodes.EvalContext,
                                                              jinja2.Environment))]
        _check_filter(name, values, kwargs)
        return _budget().check_value(function(*args, **kwargs))

    return bounded


def _check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    budget = _budget()
    budget.check()
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and abs(value) > budget.max_chars:
            raise _OverBudget(f"the argument {value} is too large")
    budget.check(_text_size((args, kwargs)))


def _text_size(value: Any, limit: int = 10**6) -> int:
    """About how many characters `value` turns into as text: its strings' lengths (each time it holds one),
    through lists, tuples, sets and dicts; a structure of more than `limit` items counts as huge."""
    total, stack, seen = 0, [value], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > limit:
            return 2**62
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset, range)):
            if isinstance(item, range) and len(item) > limit:
                return 2**62
            stack.extend(item)
        else:
            total += 16
    return total


_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)


def _percent_format_size(pattern: str, values: Any) -> int:
    """An upper bound of `pattern % values`'s length, from its widths and precisions, before formatting."""
    size = len(pattern) + _text_size(values)
    for width, precision, _ in _PERCENT_FIELD.findall(pattern):
        size += sum(int(n) for n in (width, precision) if n.isdigit())
        if "*" in (width, precision):
            size += sum(abs(v) for v in (values if isinstance(values, tuple) else (values,)) if isinstance(v, int))
    return size


def _brace_format_size(pattern: str, values: Any) -> int:
    """An upper bound of `pattern.format(...)`'s length, from the numbers in its format specs."""
    size = len(pattern) + _text_size(values)
    try:
        fields = list(string.Formatter().parse(pattern))
    except ValueError:
        return size  # str.format refuses it itself
    for _, _, spec, _ in fields:
        size += sum(int(n) for n in re.findall(r"\d+", spec or ""))
        if spec and "{" in spec:
            args, kwargs = values if isinstance(values, tuple) and len(values) == 2 else ((), {})
            size += sum(abs(v) for v in (*args, *(kwargs.values() if isinstance(kwargs, dict) else ()))
                        if isinstance(v, int))
    return size


def _check_str_method(text: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse `text.replace`, `.join` and `.expandtabs` calls whose result would pass the size bound."""
    budget = _budget()
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        budget.check(_replaced_size(text, args[0], args[1]))
    elif name == "join" and args:
        budget.check(_joined_size(args[0], text))
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        budget.check(len(text) + text.count("\t") * (size if isinstance(size, int) else 8))


def _check_filter(name: str, values: list[Any], kwargs: dict[str, Any]) -> None:
    """Refuse the filters that multiply text (format, replace, join, indent, wordwrap) past the size bound."""
    budget = _budget()
    first = values[0] if values else None
    rest = values[1:]
    if name == "format" and isinstance(first, str):
        budget.check(_percent_format_size(first, tuple(rest) or kwargs))
    elif name == "replace" and isinstance(first, str) and len(rest) >= 2:
        budget.check(_replaced_size(first, str(rest[0]), str(rest[1])))
    elif name == "join":
        separator = rest[0] if rest else kwargs.get("d", "")
        budget.check(_joined_size(first, separator if isinstance(separator, str) else ""))
    elif name == "indent" and isinstance(first, str):
        width = rest[0] if rest else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 4
        budget.check(len(first) + (first.count("\n") + 1) * width)
    elif name == "wordwrap" and isinstance(first, str):
        wrapstring = rest[2] if len(rest) > 2 else kwargs.get("wrapstring") or "\n"
        budget.check(len(first) + (len(first) + 1) * len(str(wrapstring)))


def _replaced_size(text: str, old: str, new: str) -> int:
    count = text.count(old) if old else len(text) + 1
    return len(text) + count * max(len(new) - len(old), 0)


def _joined_size(items: Any, separator: str) -> int:
    count = len(items) if isinstance(items, (str, list, tuple, dict, range)) else 0
    return _text_size(items) + count * len(separator)


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


def _strftime_now(pattern: str) -> str:
    return datetime.datetime.now().strftime(pattern)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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
