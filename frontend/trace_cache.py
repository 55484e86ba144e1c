"""Traced graphs kept between compiles, under `~/.cache/ember/traced/`.

`--frontend torch-export` builds the model from `config.json` with transformers (which initializes every weight),
traces it with torch.export and turns the trace into Relax with TVM's importer: 4.4 s of the tiny test GPT-2's 11 s
compile on a 2-core Zen 3, and more the larger the model. What that makes depends on `config.json`, the context
window and which tensor names the checkpoint stores (a tied weight is loaded by the name it is stored under), never
on the weights' values: another `--quant`, `--target` or `--kv-quant` of a checkpoint imports the same graph.

- An entry is the imported module (TVM's JSON) and the shape of each checkpoint tensor it loads, one file named
  by the sha256 of all that shapes them: those three inputs, the sources of ember's `frontend` and `ir` packages,
  and the versions of ember, torch, transformers, TVM and tvm-ffi.
- Entries are written to a staging file and renamed into place, so a parallel compile never reads half of one;
  one that does not load is traced again and replaced. The `KEPT_ENTRIES` used last are kept.
- `EMBER_TRACE_CACHE=0` turns it off; where the directory cannot be made or written, graphs are traced as without
  it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import tvm
from tvm_ffi.serialization import from_json_graph_str, to_json_graph_str

from ember.core.caches import installed_versions, newest_first, package_sources_digest, write_entry
from ember.core.machine import cache_dir

KEPT_ENTRIES = 64
# What runs between config.json and the module: ember's import code and the libraries it calls.
_PACKAGES = ("frontend", "ir")
_VERSIONS = ("ember", "torch", "transformers", "apache-tvm", "apache-tvm-ffi")

# The imported module and the shape of each checkpoint tensor it loads.
Traced = tuple[tvm.IRModule, dict[str, tuple[int, ...]]]


def enabled() -> bool:
    return os.environ.get("EMBER_TRACE_CACHE", "1") != "0"


def load_or_trace(config_json: bytes, context_window: int, stored_names: Iterable[str],
                  trace: Callable[[], Traced]) -> Traced:
    """The module and tensor shapes `trace()` makes for a checkpoint with `config_json` that stores `stored_names`,
    imported for `context_window` tokens: kept from an earlier compile, else traced and kept."""
    path = _entry_path(config_json, context_window, stored_names) if enabled() else None
    if path is not None:
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            mod = from_json_graph_str(entry["module"])
            shapes = {name: tuple(shape) for name, shape in entry["shapes"].items()}
        except FileNotFoundError:
            pass
        except Exception:  # damaged or cut short: traced again and replaced below
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        else:
            with contextlib.suppress(OSError):  # the mark of a recent use, which a read-only cache goes without
                os.utime(path)
            return mod, shapes
    mod, shapes = trace()
    if path is not None:
        _store(path, json.dumps({"module": to_json_graph_str(mod), "shapes": shapes}))
    return mod, shapes


def _entry_path(config_json: bytes, context_window: int, stored_names: Iterable[str]) -> Path | None:
    root = cache_dir() / "traced"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    digest = hashlib.sha256(config_json)
    digest.update(json.dumps([context_window, sorted(stored_names), _install_digest()]).encode())
    return root / f"{digest.hexdigest()[:32]}.json"


@functools.cache
def _install_digest() -> str:
    return package_sources_digest(*_PACKAGES) + installed_versions(*_VERSIONS)


def _store(path: Path, text: str) -> None:
    if not write_entry(path, text):  # a full or read-only disk costs the next compile a trace, nothing else
        return
    for old in newest_first(path.parent.glob("*.json"))[KEPT_ENTRIES:]:
        with contextlib.suppress(OSError):
            old.unlink(missing_ok=True)
