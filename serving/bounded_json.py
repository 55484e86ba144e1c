"""JSON from strangers, parsed within bounds: nesting depth, digits of a number, no NaN or Infinity.

Python's `json` turns a body nested 100,000 deep into a RecursionError and an integer of 5,000 digits into a
ValueError (CPython's limit on integer string conversion), neither a `JSONDecodeError`; and what does parse deep
can still exhaust the stack of whatever walks it later (a schema check, a chat template). `loads` parses with
hooks that refuse oversized numbers and the non-standard constants, then measures the depth without recursion,
so every refusal is one `JsonLimitError` naming what was too much.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # objects and arrays inside one another; JSON schemas and tool arguments need a handful
MAX_NUMBER_DIGITS = 64  # more than a float64's or an int64's digits, far below CPython's 4,300


class JsonLimitError(ValueError):
    """Text that is not JSON, or JSON beyond the bounds; the message reads after the text's name ("the body ...")."""


def loads(text: str | bytes) -> Any:
    """The JSON value of `text`, refusing malformed JSON, a number of more than `MAX_NUMBER_DIGITS` digits, NaN
    and Infinity, and nesting deeper than `MAX_DEPTH`."""
    try:
        value = json.loads(text, parse_int=_integer, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise JsonLimitError(f"nests more than {MAX_DEPTH} levels deep") from None
    except JsonLimitError:
        raise
    except ValueError as err:  # JSONDecodeError, and UnicodeDecodeError for bytes
        raise JsonLimitError(f"is not valid JSON: {err}") from None
    if depth(value) > MAX_DEPTH:
        raise JsonLimitError(f"nests more than {MAX_DEPTH} levels deep")
    return value


def depth(value: Any) -> int:
    """How many objects and arrays deep `value` nests (0 for a scalar), counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def _digits(text: str) -> str:
    if sum(c.isdigit() for c in text) > MAX_NUMBER_DIGITS:
        raise JsonLimitError(f"has a number of more than {MAX_NUMBER_DIGITS} digits ({text[:12]}...)")
    return text


def _integer(text: str) -> int:
    return int(_digits(text))


def _float(text: str) -> float:
    return float(_digits(text))


def _constant(name: str) -> Any:
    raise JsonLimitError(f"has {name}, which is not JSON")
