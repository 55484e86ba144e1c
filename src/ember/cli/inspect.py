"""`ember inspect`: what an artifact holds, from its manifest."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ember.cli.options import mib
from ember.core.manifest import EntryFunction, signature_text


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `ember inspect` and its options."""
    parser = subparsers.add_parser(
        "inspect", help="describe an artifact",
        description="Describe an artifact from its manifest, without loading it: where it came from, the model's "
                    "shape, context window, weight format, target, entry functions' signatures, KV cache layout, "
                    "memory and files (each with the start of its sha256).",
        epilog="examples:\n  ember inspect demo-cpu\n"
               "  ember inspect demo-cpu --json | python -m json.tool   the manifest, every field",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="artifact directory written by `ember compile`")
    parser.add_argument("--json", action="store_true", help="print the raw manifest")
    return parser


def run(args: argparse.Namespace) -> int:
    """Print the artifact's manifest as a table of rows (or as JSON)."""
    from ember.core.manifest import read_manifest

    manifest = read_manifest(args.artifact)
    if args.json:
        print(json.dumps(manifest.to_json(), indent=2))
        return 0
    rows = _rows(args.artifact, manifest)
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:>{width}}  {value}")
    return 0


def _rows(artifact: Path, manifest) -> list[tuple[str, str]]:
    """The table `inspect` prints: (what, description) rows."""
    from ember.ir.quant_formats import FORMATS

    model, kv, memory = manifest.model, manifest.kv_cache, manifest.memory
    return [
        ("artifact", f"{artifact} (format {manifest.format_version}, ember {manifest.ember_version}, "
                     f"TVM {manifest.tvm_version})"),
        ("source", manifest.source),
        *_source_weight_rows(manifest.source_weights),
        *_pipeline_rows(manifest),
        ("model", f"{model['model_type']}: {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
                  f"{model['num_attention_heads']} heads / {model['num_key_value_heads']} KV heads, "
                  f"ffn {model['intermediate_size']}, vocab {model['vocab_size']}"),
        ("context", f"window {model['context_window']}, artifact allows {kv['max_context']}"
                    + (f", sliding window {kv['sliding_window']}" if kv["sliding_window"] else "")),
        ("quantization", f"{manifest.quantization} ({FORMATS[manifest.quantization].bits_per_weight:g} bits/weight, "
                         f"{manifest.model_dtype} compute){_mixed_formats(manifest)}"),
        ("target", _describe_target(manifest.target)),
        *((f"{function}()", _signature(entry)) for function, entry in manifest.entry_functions.items()),
        ("KV cache", f"paged, {kv['page_size']} tokens/page, {kv['num_layers']} layers x {kv['num_kv_heads']} "
                     f"heads x {kv['head_dim']} ({_kv_storage(kv)}); prefill chunk {kv['prefill_chunk']}, "
                     f"max batch {kv['max_batch']}, {kv['max_total_tokens']} tokens in all"),
        ("memory", f"weights {mib(memory['weight_bytes'])}, KV {memory['kv_bytes_per_token'] / 1024:.1f} KiB/token, "
                   f"workspace {mib(memory['peak_workspace_bytes'])}" + (
                       f"; experts {mib(memory['expert_weight_bytes'])}, {mib(memory['active_weight_bytes'])} "
                       "of weights read per decoded token" if memory.get("expert_weight_bytes") else "")),
        ("weights", f"{len(manifest.params)} tensors"),
        *_lora_rows(manifest),
        ("files", ", ".join(f"{name} ({entry['sha256'][:12]})" for name, entry in manifest.files.items())),
    ]


def _lora_rows(manifest) -> list[tuple[str, str]]:
    """An artifact with adapter slots: what `ember serve --lora` can load into it."""
    lora = manifest.lora
    if lora is None:
        return []
    kinds = sorted({module.rsplit(".", 1)[-1] for module in lora["modules"]})
    return [("LoRA slots", f"{lora['slots']} adapters of rank up to {lora['rank']} on {len(lora['modules'])} modules "
                           f"({', '.join(kinds)})")]


def _signature(entry: EntryFunction) -> str:
    """An entry function's arguments, then its results: "input_ids[1, seq_len] int32, kv_cache -> ..."."""
    inputs = ", ".join(map(signature_text, entry["inputs"]))
    outputs = ", ".join(map(signature_text, entry.get("outputs", [])))
    return inputs + (f" -> {outputs}" if outputs else "")


def _pipeline_rows(manifest) -> list[tuple[str, str]]:
    """For a pipeline artifact (compile --pipeline-stages) its stages, and for one of its stages which one it is:
    a stage keeps the whole model's source, so nothing else says it holds only some of the layers."""
    if manifest.pipeline is not None:
        stages = ", ".join(f"{name} (layers {first}-{end - 1})"
                           for name, (first, end) in zip(manifest.pipeline["stages"], manifest.pipeline["layers"]))
        return [("pipeline", f"{len(manifest.pipeline['stages'])} stages: {stages}")]
    stage = manifest.pipeline_stage
    if stage is None:
        return []
    first, end = stage["layers"]
    carried = {"token_ids": "token ids", "hidden": "hidden states", "logits": "logits"}
    return [("pipeline stage", f"{stage['index'] + 1} of {stage['count']} (stage-{stage['index']}): layers "
                               f"{first}-{end - 1}, takes {carried[stage['input']]}, gives {carried[stage['output']]}")]


def _describe_target(target: dict) -> str:
    if target.get("name", "cpu") == "cpu":
        return json.dumps(target["tvm_target"])
    sized = (f", sized for {target['hardware']} ({target['memory_bytes'] / 2**30:.0f} GiB)"
             if target.get("hardware") else "")
    return f"{target['name']} {target.get('arch', '')}".rstrip() + sized


def _kv_storage(kv: dict) -> str:
    """How an artifact's KV cache stores keys and values."""
    stored = {"q8": "as int8 rows, a float32 scale per token and head", "f16": "as float16 rows"}
    return f"{kv['dtype']} {stored[kv['quantization']]}" if kv["quantization"] else kv["dtype"]


def _mixed_formats(manifest) -> str:
    """For an artifact whose weights keep a GGUF file's mixed types: the formats they are stored in."""
    from ember.frontend.records import recorded_formats
    from ember.ir.quant_formats import FORMATS

    formats = sorted(set(recorded_formats(manifest.source_weights, manifest.model_dtype).values()))
    quantized = [name for name in formats if FORMATS[name].quantizes]
    return f"; per tensor as the file stores them: {', '.join(quantized)}" if len(quantized) > 1 else ""


def _source_weight_rows(record: dict) -> list[tuple[str, str]]:
    """Rows for where the graph and weights came from beyond the source path: an imported graph's
    importer; for a GGUF source its hash and what each group of its tensors became."""
    if record["format"] == "onnx":
        return [("graph", "the ONNX file's (weights from its initializers)"),
                ("config, tokenizer", str(record.get("config_dir")))]
    if record.get("frontend") == "torch-export":
        return [("graph", "traced by torch.export from transformers' code (--frontend torch-export)")]
    if record["format"] != "gguf":
        return []
    from ember.frontend.gguf import conversion_summary

    lines = conversion_summary(record.get("conversion", {}))
    return [("GGUF file", f"{record.get('file')} (sha256 {str(record.get('sha256'))[:12]})"),
            *(("GGUF weights" if i == 0 else "", line) for i, line in enumerate(lines))]
