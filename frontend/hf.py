"""Import a Hugging Face checkpoint directory: config, weights, tokenizer.

The result is plain data for the next stage: a Relax IRModule whose weight
parameters carry recipes (`ember.weight_recipes`, initially "load tensor X"), the
model config, and the tokenizer files to copy into the artifact. Every tensor the
graph needs is checked against the checkpoint's headers here (present, right
shape, readable dtype) so a bad checkpoint fails before minutes of compilation.
The tokenizer files are loaded here too, as the runtime will load them, so a broken
one fails the compile rather than the first generate. A checkpoint without
`tokenizer.json` still compiles; its artifact then takes and returns token ids only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
from tokenizers import Tokenizer

from ember.core.errors import ModelError
from ember.core.files import (
    MAX_TOKENIZER_BYTES,
    check_file_size,
    optional_checkpoint_file,
    read_json_object,
    short_repr,
)
from ember.core.tokenizer_files import default_chat_template, tokenizer_json_problem
from ember.frontend.config import ModelConfig, imported_model_config, load_model_config
from ember.frontend.llama import LlamaForCausalLM
from ember.frontend.weights import CheckpointWeights
from ember.ir.attributes import CONFIG_WINDOWS_ATTR, ROPE_ATTR
from ember.ir.kv_cache import tag_library_kernels, with_cache_shape
from ember.ir.weight_recipes import set_recipes, weight_params

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


@dataclass
class ImportedModel:
    """A model in ember's graph IR, with what is needed to finish the artifact."""

    mod: tvm.IRModule
    config: ModelConfig
    weights: CheckpointWeights
    tokenizer_files: list[Path]
    model_dtype: str
    frontend: str = "builtin"  # what built the graph: ember's model definition, "torch-export" or "onnx"
    config_dir: Path | None = None  # an ONNX file's: where its config.json and tokenizer files were read


def import_hf_model(model_dir: Path, target: tvm.target.Target, model_dtype: str = "float32",
                    exported: bool = False, embeddings: bool = False) -> ImportedModel:
    """Build the Relax IRModule for the checkpoint in `model_dir`: from ember's model definition, or
    (`exported`) from the graph `torch.export` traces through transformers' (`frontend/torch_export.py`);
    `embeddings` adds the `embed` entry (ember's model definition only)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir}: not a directory (expected a Hugging Face checkpoint directory)")
    config = imported_model_config(model_dir) if exported else load_model_config(model_dir)
    weights = CheckpointWeights(model_dir)
    tokenizer_files = checked_tokenizer_files(model_dir, config)
    if exported:
        from ember.frontend.torch_export import build_exported_module  # imports torch: only when asked

        mod, shapes = build_exported_module(model_dir, config, model_dtype, weights.records)
        mod = mod.with_attr(CONFIG_WINDOWS_ATTR, list(config.layer_windows))
    else:
        mod, shapes = build_module(config, target, model_dtype, embeddings)
    for name, shape in shapes.items():
        _check_tensor(weights, name, shape)
    return ImportedModel(mod, config, weights, tokenizer_files, model_dtype, "torch-export" if exported else "builtin")


def checked_tokenizer_files(directory: Path, config: ModelConfig) -> list[Path]:
    """The tokenizer files (`TOKENIZER_FILES`) in `directory`, each loaded as the runtime will load it."""
    paths = [path for name in TOKENIZER_FILES if (path := optional_checkpoint_file(directory, name))]
    check_tokenizer_files(paths, config)
    return paths


def check_tokenizer_files(paths: list[Path], config: ModelConfig) -> None:
    """Load what the runtime will load, so that a broken tokenizer fails the compile, not the first generate."""
    for path in paths:
        if path.name == "tokenizer.json":
            check_file_size(path, MAX_TOKENIZER_BYTES)
            _check_tokenizer_bounds(path)
            try:
                tokenizer = Tokenizer.from_file(str(path))
            except (KeyboardInterrupt, SystemExit, GeneratorExit):
                raise
            except BaseException as err:  # noqa: BLE001 - a bad file: a bare Exception, or a Rust panic
                reason = str(err).strip().splitlines() or [type(err).__name__]
                raise ModelError(f"{path}: cannot load tokenizer: {reason[0]}") from None
            # Ids past the embedding's rows would be read out of bounds; a smaller vocabulary is common (Qwen2 pads).
            # The post-processor (BOS/EOS a template adds) names its ids itself, outside the vocabulary.
            post_processor = json.loads(tokenizer.to_str()).get("post_processor")
            top_id = max([*tokenizer.get_vocab(with_added_tokens=True).values(), *_token_ids_in(post_processor)],
                         default=-1)
            if top_id >= config.vocab_size:
                raise ModelError(f"{path}: has token id {top_id}, but config.json's vocab_size is {config.vocab_size}")
        elif path.name == "tokenizer_config.json":
            _check_tokenizer_config(read_json_object(path), path)
        elif path.name == "special_tokens_map.json":
            read_json_object(path)


def _check_tokenizer_bounds(path: Path) -> None:
    """Refuse a tokenizer.json whose normalizer, regexes or tokens pass `tokenizer_json_problem`'s bounds,
    which the runtime checks again at load."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return  # tokenizers says what is wrong with the file
    problem = tokenizer_json_problem(data)
    if problem:
        raise ModelError(f"{path}: {problem}")


def _token_ids_in(node: Any) -> list[int]:
    """Every integer of a tokenizer.json post-processor but its segment `type_id`s: the token ids it adds."""
    if isinstance(node, dict):
        return [i for key, value in node.items() if key != "type_id" for i in _token_ids_in(value)]
    if isinstance(node, list):
        return [i for value in node for i in _token_ids_in(value)]
    return [node] if isinstance(node, int) and not isinstance(node, bool) else []


def _check_tokenizer_config(data: dict, path: Path) -> None:
    """The keys of tokenizer_config.json the runtime reads: chat_template, bos_token, eos_token."""
    template = default_chat_template(data.get("chat_template"))
    if template is not None and not isinstance(template, str):
        raise ModelError(f"{path}: 'chat_template' must be a string or a list of {{name, template}} with a "
                         f"'default' one, got {short_repr(data['chat_template'])}")
    for key in ("bos_token", "eos_token"):
        token = data.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if data.get(key) is not None and not isinstance(token, str):
            raise ModelError(f"{path}: {key!r} must be a string or {{\"content\": string}}, "
                             f"got {short_repr(data[key])}")


def build_module(config: ModelConfig, target: tvm.target.Target, model_dtype: str,
                 embeddings: bool = False) -> tuple[tvm.IRModule, dict[str, tuple[int, ...]]]:
    """The Relax IRModule of `config` with its weight recipes (and an `embed` entry with `embeddings`), and the
    shape of each checkpoint tensor it loads.

    Needs no weights: `ember analyze --measure` rebuilds an artifact's kernels from its manifest this way.
    """
    model = LlamaForCausalLM(config, model_dtype, target)
    mod, params = model.export_tvm(spec=model.export_spec(embeddings))
    relax_names = [p.name for p in weight_params(mod["decode"])]
    recipes = {rname: {"op": "load", "name": hf_name} for rname, (hf_name, _) in zip(relax_names, params)}
    shapes = {name: tuple(int(d) for d in param.shape) for name, param in params}
    rope = {"theta": config.rope_theta, "scaling": config.rope_scaling or {}, "rotary_dim": config.head_dim}
    mod = with_cache_shape(tag_library_kernels(mod).with_attr(ROPE_ATTR, rope), model.cache_shape)
    return set_recipes(mod, recipes), shapes


def _check_tensor(weights: CheckpointWeights, name: str, shape: tuple[int, ...]) -> None:
    record = weights.record(name)
    if record.shape != shape:
        raise ModelError(
            f"{record.path}: tensor {name!r} has shape {list(record.shape)}, "
            f"but config.json implies {list(shape)}"
        )
    if record.dtype.kind not in "f" and record.dtype.name != "bfloat16":
        raise ModelError(f"{record.path}: tensor {name!r} has non-float dtype {record.dtype}")

