"""Parsing TVMScript at the cost of the parse alone: stacks read without scanning `sys.modules`, kernels parsed once.

TVMScript's decorators and parser read the caller's stack (`inspect.stack()`, `inspect.getouterframes()`) to
find the variables a kernel closes over. For every frame, `inspect` looks up the module the frame's file belongs
to, and for a file no module was loaded from (TVMScript evaluates each expression as code named "<ast>"; the
import machinery's frames are "<frozen importlib._bootstrap>") that lookup is a scan of all of `sys.modules`,
only to answer None. Measured here: 1.8 s of a 10 s `ember compile demo --quant q4f32`, a quarter of a compile
inside a test process (which holds torch and transformers), 30 s of importing TVM's tensor intrinsics.

- `stacks_from_linecache()`: while it is entered, both functions build each frame's record from the frame and
  `linecache`, as `inspect` does (file, line, function, the same lines of context), without the module lookup.
- `parsed_once`: memoizes a kernel builder by its arguments' values. A PrimFunc is immutable, so a model's
  repeated shapes (every layer's, every pipeline stage's, every compile of one process) share one parse; and
  other processes load it (`kernel_store`) instead of parsing it again.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TypeVar

from tvm.runtime import Object
from tvm.target import Target

from ember.ir import kernel_store

# Kernels kept per builder: a model needs tens; `ember tune` builds one per candidate, so the oldest go.
PARSED_KERNELS_KEPT = 256

Builder = TypeVar("Builder", bound=Callable)


def _frame_info(frame: FrameType, context: int) -> inspect.FrameInfo:
    """`inspect.getframeinfo`'s record of `frame`, its `context` lines read from linecache."""
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    lines, index = None, None
    if context > 0:
        source = linecache.getlines(filename, frame.f_globals)
        start = max(0, min(lineno - 1 - context // 2, len(source) - context))
        if source:
            lines, index = source[start:start + context], lineno - 1 - start
    return inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, lines, index)


def _outer_frames(frame: FrameType | None, context: int = 1) -> list[inspect.FrameInfo]:
    """`inspect.getouterframes`: `frame` and every frame that called it."""
    infos = []
    while frame is not None:
        infos.append(_frame_info(frame, context))
        frame = frame.f_back
    return infos


def _stack(context: int = 1) -> list[inspect.FrameInfo]:
    """`inspect.stack`: the caller's frame and every frame above it."""
    return _outer_frames(sys._getframe(1), context)


@contextmanager
def stacks_from_linecache() -> Iterator[None]:
    """Within the block, `inspect.stack` and `inspect.getouterframes` read frames without module lookups."""
    saved = inspect.stack, inspect.getouterframes
    inspect.stack, inspect.getouterframes = _stack, _outer_frames
    try:
        yield
    finally:
        inspect.stack, inspect.getouterframes = saved


def parsed_once(builder: Builder) -> Builder:
    """`builder`, a function of plain values returning a PrimFunc, memoized by its arguments' values and run with
    `stacks_from_linecache`.

    The builder is called with the arguments as given; they are compared by value: lists and tuples alike, dicts
    by their items, TVM targets by their configuration, anything else hashable (numbers, strings, enums, frozen
    dataclasses) as itself. Any other IR node, such as a symbolic variable, is refused with TypeError: it
    compares by identity, and a kernel closing over one compile's variable must not reach another compile."""

    @functools.lru_cache(maxsize=PARSED_KERNELS_KEPT)
    def parse(call: _ByValue):
        args, kwargs = call.value

        def build():
            with stacks_from_linecache():
                return builder(*args, **kwargs)

        return kernel_store.load_or_build(builder, call.key, build)

    @functools.wraps(builder)
    def build(*args, **kwargs):
        return parse(_ByValue((args, kwargs)))

    return build


class _ByValue:
    """A builder's arguments, hashed and compared by `_value_key`."""

    __slots__ = ("key", "value")

    def __init__(self, value) -> None:
        self.value, self.key = value, _value_key(value)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, _ByValue) and self.key == other.key


def _value_key(value):
    """A hashable key, equal for equal values; the type is part of it, so 1, 1.0 and True stay apart."""
    if isinstance(value, Target):
        return Target, str(value)
    if isinstance(value, Object):  # IR nodes hash and compare by identity
        raise TypeError(f"a kernel builder's argument {type(value).__name__} is an IR node, not a value to memoize by")
    if isinstance(value, (list, tuple)):
        return tuple, tuple(map(_value_key, value))
    if isinstance(value, dict):
        return dict, tuple(sorted(((_value_key(k), _value_key(v)) for k, v in value.items()), key=repr))
    hash(value)  # TypeError for an unhashable argument
    return type(value), value
