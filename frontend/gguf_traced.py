"""A GGUF file of an architecture ember has no definition for, imported through the graph transformers traces.

`frontend/gguf.py` builds Llama and Qwen2 files with ember's own definition. Every other
architecture transformers can read from GGUF (its `integrations.ggml` mappings: Qwen3, Gemma
2 and 3, Phi-3, StarCoder2, StableLM, Falcon, GPT-2, BLOOM, Mistral, Nemotron, ...) is read
with those mappings, as `--frontend torch-export` reads a checkpoint directory:

- the config: transformers' reading of the file's metadata, written as the `config.json` the
  model is built and traced from (`frontend/torch_export.py`) and that ember reads its sizes,
  windows and token ids from (`imported_model_config`);
- the tensors: each GGUF tensor under the name of the transformers parameter it fills
  (`get_gguf_hf_weights_map` on the model's skeleton), read lazily, dequantized, and put back
  in transformers' layout by the architecture's tensor processor (Gemma's norms stored plus
  one, BLOOM's interleaved q/k/v, GPT-2's transposed projections).

Weights are re-quantized to the file's dominant format, or to `--quant`: a Q8_0 block read
back and quantized again is the same block (its scale is its largest value over 127, kept in
float16), so a Q8_0 file keeps every value; the conversion report says so per tensor.
transformers and torch are needed at compile time only, as for `--frontend torch-export`.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ember.core.errors import ModelError
from ember.frontend.config import imported_model_config
from ember.frontend.gguf import GGUFTensor, GGUFWeights, Metadata, has_experts
from ember.ir.attributes import CONFIG_WINDOWS_ATTR

# Architectures transformers reads from GGUF that are no causal decoder ember compiles (refused by the config
# check too, but by this name first).
_NOT_DECODERS = ("t5", "t5encoder", "umt5", "mamba")


# transformers' names of the architectures that llama.cpp's files spell otherwise (`general.architecture`).
_GGUF_SPELLINGS = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "minimax_m2": "minimax-m2"}


def traced_architectures() -> tuple[str, ...]:
    """The GGUF `general.architecture` values transformers maps onto a model, as llama.cpp writes them (empty
    without transformers)."""
    if importlib.util.find_spec("transformers") is None:
        return ()
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return tuple(_GGUF_SPELLINGS.get(a, a) for a in GGUF_SUPPORTED_ARCHITECTURES
                 if a not in ("general", "tokenizer", *_NOT_DECODERS))


# llama.cpp's stacked expert tensors, [experts, rows, K] (`ffn_{gate,up,down}_exps`), which transformers' mapping
# names without their ".weight" and whose gate and up fill one parameter together, gate's rows first.
_EXPERTS = re.compile(r"(?P<stem>blk\.\d+\.ffn_(?P<part>gate|up|down)_exps)\.weight")
_EXPERT_ORDER = {"gate": 0, "up": 1, "down": 0}


class TracedGGUFWeights(GGUFWeights):
    """The file's tensors under transformers' parameter names, dequantized and processed into its layout; stacked
    experts as the parameters transformers stacks them into."""

    def __init__(self, path: Path, reader, config, names: dict[str, str], shapes: dict[str, tuple[int, ...]],
                 processor, parsed: dict[str, Any]) -> None:
        self._names = names
        super().__init__(path, reader, config, hf_names=lambda name: None if _EXPERTS.fullmatch(name) else
                         names.get(name))
        self._processor, self._parsed = processor, parsed
        self._experts: dict[str, list] = {}  # parameter -> the expert tensors that fill it, in order
        for tensor in reader.tensors:
            if (match := _EXPERTS.fullmatch(tensor.name)) and match["stem"] in names:
                self._experts.setdefault(names[match["stem"]], []).append(tensor)
        for name, parts in self._experts.items():
            parts.sort(key=lambda tensor: _EXPERT_ORDER[_EXPERTS.fullmatch(tensor.name)["part"]])
            self.records[name] = GGUFTensor(name, "+".join(t.name for t in parts), parts[0].tensor_type.name,
                                            shapes.get(name, ()), np.dtype(np.float32), self.path)
        for name, record in self.records.items():
            if name in shapes:  # transformers' layout, which the processor gives (GPT-2's projections transposed)
                self.records[name] = record.__class__(record.name, record.gguf_name, record.type_name,
                                                      shapes[name], np.dtype(np.float32), record.path)

    def record(self, name: str):
        """The tensor `name`, or a `ModelError` that names it and the GGUF tensor it is read from."""
        if name not in self.records:
            stored = next((gguf_name for gguf_name, hf_name in self._names.items() if hf_name == name), "none")
            raise ModelError(f"{self.path}: tensor {name!r} (GGUF {stored!r}) is missing from the file")
        return self.records[name]

    def load(self, name: str) -> np.ndarray:
        import gguf

        record = self.record(name)
        if name in self._experts:
            return self._stacked_experts(name)
        tensor = self._tensors[name]
        values = np.asarray(gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type), np.float32)
        try:
            processed = self._processor.process(weights=values, name=record.gguf_name,
                                                tensor_key_mapping=self._names, parsed_parameters=self._parsed)
            return np.ascontiguousarray(np.asarray(processed.weights, np.float32).reshape(record.shape))
        except Exception as err:  # a tensor of another shape than the metadata makes the model's
            raise ModelError(f"{self.path}: tensor {record.gguf_name!r} ({list(values.shape)}) does not fill "
                             f"{name!r} {list(record.shape)}: {type(err).__name__}") from None

    def stored_quantization(self, name: str, bits: int, zero_point: bool) -> dict[str, np.ndarray] | None:
        """None: the blocks are read back and quantized again (the processors may reorder or change values)."""
        return None

    def _source_tensors(self, name: str) -> list:
        return self._experts.get(name) or super()._source_tensors(name)

    def _stacked_experts(self, name: str) -> np.ndarray:
        """The parameter `name` of stacked experts: its GGUF tensors dequantized ([experts, rows, K] each) and put
        one after the other along the rows (gate's, then up's)."""
        import gguf

        record = self.records[name]
        parts = [np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(
            [int(d) for d in reversed(t.shape.tolist())]) for t in self._experts[name]]
        if any(part.ndim != 3 or part.shape[0::2] != parts[0].shape[0::2] for part in parts):
            raise ModelError(f"{self.path}: expert tensors {record.gguf_name!r} ({[list(p.shape) for p in parts]}) "
                             "are not stacks of one shape")
        values = np.concatenate(parts, axis=1)
        if values.shape != tuple(record.shape):
            raise ModelError(f"{self.path}: expert tensors {record.gguf_name!r} ({list(values.shape)} together) do "
                             f"not fill {name!r} {list(record.shape)}")
        return values


def import_traced_gguf(path: Path, reader, model_dtype: str, workdir: Path):
    """The GGUF file at `path` (opened as `reader`) as the graph transformers' model for its architecture traces,
    with its tokenizer files written into `workdir`."""
    from ember.frontend.gguf_tokenizer import write_tokenizer_files
    from ember.frontend.hf import ImportedModel, _check_tensor, check_tokenizer_files
    from ember.frontend.torch_export import build_exported_module

    missing = [package for package in ("torch", "transformers") if importlib.util.find_spec(package) is None]
    if missing:
        raise ModelError(f"{path}: its architecture is read through transformers' GGUF mappings, and this Python has "
                         f"no {' and no '.join(missing)}: pip install torch==2.13.0 transformers")
    config_dir = Path(tempfile.mkdtemp(prefix="ember-gguf-config-"))
    atexit.register(shutil.rmtree, config_dir, ignore_errors=True)
    metadata = Metadata(reader, path)
    architecture = metadata.get("general.architecture", str, required=True)
    names, shapes, processor, parsed = _transformers_reading(path, config_dir, architecture, _known(metadata),
                                                             _experts_config(metadata, architecture))
    config = imported_model_config(config_dir)
    weights = TracedGGUFWeights(path, reader, config, names, shapes, processor, parsed)
    tokenizer_files = write_tokenizer_files(Metadata(reader, path), workdir)
    check_tokenizer_files(tokenizer_files, config)
    mod, traced_shapes = build_exported_module(config_dir, config, model_dtype, weights.records)
    for name, shape in traced_shapes.items():
        _check_tensor(weights, name, shape)
    mod = mod.with_attr(CONFIG_WINDOWS_ATTR, list(config.layer_windows))
    return ImportedModel(mod, config, weights, tokenizer_files, model_dtype, "torch-export")


def transformers_config(path: Path, reader) -> dict[str, Any]:
    """The config.json the model of the GGUF file at `path` (opened as `reader`) is built and traced from by
    `import_traced_gguf`: transformers' reading of its metadata, with what that leaves out (`ember analyze` reads
    a file's sizes and experts from it)."""
    missing = [package for package in ("torch", "transformers") if importlib.util.find_spec(package) is None]
    if missing:
        raise ModelError(f"{path}: its architecture is read through transformers' GGUF mappings, and this Python has "
                         f"no {' and no '.join(missing)}: pip install torch==2.13.0 transformers")
    metadata = Metadata(reader, path)
    architecture = metadata.get("general.architecture", str, required=True)
    with tempfile.TemporaryDirectory(prefix="ember-gguf-config-") as config_dir:
        _transformers_reading(path, Path(config_dir), architecture, _known(metadata),
                              _experts_config(metadata, architecture))
        return json.loads((Path(config_dir) / "config.json").read_text())


def _known(metadata: Metadata) -> dict[str, int | None]:
    """What transformers' config mapping leaves out for some architectures: BLOOM's and GPT-2's context, the head
    dim where it is not hidden / heads."""
    architecture = metadata.get("general.architecture", str, required=True)
    return {"context": metadata.get(f"{architecture}.context_length", int),
            "head_dim": metadata.get(f"{architecture}.attention.key_length", int)}


# A mixture of experts' config as llama.cpp reads the file and transformers' mapping does not: per GGUF
# architecture, config key -> the metadata key (after the architecture's prefix) that holds it, or its value where
# llama.cpp's graph fixes it (qwen3moe renormalises the chosen experts' weights, qwen2moe does not; a `llama` file
# with experts is Mixtral, which llama.cpp writes as llama).
_EXPERT_KEYS: dict[str, dict[str, str | bool]] = {
    "qwen3moe": {"moe_intermediate_size": "expert_feed_forward_length", "norm_topk_prob": True},
    "qwen2moe": {"moe_intermediate_size": "expert_feed_forward_length", "norm_topk_prob": False,
                 "shared_expert_intermediate_size": "expert_shared_feed_forward_length"},
    "llama": {"model_type": "mixtral", "num_local_experts": "expert_count",
              "num_experts_per_tok": "expert_used_count"},
}


def _experts_config(metadata: Metadata, architecture: str) -> dict[str, int | bool | str]:
    """The config of the file's experts that transformers' mapping leaves out (`_EXPERT_KEYS`; none for a file
    without experts); a missing size is one line naming its metadata key."""
    if not has_experts(metadata, architecture):
        return {}
    config: dict[str, int | bool | str] = {}
    for key, source in _EXPERT_KEYS.get(architecture, {}).items():
        config[key] = (source if isinstance(source, bool) or key == "model_type" else
                       metadata.get(f"{architecture}.{source}", int, required=True))
    return config


def _transformers_reading(path: Path, config_dir: Path, architecture: str, known: dict[str, int | None],
                          experts: dict[str, int | bool | str]):
    """transformers' reading of the file: GGUF tensor name -> parameter name, the parameters' shapes, the
    architecture's tensor processor and the parsed metadata; its config is written to `config_dir/config.json`,
    with what the file says and transformers' mapping leaves out (`known`: the context, the head dim; `experts`)."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    from ember.frontend.torch_export import quiet

    try:
        with quiet():
            parsed = load_gguf_checkpoint(str(path), return_tensors=False)
            config = dict(parsed["config"], **experts)
            model_type = config.pop("model_type")
            if known["context"] and not config.keys() & {"max_position_embeddings", "n_positions"}:
                config["n_positions" if model_type == "gpt2" else "max_position_embeddings"] = known["context"]
            hf_config = transformers.AutoConfig.for_model(model_type, **config)
            if known["head_dim"] and getattr(hf_config, "head_dim", None) not in (None, known["head_dim"]):
                hf_config.head_dim = known["head_dim"]
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(hf_config)
            processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
            names = get_gguf_hf_weights_map(model, processor, model_type=architecture)
    except Exception as err:  # transformers raises many types on metadata it does not expect; one line names it
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"{path}: transformers cannot build a {architecture!r} model from this file's metadata: "
                         f"{type(err).__name__}: {reason}") from None
    hf_config.save_pretrained(config_dir)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    return _with_stacked_gate_up(names, shapes), shapes, processor, {**parsed, "tensors": {}}


def _with_stacked_gate_up(names: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """`names` with each layer's experts' gate and up stacks (`blk.N.ffn_{gate,up}_exps`) mapped to the one
    parameter transformers holds both in (`...experts.gate_up_proj`) where its mapping leaves them out (Mixtral's,
    read through llama's tensor names)."""
    named = set(names.values())
    for parameter in shapes:
        if parameter.endswith(".experts.gate_up_proj") and parameter not in named:
            layer = re.search(r"layers\.(\d+)\.", parameter)
            if layer:
                names = {**names, f"blk.{layer[1]}.ffn_gate_exps": parameter, f"blk.{layer[1]}.ffn_up_exps": parameter}
    return names
