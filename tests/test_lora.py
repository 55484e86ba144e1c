"""LoRA adapters switched per request (`ember compile --lora-rank`, `ember serve --lora`), against transformers + peft.

Adapters are made here with `peft` on the tiny checkpoints (random, non-zero B so they change the logits), and each
compiled model's logits with an adapter are compared with the peft model's on the same weights: ember's builtin
definition (GQA, untied head; q/k/v biases, tied head) and a traced graph (MQA, head dim 64), adapters of rank 8
and 4 (plain and rsLoRA scaling, per-module ranks), at scale 1 and 0.5, every projection targeted or two. A batch
of sequences on different adapters and the base decodes in one step; a served request for each, sent together,
answers what each answers alone. Adapters that do not fit the artifact are refused in one line at start.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import artifact_cache
import models
import numpy as np
import pytest
from helpers import assert_logits_close, assert_one_line_error, run_ember

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from ember.core.errors import GenerationError, ModelError  # noqa: E402
from ember.ir_passes.add_lora_slots import DEFAULT_TARGETS, LoraSlots  # noqa: E402

RANK, SLOTS = 8, 3
PROMPT = [3 + (7 * i) % 90 for i in range(40)]  # longer than the prefill chunk: prefill runs in chunks
ALL = list(DEFAULT_TARGETS)
# name -> (rank, lora_alpha, target modules, extra LoraConfig fields)
ADAPTERS = {
    "every": (8, 16, ALL, {}),
    "qv_rslora": (4, 8, ["q_proj", "v_proj"], {"use_rslora": True}),
    "patterned": (8, 8, ["q_proj", "o_proj", "down_proj"], {"rank_pattern": {"o_proj": 2}, "alpha_pattern": {
        "down_proj": 3}}),
}
MODELS = {  # name -> (how its checkpoint is written, frontend)
    "llama": ("tiny", "builtin"),
    "qwen2": ("tiny", "builtin"),
    "llama3_mqa": ("family", "torch-export"),
}


class LoraModel:
    """A tiny checkpoint compiled with adapter slots, its peft adapters, and an engine with them loaded."""

    def __init__(self, root: Path, name: str, quantization: str = "q0f32") -> None:
        from ember.driver.compiler import CompileOptions, compile_model

        how, frontend = MODELS[name]
        self.checkpoint = root / "checkpoints" / name
        if not self.checkpoint.exists():
            if how == "tiny":
                models.write_checkpoint(name, self.checkpoint)
            else:
                models.write_config_checkpoint("llama", models.FAMILIES["llama3"][1], self.checkpoint)
        self.adapters = {adapter: self._write_adapter(root / "adapters" / name / adapter, adapter, seed)
                         for seed, adapter in enumerate(ADAPTERS)}
        self.artifact = root / "artifacts" / f"{name}-{quantization}"
        # A quantized model keeps float activations: an adapter shifts a projection's inputs across int8 rounding
        # boundaries, where no reference is continuous (the adapter term reads float inputs either way).
        options = CompileOptions(quantization=quantization, prefill_chunk=16, max_batch=6, frontend=frontend,
                                 float_activations=quantization != "q0f32", show_progress=False,
                                 lora=LoraSlots(RANK, SLOTS))
        artifact_cache.build(artifact_cache.artifact_key(f"lora-{name}-{quantization}", options, [self.checkpoint]),
                             self.artifact, lambda dest: compile_model(self.checkpoint, dest, options))
        self._engine = None

    def _write_adapter(self, path: Path, adapter: str, seed: int) -> Path:
        if not path.exists():
            rank, alpha, targets, extra = ADAPTERS[adapter]
            torch.manual_seed(seed)
            config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                                     lora_dropout=0.0, **extra)
            peft.get_peft_model(models.load_reference(self.checkpoint), config).save_pretrained(path)
        return path

    @property
    def engine(self):
        if self._engine is None:
            from ember.runtime import Engine, load_artifact

            self._engine = Engine(load_artifact(self.artifact))
            for adapter, path in self.adapters.items():
                self._engine.load_adapter(adapter, path)
        return self._engine

    def reference(self, adapter: str | None):
        base = models.load_reference(self.checkpoint)
        return base if adapter is None else peft.PeftModel.from_pretrained(base, self.adapters[adapter]).eval()

    def prefill_logits(self, adapter: str | None, scale: float = 1.0) -> np.ndarray:
        engine = self.engine
        seq = engine.add_sequence()
        try:
            engine.set_adapter(seq, adapter, scale)
            return engine.prefill(seq, PROMPT, all_logits=True)
        finally:
            engine.remove_sequence(seq)


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def lora_models(lora_root):
    built: dict[str, LoraModel] = {}

    def get(name: str, quantization: str = "q0f32") -> LoraModel:
        key = f"{name}-{quantization}"
        if key not in built:
            built[key] = LoraModel(lora_root, name, quantization)
        return built[key]

    return get


def _reference_logits(model, scale: float = 1.0, ids: list[int] = PROMPT) -> np.ndarray:
    """transformers' (and peft's) logits of `ids`, every adapter layer's scaling times `scale` (peft's scale_layer)."""
    from peft.tuners.lora import LoraLayer

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    for layer in layers:
        layer.scale_layer(scale)
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].numpy()
    finally:
        for layer in layers if scale != 1 else ():
            layer.unscale_layer(scale)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_adapter_logits_equal_peft(lora_models, name, adapter):
    model = lora_models(name)
    reference = model.reference(adapter)
    base = _reference_logits(model.reference(None))
    expected = _reference_logits(reference)
    assert np.abs(expected - base).max() > 0.05, "the adapter must change the logits for the test to mean anything"
    # Within 1e-4 absolute, the logits' own scale aside.
    for scale, logits, want in ((1.0, model.prefill_logits(adapter), expected),
                                (0.5, model.prefill_logits(adapter, 0.5), _reference_logits(reference, 0.5)),
                                (0.0, model.prefill_logits(None), base)):
        assert np.abs(logits - want).max() <= 1e-4, f"{name} with {adapter} at scale {scale}"


@pytest.mark.parametrize("name", ["llama", "llama3_mqa"])
def test_base_and_adapters_decode_in_one_batch(lora_models, name):
    model = lora_models(name)
    engine = model.engine
    choices = [None, "every", "qv_rslora", "every"]
    seqs = []
    for adapter in choices:
        seq = engine.add_sequence()
        engine.set_adapter(seq, adapter)
        engine.prefill(seq, PROMPT)
        seqs.append(seq)
    fork = engine.fork_sequence(seqs[2])  # a fork runs with its parent's adapter
    try:
        tokens = [5, 6, 7, 8, 9]
        rows = engine.decode(seqs + [fork], tokens)
        for adapter, token, row in zip(choices + ["qv_rslora"], tokens, rows):
            expected = _reference_logits(model.reference(adapter), ids=PROMPT + [token])[-1]
            assert_logits_close(row, expected, f"{name}: decode row with {adapter}")
    finally:
        for seq in seqs + [fork]:
            engine.remove_sequence(seq)


@pytest.mark.parametrize("quantization", ["q8f32", "q4f32"])
def test_quantized_weights_keep_the_adapter_float(lora_models, quantization):
    model = lora_models("llama", quantization)
    manifest = model.engine.artifact.manifest
    for entry in manifest.lora["modules"].values():
        assert manifest.param_types[entry["a"]]["dtype"] == "float32"
        assert manifest.param_types[entry["b"]]["dtype"] == "float32"
    # The reference runs ember's quantized weights with peft's adapter on top.
    from conftest import TinyModel

    quantized = TinyModel("llama", model.checkpoint, model.artifact, quantization=quantization)
    with torch.no_grad():
        base = quantized.reference(torch.tensor([PROMPT])).logits[0].numpy()
        adapted = peft.PeftModel.from_pretrained(quantized.reference, model.adapters["every"]).eval()
        expected = adapted(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(expected - base).max() > 0.05
    assert_logits_close(model.prefill_logits(None), base, f"{quantization}, base")
    assert_logits_close(model.prefill_logits("every"), expected, f"{quantization} with an adapter")


def test_served_requests_for_different_adapters_batch_together(lora_models):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from helpers import Served

    model = lora_models("llama")
    choices = [model.artifact.name, "every", "qv_rslora", "every"]
    prompts = [PROMPT[:20], PROMPT[:20], PROMPT[:20], PROMPT[:24]]
    with Served(model.artifact, adapters=model.adapters) as served:
        listed = [card.id for card in served.client.models.list().data]
        assert listed == [model.artifact.name, *ADAPTERS]

        async def one(client, index, max_tokens):
            reply = await client.completions.create(model=choices[index], prompt=prompts[index],
                                                    max_tokens=max_tokens, temperature=0)
            return reply.choices[0].text, reply.model

        together = served.concurrently(one, [(i, 8, None) for i in range(len(choices))])
        alone = [served.concurrently(one, [(i, 8, None)])[0] for i in range(len(choices))]
        assert together == alone
        assert [name for _, name in together] == choices
        assert len({text for text, _ in together[:3]}) == 3, "base and two adapters should answer differently"
        # llama-server's form: the adapter by id at a scale; 0 is the base model.
        status, by_id = served.request("POST", "/v1/completions", json.dumps({
            "model": model.artifact.name, "prompt": prompts[1], "max_tokens": 8, "temperature": 0,
            "lora": [{"id": 0, "scale": 1.0}]}).encode(), {"Content-Type": "application/json"})
        assert status == 200 and by_id["choices"][0]["text"] == alone[1][0]
        status, adapters = served.request("GET", "/lora-adapters")
        assert status == 200 and [(a["id"], a["name"]) for a in adapters] == list(enumerate(ADAPTERS))
        # Embeddings are the base model's: an adapter's name is refused rather than answered with the base's.
        status, refused = served.request("POST", "/v1/embeddings", json.dumps({
            "model": "every", "input": "hello"}).encode(), {"Content-Type": "application/json"})
        assert status == 400 and "LoRA adapter" in refused["error"]["message"]


def test_prefix_cache_does_not_share_pages_across_adapters(lora_models):
    pytest.importorskip("fastapi")
    from helpers import Served

    model = lora_models("llama")
    with Served(model.artifact, adapters=model.adapters) as served:
        def complete(name: str, prompt: list[int]) -> str:
            return served.client.completions.create(model=name, prompt=prompt, max_tokens=6,
                                                    temperature=0).choices[0].text

        fresh = complete("every", PROMPT[:30])
    with Served(model.artifact, adapters=model.adapters) as served:
        complete(model.artifact.name, PROMPT[:30] + [9])  # the base model caches the same prefix first
        assert complete("every", PROMPT[:30]) == fresh


def _edited_adapter(model: LoraModel, tmp_path: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of the "every" adapter with `config` fields set and `tensors(dict) -> dict` applied to its weights."""
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "edited"
    shutil.copytree(model.adapters["every"], path)
    if config:
        data = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**data, **config}))
    if tensors:
        weights = load_file(path / "adapter_model.safetensors")
        save_file(tensors(weights), path / "adapter_model.safetensors")
    return path


def _scaled(name: str, factor):
    return lambda weights: {key: (value * factor).astype(value.dtype) if name in key else value
                            for key, value in weights.items()}


REFUSED = {
    "DoRA": (dict(config={"use_dora": True}), "use_dora is set"),
    "trained biases": (dict(config={"bias": "all"}), "bias 'all'"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    "another PEFT type": (dict(config={"peft_type": "IA3"}), "peft_type 'IA3'"),
    "rank above the artifact's": (dict(config={"r": 16}, tensors=lambda w: {
        key: np.concatenate([value, value], axis=0 if "lora_A" in key else 1) for key, value in w.items()}),
        "rank 16, above the artifact's 8"),
    "shape of another model": (dict(tensors=lambda w: {key: value[:, :-1] if "lora_A" in key else value
                                                      for key, value in w.items()}), "on this model needs"),
    "unknown tensor": (dict(tensors=lambda w: {**w, "base_model.model.lm_head.lora_embedding_A": np.zeros(
        (8, 4), np.float32)}), "not a LoRA A or B weight"),
    "untargeted module": (dict(tensors=lambda w: {**w, "base_model.model.lm_head.lora_A.weight": np.zeros(
        (8, 64), np.float32), "base_model.model.lm_head.lora_B.weight": np.zeros((256, 8), np.float32)}),
        "module 'lm_head' has no adapter slot"),
    "NaN": (dict(tensors=_scaled("layers.0.self_attn.q_proj.lora_B", np.float32("nan"))), "NaN or infinite"),
    "integer weights": (dict(tensors=lambda w: {key: value.astype(np.int32) if "q_proj.lora_A" in key else value
                                                for key, value in w.items()}), "2-D float tensors"),
    "A without B": (dict(tensors=lambda w: {key: value for key, value in w.items()
                                            if "layers.1.mlp.up_proj.lora_B" not in key}), "without lora_B"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_adapters_that_do_not_fit_are_refused_in_one_line(lora_models, tmp_path, case):
    model = lora_models("llama")
    edits, expected = REFUSED[case]
    path = _edited_adapter(model, tmp_path, **edits)
    from ember.runtime import Engine, load_artifact

    engine = Engine(load_artifact(model.artifact))
    with pytest.raises(ModelError) as refused:
        engine.load_adapter("edited", path)
    message = str(refused.value)
    assert expected in message and "\n" not in message and "edited" in message, message
    assert engine.adapters == {}  # nothing half-loaded


def test_serve_refuses_a_bad_adapter_at_start(lora_models, tmp_path):
    model = lora_models("llama")
    path = _edited_adapter(model, tmp_path, config={"use_dora": True})
    result = run_ember("serve", str(model.artifact), "--port", "0", "--lora", f"mine={path}", timeout=120)
    assert_one_line_error(result, "LoRA adapter mine", "use_dora")
    result = run_ember("serve", str(model.artifact), "--port", "0", "--lora", f"{model.artifact.name}={path}")
    assert_one_line_error(result, "the model's own name")


def test_more_adapters_than_slots_and_unknown_names_are_refused(lora_models):
    model = lora_models("llama")
    engine = model.engine
    with pytest.raises(ModelError, match="3 adapter slots, all taken"):
        engine.load_adapter("fourth", model.adapters["every"])
    seq = engine.add_sequence()
    try:
        with pytest.raises(GenerationError, match="no LoRA adapter 'nope' is loaded"):
            engine.set_adapter(seq, "nope")
        with pytest.raises(GenerationError, match="scale must be a finite number"):
            engine.set_adapter(seq, "every", float("inf"))
    finally:
        engine.remove_sequence(seq)


@pytest.mark.parametrize(("args", "expected"), [
    (["--lora-rank", "8", "--lora-targets", "q_proj,nonexistent"], "--lora-targets nonexistent: no projection"),
    (["--lora-rank", "8", "--quant", "q0f16"], "adapters are added to float32 projections"),
    (["--lora-rank", "0"], "must be at least 1"),
    (["--lora-slots", "2"], "--lora-slots: applies only with --lora-rank"),
])
def test_compile_refuses_lora_options_it_cannot_build(lora_models, tmp_path, args, expected):
    model = lora_models("llama")
    result = run_ember("compile", str(model.checkpoint), "-o", str(tmp_path / "out"), "--no-progress", *args)
    assert_one_line_error(result, expected)
    assert not (tmp_path / "out").exists()


def test_inspect_shows_the_adapter_slots(lora_models):
    model = lora_models("llama")
    result = run_ember("inspect", str(model.artifact))
    assert result.returncode == 0, result.stderr
    assert "3 adapters of rank up to 8 on 14 modules (down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, " \
           "v_proj)" in result.stdout
    assert "adapter_slots[batch_size] int32, adapter_scales[batch_size] float32, kv_cache" in result.stdout


def test_a_tied_head_is_no_adapter_target(lora_models, tmp_path):
    """A tied head projects with the embedding table, whose PEFT adapter is an embedding's: no slot is offered."""
    model = lora_models("qwen2")
    result = run_ember("compile", str(model.checkpoint), "-o", str(tmp_path / "out"), "--no-progress",
                       "--lora-rank", "8", "--lora-targets", "embed_tokens")
    assert_one_line_error(result, "--lora-targets embed_tokens: no projection")
    assert not (tmp_path / "out").exists()
