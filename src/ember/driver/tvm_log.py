"""TVM's native warnings, kept out of ember's output unless `-v`.

TVM's C++ code logs straight to file descriptor 2, past Python's `sys.stderr`. Lowering
prints, for instance, "Warning: Fast mode segfaults when there are out-of-bounds indices"
for every embedding and logit gather: ember's runtime checks every token id before it
reaches a kernel, so the warning is not actionable, and it alarms users. While lowering,
descriptor 2 goes to a temporary file; afterwards everything that is not such a warning is
written back, and the warnings too when ember logs at INFO (`-v`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("ember")

_TVM_WARNING = re.compile(rb"^\[\d\d:\d\d:\d\d\] \S+:\d+: Warning: ")


@contextmanager
def tvm_warnings_hidden() -> Iterator[None]:
    """Run the block with TVM's native warnings held back (shown under `-v`); other output passes through."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            shown = [line for line in held.read().splitlines(keepends=True)
                     if log.isEnabledFor(logging.INFO) or not _TVM_WARNING.match(line)]
            if shown:
                sys.stderr.write(b"".join(shown).decode(errors="replace"))
                sys.stderr.flush()
