"""frontend/trace_cache.py: the graph `--frontend torch-export` traces is kept between compiles.

A second import of a checkpoint (another `--quant`, say) takes the kept module without calling torch.export, and
that module is structurally equal to the trace's; a config.json or context window of its own is traced anew; a
damaged entry is traced again and replaced; `EMBER_TRACE_CACHE=0` traces, whatever is kept.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import tvm_ffi

from ember.frontend.hf import imported_model_config
from ember.frontend.torch_export import build_exported_module
from ember.frontend.weights import CheckpointWeights


@pytest.fixture
def traces(monkeypatch, tmp_path) -> list[int]:
    """The cache under `tmp_path`; each torch.export call appends to the list returned."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls, export = [], torch.export.export

    def counted(*args, **kwargs):
        calls.append(1)
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


@pytest.fixture
def checkpoint(tiny_models, tmp_path) -> Path:
    """A copy of the tiny GPT-2 checkpoint (its config.json is edited by some tests)."""
    return Path(shutil.copytree(tiny_models.checkpoint("gpt2"), tmp_path / "gpt2"))


def entries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / "ember" / "traced").glob("*.json"))


def imported(checkpoint: Path, context_window: int | None = None):
    config = imported_model_config(checkpoint)
    if context_window is not None:
        config = dataclasses.replace(config, context_window=context_window)
    return build_exported_module(checkpoint, config, "float32", CheckpointWeights(checkpoint).records)


@pytest.mark.slow
def test_a_second_import_takes_the_kept_graph(traces, checkpoint, tmp_path, monkeypatch):
    """Kept, then loaded without torch.export; a damaged entry is traced again and replaced; an entry whose time of
    use cannot be marked still loads; with the cache off, the kept entry is neither read nor replaced."""
    first_mod, first_shapes = imported(checkpoint)
    assert len(traces) == 1 and len(entries(tmp_path)) == 1
    mod, shapes = imported(checkpoint)
    assert len(traces) == 1
    assert tvm_ffi.structural_equal(mod, first_mod) and shapes == first_shapes
    assert all(isinstance(shape, tuple) for shape in shapes.values())

    (entry,) = entries(tmp_path)
    entry.write_text('{"module": "not a module", "shapes": {}}')
    mod, _ = imported(checkpoint)
    assert len(traces) == 2 and tvm_ffi.structural_equal(mod, first_mod)
    imported(checkpoint)
    assert len(traces) == 2  # the replaced entry loads

    def refused(*_args, **_kwargs):
        raise PermissionError("read-only")

    with monkeypatch.context() as readonly:  # a cache this user may read but not touch
        readonly.setattr(os, "utime", refused)
        imported(checkpoint)
    assert len(traces) == 2 and entries(tmp_path) == [entry]

    monkeypatch.setenv("EMBER_TRACE_CACHE", "0")
    kept = entry.read_bytes()
    imported(checkpoint)
    assert len(traces) == 3 and entries(tmp_path) == [entry] and entry.read_bytes() == kept


@pytest.mark.slow
def test_another_config_or_context_window_is_traced_anew(traces, checkpoint, tmp_path):
    first_mod, _ = imported(checkpoint)
    shorter, _ = imported(checkpoint, context_window=64)
    assert len(traces) == 2 and not tvm_ffi.structural_equal(shorter, first_mod)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1e-3}))
    other, _ = imported(checkpoint)
    assert len(traces) == 3 and not tvm_ffi.structural_equal(other, first_mod)
    assert len(entries(tmp_path)) == 3
