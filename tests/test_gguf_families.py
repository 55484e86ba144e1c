"""GGUF files of architectures beyond Llama and Qwen2, mixtures of experts among them (`frontend/gguf_traced.py`),
written by llama.cpp's own converter from the same tiny weights as a checkpoint directory.

The F32 file must compile to exactly the logits of the checkpoint compiled through torch.export (same
weights, same graph), and the Q8_0 file keep every block as llama.cpp wrote it (read back and quantized
again, a Q8_0 block is the same block), its logits within the format's rounding of the float ones.
llama.cpp's own greedy tokens on the F32 file are matched where llama.cpp runs the architecture. Configs keep
to what GGUF stores: no window layout other than the family's default (a GGUF file holds one window and no
layer types).
"""

from __future__ import annotations

import gguf_files
import models
import numpy as np
import pytest
from helpers import prompt_ids, run_ember

from ember.driver.compiler import CompileOptions, compile_model
from ember.runtime import Engine, SamplingParams, generate, load_artifact

pytestmark = pytest.mark.slow
_GQA = dict(models._GQA)
# name -> (transformers model type, config): six architectures ember has no definition for.
GGUF_FAMILIES = {
    "qwen3": ("qwen3", dict(_GQA, head_dim=32)),
    "stablelm": ("stablelm", dict(_GQA)),
    "gemma3": ("gemma3_text", dict(_GQA, head_dim=32, sliding_window=models.WINDOW)),  # every layer local here
    "starcoder2": ("starcoder2", dict(_GQA)),
    "gpt2": ("gpt2", dict(models.EXPORTED_MODELS["gpt2"], n_ctx=256)),
    "bloom": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4, seq_length=256)),  # ALiBi
    # Mixtures of experts, stacked per layer in the file (`ffn_{gate,up,down}_exps`): Qwen3-MoE, Qwen2-MoE with its
    # shared expert, and Mixtral, which llama.cpp writes as `llama` with an expert count.
    "qwen3moe": models.FAMILIES["qwen3_moe"],
    "qwen2moe": models.FAMILIES["qwen2_moe"],
    "mixtral": ("mixtral", {k: v for k, v in models.FAMILIES["mixtral"][1].items() if k != "sliding_window"}),
}
PROMPT = 3 * models.WINDOW


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families")
    return {name: models.write_config_checkpoint(model_type, overrides, root / name)
            for name, (model_type, overrides) in GGUF_FAMILIES.items()}


def _logits(model, quantization: str | None, out) -> np.ndarray:
    """Prefill logits of `model` (a GGUF file or a checkpoint directory) compiled with `quantization` (None: the
    GGUF file's own)."""
    frontend = "builtin" if str(model).endswith(".gguf") else "torch-export"
    compile_model(model, out, CompileOptions(quantization=quantization, prefill_chunk=64, max_batch=1,
                                             frontend=frontend, show_progress=False))
    engine = Engine(load_artifact(out))
    return engine.prefill(engine.add_sequence(), prompt_ids(PROMPT, seed=31), all_logits=True)


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_an_f32_file_compiles_to_the_checkpoints_logits(checkpoints, tmp_path, name):
    path = gguf_files.convert(checkpoints[name], "f32", pre="gpt-2")
    ours, theirs = _logits(path, None, tmp_path / "gguf"), _logits(checkpoints[name], "q0f32", tmp_path / "st")
    assert np.abs(ours - theirs).max() <= 1e-6 * np.abs(theirs).max()
    manifest = load_artifact(tmp_path / "gguf").manifest
    assert manifest.source_weights["format"] == "gguf" and manifest.quantization == "q0f32"


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_a_q8_0_file_keeps_its_blocks(checkpoints, tmp_path, name):
    """Each Q8_0 block read back and quantized again is the block llama.cpp wrote (the conversion report measures
    no error), and the logits stay as close to the float checkpoint's as ember's own q8f32 of it does (llama.cpp
    rounds its blocks its own way, so the two 8-bit models differ by their rounding)."""
    path = gguf_files.convert(checkpoints[name], "q8_0", pre="gpt-2")
    ours = _logits(path, None, tmp_path / "gguf")
    exact, own = (_logits(checkpoints[name], quant, tmp_path / quant) for quant in ("q0f32", "q8f32"))
    assert np.abs(ours - exact).max() <= 2.5 * np.abs(own - exact).max() + 1e-6 * np.abs(exact).max()
    report = load_artifact(tmp_path / "gguf").manifest.source_weights["conversion"]
    q8 = [entry for entry in report.values() if entry["gguf_type"] == "Q8_0"]
    assert q8 and all(entry["stored_as"] == "q8f32" and entry["relative_rms_error"] == 0.0 for entry in q8)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", ["qwen3", "stablelm", "starcoder2", "gpt2", "bloom", "qwen3moe", "qwen2moe",
                                  "mixtral"])
def test_greedy_tokens_equal_llama_cpps_on_the_same_file(checkpoints, tmp_path, name):
    path = gguf_files.convert(checkpoints[name], "f32", pre="gpt-2")
    compile_model(path, tmp_path / "art", CompileOptions(prefill_chunk=64, max_batch=1, show_progress=False))
    ids = prompt_ids(PROMPT, seed=32)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=())
    tokens = list(generate(Engine(load_artifact(tmp_path / "art")), ids, params).tokens())
    assert tokens == gguf_files.greedy(path, ids, 16)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_a_q8_0_mixture_of_experts_predicts_llama_cpps_tokens(checkpoints, tmp_path, name):
    """Teacher-forced over 256 tokens, ember's next-token choice on a Q8_0 file is llama.cpp's own on that file at
    95% of positions or more (the two round activations differently, which can flip a near-tied expert choice)."""
    path = gguf_files.convert(checkpoints[name], "q8_0", pre="gpt-2")
    compile_model(path, tmp_path / "art", CompileOptions(prefill_chunk=64, max_batch=1, show_progress=False))
    engine = Engine(load_artifact(tmp_path / "art"))
    ids = prompt_ids(256, seed=33)
    ours = engine.prefill(engine.add_sequence(), ids, all_logits=True)
    agreement = float(np.mean(ours.argmax(axis=1) == gguf_files.logits(path, ids).argmax(axis=1)))
    assert agreement >= 0.95, f"top-1 agreement {agreement:.3f}"


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "mixtral"])
def test_analyze_reads_a_gguf_mixture_of_experts_with_its_experts(checkpoints, name):
    """`ember analyze FILE.gguf` reads a file's experts as compile does: the same count, top-k, width and shared
    expert as the checkpoint it was converted from, and says how much of the weights a token reads."""
    from ember.driver.analyze.operators import load_architecture

    path = gguf_files.convert(checkpoints[name], "f32", pre="gpt-2")
    ours, theirs = load_architecture(str(path)), load_architecture(str(checkpoints[name]))
    sizes = lambda arch: (arch.num_experts, arch.experts_per_token, arch.expert_width,  # noqa: E731
                          arch.shared_expert_intermediate_size, arch.config.num_hidden_layers, arch.config.hidden_size)
    assert sizes(ours) == sizes(theirs) and ours.num_experts > 1
    result = run_ember("analyze", str(path), "--hardware", "raspberry-pi-5")
    assert result.returncode == 0, result.stderr
    assert f"of which a token reads {theirs.experts_per_token} of {theirs.num_experts}" in result.stdout


def _metadata_only_gguf(path, architecture: str, counts: dict[str, int] | None = None):
    """A GGUF file of `architecture` with `counts` (uint32 metadata) and one small tensor, written by gguf-py."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in (counts or {}).items():
        writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_architecture_neither_ember_nor_transformers_reads_is_refused(tmp_path):
    """One line naming the architecture and the ones that are read."""

    from ember.core.errors import ModelError
    from ember.frontend.gguf import import_gguf_model

    path = _metadata_only_gguf(tmp_path / "rwkv.gguf", "rwkv6")
    with pytest.raises(ModelError, match=r"general.architecture 'rwkv6' is not supported; supported: llama, qwen2, "):
        import_gguf_model(path, None, "float32", tmp_path)


@pytest.mark.parametrize(("architecture", "key"), [("qwen3moe", "qwen3moe.expert_feed_forward_length"),
                                                   ("llama", "llama.expert_used_count")])
def test_a_mixture_of_experts_without_its_expert_sizes_is_one_line(tmp_path, architecture, key):
    """A file that counts experts but leaves out what transformers' mapping does not read is refused naming the
    metadata key, before transformers builds anything from it."""

    from ember.core.errors import ModelError
    from ember.frontend.gguf import import_gguf_model

    path = _metadata_only_gguf(tmp_path / "experts.gguf", architecture, {f"{architecture}.expert_count": 4})
    with pytest.raises(ModelError, match=rf"^{path}: .*{key}"):
        import_gguf_model(path, None, "float32", tmp_path)


@pytest.mark.parametrize(("architecture", "counts", "named"), [
    ("qwen3", None, "'qwen3'"), ("llama", {"llama.expert_count": 4}, "'llama' with experts")])
def test_without_transformers_a_file_it_would_read_says_to_install_it(tmp_path, monkeypatch, architecture, counts,
                                                                       named):
    """Where transformers is not installed (a runtime-only or serve-only install), a file of an architecture that
    only transformers' mappings read is one line saying so and how to install it, not "not supported"."""
    from ember.core.errors import ModelError
    from ember.frontend import gguf_traced
    from ember.frontend.gguf import import_gguf_model

    monkeypatch.setattr(gguf_traced, "traced_architectures", lambda: ())
    path = _metadata_only_gguf(tmp_path / f"{architecture}.gguf", architecture, counts)
    with pytest.raises(ModelError, match=rf"^{path}: general.architecture {named} is read through transformers' "
                                         r"GGUF mappings, and this Python has no transformers: pip install"):
        import_gguf_model(path, None, "float32", tmp_path)


def test_measure_rebuilds_a_gguf_mixture_of_experts_as_compile_built_it(checkpoints, tmp_path):
    """`ember analyze --measure` rebuilds an artifact's kernels from its source to time them: a GGUF file read through
    transformers' mappings (here a Q8_0 Qwen3-MoE) is read again that way, not built with ember's own definition of
    a dense model, so every kernel the artifact ran is found (it said "its kernels differ" before)."""
    from ember.driver.analyze.measure import measure
    from ember.targets.hardware import Hardware

    path = gguf_files.convert(checkpoints["qwen3moe"], "q8_0", pre="gpt-2")
    compile_model(path, tmp_path / "art", CompileOptions(prefill_chunk=64, max_batch=1, show_progress=False))
    generous = Hardware("generous", "generous", "cpu", {"fp32": 1e14}, memory_bandwidth=1e13, memory_capacity=1e12,
                        onchip_memory=2**20, source="test")
    m = measure(tmp_path / "art", prompt_len=16, batch=1, repeats=1, hardware=generous)
    expert_kernels = [k for k in m.decode.kernels if set(k.implements) & {"gate_proj", "down_proj"}]
    assert sum(k.calls for k in expert_kernels) == 2 * m.arch.config.num_hidden_layers
    assert "router" in {name for k in m.decode.kernels for name in k.implements}
