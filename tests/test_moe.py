"""Mixture-of-experts models beyond the families table (`models.FAMILIES` runs each MoE family's float32 checks
against transformers): batches whose sequences choose different experts, quantized experts against transformers
on the same rounded weights, the kernels against numpy, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_batched_equals_solo, assert_logits_close, prompt_ids, run_ember
from models import FAMILIES, write_config_checkpoint

from ember.core.errors import ModelError


def _chosen_experts(model, ids: list[int]) -> set[tuple[int, ...]]:
    """The experts transformers' first MoE block chooses for each token of `ids`."""
    reference = model.reference
    chosen = []

    def record(_module, _args, output):
        chosen.append(output[-1])  # a router returns (logits, weights, indices)

    router = next(m for name, m in reference.named_modules() if name.endswith("mlp.gate") or name.endswith("router"))
    hook = router.register_forward_hook(record)
    try:
        with torch.no_grad():
            reference(torch.tensor([ids]))
    finally:
        hook.remove()
    return {tuple(sorted(row.tolist())) for row in chosen[0].reshape(len(ids), -1)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_four_sequences_choosing_different_experts_batch_as_they_run_alone(tiny_models, name):
    model = tiny_models.exported(name)
    prompts = [prompt_ids(n, seed=60 + n) for n in (3, 9, 17, 30)]
    steps = [prompt_ids(9, seed=70 + i)[1:] for i in range(len(prompts))]
    # The decode steps of the four sequences between them choose several different sets of experts.
    per_sequence = [_chosen_experts(model, prompt + tokens) for prompt, tokens in zip(prompts, steps)]
    assert len(set.union(*per_sequence)) >= 4, per_sequence
    assert_batched_equals_solo(model, prompts, steps, f"{name}: ")


@pytest.mark.slow
def test_sinks_join_a_forked_sequences_softmax_once(tiny_models):
    """gpt-oss's attention sinks through the runtime's partial attentions: a sequence forked from another decodes
    over its parent's pages and its own (two parts the runtime merges), and its logits are transformers' at every
    step, as are the parent's. The sink joins the part that holds the query's own key; counted in both parts, the
    logits would move."""
    model = tiny_models.exported("gpt_oss")
    prompt, parent_steps, child_steps = prompt_ids(24, seed=81), prompt_ids(6, seed=82), prompt_ids(6, seed=83)
    engine = model.engine()
    parent = engine.add_sequence()
    engine.prefill(parent, prompt)
    child = engine.fork_sequence(parent)
    parent_rows, child_rows = [], []
    for a, b in zip(parent_steps, child_steps):
        rows = engine.decode([parent, child], [a, b])
        parent_rows.append(rows[0])
        child_rows.append(rows[1])
    for what, steps, rows in (("parent", parent_steps, parent_rows), ("child", child_steps, child_rows)):
        expected = model.reference_logits(prompt + steps)[len(prompt):]
        for step, (row, reference) in enumerate(zip(rows, expected)):
            assert_logits_close(row, reference, f"gpt_oss {what}, step {step} after the fork")


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["q8f32", "q4f32"])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_quantized_experts_match_transformers_on_the_same_rounded_weights(tiny_models, name, quantization):
    """Bound: logits within 1% of their range, and the same top token at >= 95% of positions. On a CPU with an int8
    dot product every projection's activations are rounded to int8, the experts' included, and the reference
    rounds them as ember's kernels do (`int8_rounding`); what is left is float sums in another order, which can
    move a router's near tie (Qwen3-MoE: 2e-7 of the range, Mixtral q8f32: 0.5%; without the experts' rounding in
    the reference, 1-20%)."""
    model = tiny_models.exported(name, quantization)
    ids = prompt_ids(48, seed=31)
    expected = model.reference_logits(ids)
    engine = model.engine()
    got = engine.prefill(engine.add_sequence(), ids, all_logits=True)
    spread = float(expected.max() - expected.min())
    assert np.abs(got - expected).max() <= 0.01 * spread, np.abs(got - expected).max()
    assert (got.argmax(1) == expected.argmax(1)).mean() >= 0.95


def test_the_memory_plan_says_how_much_is_experts(tiny_models, tmp_path):
    """q8f32 Qwen3-MoE (8 experts of width 32, 2 a token, 2 layers of hidden 64): the experts' bytes are their
    weights at 8.5 bits, a decoded token reads a quarter of them and every other weight; a dense model has none.
    A forged figure is refused in one line."""
    import shutil

    from ember.core.errors import ArtifactError
    from ember.core.manifest import MANIFEST_NAME, manifest_digest, read_manifest

    model = tiny_models.exported("qwen3_moe", "q8f32")
    memory = read_manifest(model.artifact_dir).memory
    assert memory["expert_weight_bytes"] == 3 * 64 * 32 * 8 * 2 * 8.5 / 8
    assert memory["active_weight_bytes"] == memory["weight_bytes"] - memory["expert_weight_bytes"] * 3 / 4
    dense = read_manifest(tiny_models.exported("llama3").artifact_dir).memory
    assert (dense["expert_weight_bytes"], dense["active_weight_bytes"]) == (0, dense["weight_bytes"])
    forged = Path(shutil.copytree(model.artifact_dir, tmp_path / "forged"))
    data = json.loads((forged / MANIFEST_NAME).read_text())
    data["memory"]["expert_weight_bytes"] = data["memory"]["weight_bytes"] + 1
    data["manifest_sha256"] = manifest_digest(data)
    (forged / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="memory.expert_weight_bytes must be a whole number >= 0 no larger"):
        read_manifest(forged)


def test_loading_counts_every_expert_against_the_memory_left(tiny_models, monkeypatch):
    """A machine with room for the weights a token reads (the active experts) and the workspace, but not for every
    expert, refuses the artifact at load in one line naming the experts' share: all of them stay resident. With
    room for the weights but not the KV cache, the advice is the KV cache's; with room for all three, it loads."""
    from ember.core.errors import ArtifactError
    from ember.core.manifest import read_manifest
    from ember.runtime import artifact as loader

    model = tiny_models.exported("qwen3_moe", "q8f32")
    manifest = read_manifest(model.artifact_dir)
    memory = manifest.memory
    kv_bytes = manifest.kv_cache["max_total_tokens"] * memory["kv_bytes_per_token"]
    active_room = memory["active_weight_bytes"] + memory["peak_workspace_bytes"]
    assert active_room < memory["weight_bytes"] + memory["peak_workspace_bytes"]
    monkeypatch.setattr(loader, "available_memory", lambda: (active_room, "a test's limit"))
    experts = f"of which experts {memory['expert_weight_bytes'] / 2**20:.1f} MiB"
    with pytest.raises(ArtifactError, match=f"{experts}.*a test's limit.*its weights alone do not fit"):
        loader.load_artifact(model.artifact_dir)
    room = memory["weight_bytes"] + memory["peak_workspace_bytes"]
    monkeypatch.setattr(loader, "available_memory", lambda: (room, "a test's limit"))
    with pytest.raises(ArtifactError, match="smaller --max-batch or --memory-budget"):
        loader.load_artifact(model.artifact_dir)
    monkeypatch.setattr(loader, "available_memory", lambda: (room + kv_bytes, "a test's limit"))
    assert loader.load_artifact(model.artifact_dir).manifest.memory == memory


def test_moe_kernels_match_numpy():
    """Routing both ways, the grouping, and the expert projection in every weight format, on odd sizes."""
    import tvm

    from ember.ir.quant_formats import FORMATS
    from ember.schedules.moe import moe_group, moe_matmul, moe_route

    target = tvm.target.Target({"kind": "llvm"})
    rng = np.random.default_rng(5)
    experts, k, tokens, n, top_k = 7, 64, 5, 12, 3
    logits = rng.standard_normal((tokens, experts)).astype("float32")
    best = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    probabilities = np.exp(logits - logits.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    chosen = np.take_along_axis(logits, best, 1)
    for softmax_first, expected in ((True, np.take_along_axis(probabilities, best, 1)),
                                    (False, np.exp(chosen - chosen.max(1, keepdims=True))
                                     / np.exp(chosen - chosen.max(1, keepdims=True)).sum(1, keepdims=True))):
        route = tvm.compile(_module(moe_route(experts, top_k, softmax_first, "int64")), target)
        weights, ids = tvm.runtime.tensor(np.zeros((tokens, top_k), "float32")), tvm.runtime.tensor(
            np.zeros((tokens, top_k), "int64"))
        route["main"](tvm.runtime.tensor(logits), weights, ids)
        np.testing.assert_array_equal(ids.numpy(), best)
        np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-6, atol=1e-7)
    pair_experts = best.reshape(-1)
    group = tvm.compile(_module(moe_group(experts, "int64")), target)
    order, offsets = tvm.runtime.tensor(np.zeros(pair_experts.size, "int32")), tvm.runtime.tensor(
        np.zeros(experts + 1, "int32"))
    group["main"](tvm.runtime.tensor(pair_experts), order, offsets)
    np.testing.assert_array_equal(order.numpy(), np.argsort(pair_experts, kind="stable"))
    np.testing.assert_array_equal(offsets.numpy(), np.concatenate([[0], np.cumsum(np.bincount(pair_experts,
                                                                                              minlength=experts))]))
    x = rng.standard_normal((pair_experts.size, k)).astype("float32")
    weight = rng.standard_normal((experts * n, k)).astype("float32")
    for name in (None, "q8f32", "q4f32", "q4f32_zp"):
        fmt = FORMATS[name] if name else None
        parts = [weight] if fmt is None else list(fmt.quantize(weight).values())
        unpacked = weight if fmt is None else fmt.dequantize(fmt.quantize(weight), k)
        expected = np.stack([unpacked[e * n:(e + 1) * n] @ row for e, row in zip(pair_experts, x)])
        kernel = tvm.compile(_module(moe_matmul(fmt, experts, n, k, 256)), target)
        y = tvm.runtime.tensor(np.zeros((pair_experts.size, n), "float32"))
        kernel["main"](tvm.runtime.tensor(x), *(tvm.runtime.tensor(p) for p in parts), order, offsets, y)
        np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-4, err_msg=str(name))


def _module(kernel):
    import tvm

    return tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")})


def _moe_checkpoint(tmp_path: Path) -> Path:
    model_type, overrides = FAMILIES["qwen3_moe"]
    return write_config_checkpoint(model_type, overrides, tmp_path / "moe")


def _compile_fails(model_dir: Path, out: Path) -> str:
    result = run_ember("compile", str(model_dir), "--frontend", "torch-export", "-o", str(out), "--no-progress")
    assert result.returncode != 0 and not out.exists(), result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("ember:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.slow
def test_a_missing_or_misshapen_expert_tensor_is_one_line(tmp_path):
    from safetensors.numpy import load_file, save_file

    model_dir = _moe_checkpoint(tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    missing = "model.layers.1.mlp.experts.5.up_proj.weight"
    save_file({name: t for name, t in tensors.items() if name != missing}, model_dir / "model.safetensors",
              metadata={"format": "pt"})
    assert missing in _compile_fails(model_dir, tmp_path / "out-missing")
    misshapen = dict(tensors)
    misshapen[missing] = tensors[missing][:, :-8]
    save_file(misshapen, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert missing in _compile_fails(model_dir, tmp_path / "out-shape")


@pytest.mark.slow
def test_top_k_larger_than_the_experts_is_one_line(tmp_path):
    model_dir = _moe_checkpoint(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_experts_per_tok"] = config["num_local_experts"] + 1
    (model_dir / "config.json").write_text(json.dumps(config))
    line = _compile_fails(model_dir, tmp_path / "out")
    assert "top" in line.lower() or "experts" in line.lower(), line


class _Experts(torch.nn.Module):
    """An MoE block written by hand, traced as transformers' batched_mm experts are, with a choice of router."""

    def __init__(self, router: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.router = torch.nn.Linear(16, 4, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(4, 8, 16))
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.kind = router

    def forward(self, input_ids, use_cache=False):
        x = self.embed(input_ids)[0]
        logits = self.router(x)
        scores = {"softmax": torch.softmax(logits, -1), "raw": logits, "sigmoid_smallest": torch.sigmoid(logits)}[
            self.kind]
        values, ids = torch.topk(scores, 2, dim=-1, largest=self.kind != "sigmoid_smallest")
        rows = x.repeat_interleave(2, dim=0)
        out = torch.bmm(self.experts[ids.reshape(-1)], rows.unsqueeze(-1)).squeeze(-1)
        out = (out * values.reshape(-1, 1)).view(-1, 2, 8).sum(1)
        return self.head(out)[None]


@pytest.mark.parametrize("router, found", [("raw", "neither softmax then top-k nor top-k then softmax"),
                                           ("sigmoid_smallest", "not a router's top-k")])
def test_a_router_that_is_not_softmax_and_top_k_is_refused_naming_it(router, found):
    from ember.frontend.torch_export import import_module
    from ember.ir_passes.lower_moe import lower_moe

    mod, _shapes = import_module(_Experts(router).eval(), 16)
    with pytest.raises(ModelError, match=found) as refused:
        lower_moe(256)(mod)
    assert "topk" in str(refused.value) and "\n" not in str(refused.value)


def test_a_softmax_router_traced_by_hand_is_lowered():
    """The same block with a softmax router becomes ember's kernels: no top-k and no 3-D weight are left."""
    from ember.frontend.torch_export import import_module
    from ember.ir.module_utils import bindings, is_op
    from ember.ir_passes.lower_moe import lower_moe

    mod, _shapes = import_module(_Experts("softmax").eval(), 16)
    lowered = lower_moe(256)(mod)["forward"]
    weights = set(lowered.params[1:])
    assert not any(is_op(b.value, "relax.topk") or is_op(b.value, "relax.take") and b.value.args[0] in weights
                   and b.value.args[0].ty.ndim == 3 for b in bindings(lowered))
    assert [p.name for p in lowered.params if p.name == "experts"] == ["experts"]
    assert [tuple(int(d) for d in p.ty.shape) for p in lowered.params if p.name == "experts"] == [(32, 16)]
