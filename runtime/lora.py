"""LoRA adapters in the adapter slots of an artifact (`ember compile --lora-rank`): PEFT's files, checked, each
written into a slot that sequences then name.

A PEFT LoRA adapter is a directory of `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `rank_pattern`,
`alpha_pattern`, ...) and `adapter_model.safetensors`, holding per module `base_model.model.<module>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]. PEFT computes y + lora_B(lora_A(x)) * scaling, scaling being
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). A slot holds each module's A, with zero rows past its rank
up to the artifact's, and scaling * B transposed, padded alike, in that module's rows and columns of its
projection's stacks (`schedules/lora.py`, `LoraModule`); a sequence's scale (1 by default, llama-server's
per-request `scale`) multiplies the whole term. Modules the adapter does not target stay zero in its slot.

Refused when loaded, in one line naming the adapter and what differs: files missing or malformed; another PEFT
type, DoRA, trained biases, or modules_to_save (weights an adapter replaces outright); a tensor this reading does
not know; a module the artifact has no slot for; a rank above the artifact's; a shape other than the module's;
weights that are not float, or not finite; more adapters than the artifact has slots.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ember.core.errors import GenerationError, ModelError
from ember.core.files import checkpoint_file, read_json_object, short_repr
from ember.core.manifest import LoraRecord
from ember.core.safetensors_header import TensorRecord, read_header, read_tensor
from ember.runtime.sampling import is_finite_number

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: per module its A [r, in] and scaling * B [out, r], float32."""

    name: str
    path: Path
    rank: int
    modules: dict[str, tuple[np.ndarray, np.ndarray]]


def read_adapter(name: str, path: Path, lora: LoraRecord) -> LoraAdapter:
    """The PEFT adapter in directory `path`, checked against the artifact's adapter slots `lora`."""
    path = Path(path)
    where = f"LoRA adapter {name} ({path})"
    if not path.is_dir():
        raise ModelError(f"{where}: not a directory (expected a PEFT adapter: {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = read_json_object(checkpoint_file(path, CONFIG_FILE))
    _check_config(where, config)
    records: dict[str, dict[str, TensorRecord]] = {}
    for record in read_header(checkpoint_file(path, WEIGHTS_FILE)):
        match = _TENSOR_NAME.fullmatch(record.name)
        if match is None:
            raise ModelError(f"{where}: tensor {short_repr(record.name)} is not a LoRA A or B weight "
                             "(base_model.model.<module>.lora_A.weight / lora_B.weight); ember loads plain LoRA "
                             "adapters")
        records.setdefault(match["module"], {})[match["part"]] = record
    if not records:
        raise ModelError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    modules, ranks = {}, set()
    for module, parts in records.items():
        slot = lora["modules"].get(module)
        if slot is None:
            compiled = sorted({m.rsplit(".", 1)[-1] for m in lora["modules"]})
            raise ModelError(f"{where}: module {short_repr(module)} has no adapter slot in this artifact (compiled "
                             f"with --lora-targets {','.join(compiled)})")
        if set(parts) != {"A", "B"}:
            raise ModelError(f"{where}: module {module} has lora_{''.join(parts)} without "
                             f"lora_{'B' if 'A' in parts else 'A'}")
        rank = _pattern_value(where, config.get("rank_pattern"), module, config["r"])
        alpha = _pattern_value(where, config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
        a, b = (_float_tensor(where, parts[part]) for part in ("A", "B"))
        if a.shape != (rank, slot["input"]) or b.shape != (slot["output"], rank):
            raise ModelError(f"{where}: module {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                             f"rank {rank} on this model needs [{rank}, {slot['input']}] and "
                             f"[{slot['output']}, {rank}]")
        if rank > lora["rank"]:
            raise ModelError(f"{where}: module {module} has rank {rank}, above the artifact's {lora['rank']} "
                             f"(recompile with --lora-rank {rank} or more)")
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora", False) else rank)
        modules[module] = (a, (b * np.float32(scaling)).astype(np.float32))
        ranks.add(rank)
    return LoraAdapter(name, path, max(ranks), modules)


def _check_config(where: str, config: dict[str, Any]) -> None:
    """Refuse an adapter config that is not a plain LoRA adapter's, in one line naming the field."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelError(f"{where}: peft_type {short_repr(config.get('peft_type'))}; ember loads LORA adapters")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ModelError(f"{where}: {CONFIG_FILE} field r must be a positive integer, got {short_repr(rank)}")
    alpha = config.get("lora_alpha", 8)
    if not is_finite_number(alpha):
        raise ModelError(f"{where}: {CONFIG_FILE} field lora_alpha must be a number, got {short_repr(alpha)}")
    for flag, what in (("use_dora", "DoRA (weight-decomposed) adapters"), ("lora_bias", "trained LoRA biases")):
        if config.get(flag):
            raise ModelError(f"{where}: {flag} is set; ember loads plain LoRA adapters, not {what}")
    if config.get("bias", "none") != "none":
        raise ModelError(f"{where}: bias {short_repr(config.get('bias'))}: the adapter trained the model's biases; "
                         "ember loads adapters with bias \"none\"")
    if config.get("modules_to_save"):
        raise ModelError(f"{where}: modules_to_save {short_repr(config['modules_to_save'])}: the adapter replaces "
                         "whole modules, which adapter slots cannot hold")
    if not isinstance(config.get("use_rslora", False), bool):
        raise ModelError(f"{where}: {CONFIG_FILE} field use_rslora must be true or false")


def _pattern_value(where: str, patterns: Any, module: str, default: float) -> Any:
    """PEFT's `rank_pattern` / `alpha_pattern` lookup: the value of the first key matching the end of `module`."""
    if patterns is None:
        return default
    if not isinstance(patterns, dict):
        raise ModelError(f"{where}: a rank or alpha pattern must map module names to numbers")
    for key, value in patterns.items():
        try:
            matched = re.match(rf"(.*\.)?({key})$", module)
        except re.error as err:
            raise ModelError(f"{where}: pattern {short_repr(key)} is not a regular expression: {err}") from None
        if matched:
            if not is_finite_number(value) or value <= 0:
                raise ModelError(f"{where}: pattern {short_repr(key)} maps to {short_repr(value)}, not a positive "
                                 "number")
            return value
    return default


def _float_tensor(where: str, record: TensorRecord) -> np.ndarray:
    if record.dtype not in _FLOAT_DTYPES or len(record.shape) != 2:
        raise ModelError(f"{where}: tensor {record.name} is {record.dtype} {list(record.shape)}; LoRA weights are "
                         "2-D float tensors")
    tensor = read_tensor(record).astype(np.float32)
    if not np.isfinite(tensor).all():
        raise ModelError(f"{where}: tensor {record.name} holds NaN or infinite values")
    return tensor


def check_adapter_choice(loaded: tuple[str, ...], name: str, scale: float) -> None:
    """Refuse a request's adapter that is not among the `loaded` ones, or a scale that is no finite number."""
    if name not in loaded:
        raise GenerationError(f"no LoRA adapter {name!r} is loaded"
                              + (f" (loaded: {', '.join(loaded)})" if loaded else " (start `ember serve --lora`)"))
    if not is_finite_number(scale):
        raise GenerationError(f"LoRA adapter {name}: scale must be a finite number, got {scale!r}")


class AdapterSlots:
    """The adapters loaded into an artifact's slots, by name: `load` fills the next free slot."""

    def __init__(self, lora: LoraRecord, stacks: dict[str, np.ndarray]) -> None:
        self.lora = lora
        self._stacks = stacks
        self.adapters: dict[str, tuple[int, LoraAdapter]] = {}  # name -> (slot, adapter)

    def load(self, name: str, path: Path) -> int:
        """Read and check the adapter at `path` and write it into a free slot; its slot."""
        if name in self.adapters:
            raise ModelError(f"LoRA adapter {name}: a second adapter of that name")
        if len(self.adapters) >= self.lora["slots"]:
            raise ModelError(f"LoRA adapter {name} ({path}): the artifact has {self.lora['slots']} adapter slots, "
                             f"all taken; recompile with a larger --lora-slots")
        adapter = read_adapter(name, path, self.lora)
        slot = len(self.adapters)
        rank = self.lora["rank"]
        for module, entry in self.lora["modules"].items():
            rows = slice(entry["a_row"], entry["a_row"] + rank)
            columns = slice(entry["b_column"], entry["b_column"] + entry["output"])
            a_stack, b_stack = self._stacks[entry["a"]], self._stacks[entry["b"]]
            a_stack[slot, rows] = 0
            b_stack[slot, :, columns] = 0
            if module in adapter.modules:
                a, b = adapter.modules[module]
                a_stack[slot, entry["a_row"]:entry["a_row"] + a.shape[0]] = a
                b_stack[slot, :b.shape[1], columns] = b.T
        self.adapters[name] = (slot, adapter)
        return slot

    def slot(self, name: str) -> int:
        """The slot of the adapter loaded as `name`."""
        return self.adapters[name][0]
