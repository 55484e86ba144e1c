"""The mask each attention applies is proven, not sampled, and never compiled wrong.

`specialize_attention` evaluates every mask of an imported graph at lengths past every window the
config names and accepts only a causal mask or a causal sliding window, the same at every length and
equal to what the config says of that layer. These tests feed it masks that are almost right (a
window off by one, a band without its causal part, a window the config does not name, a config
window the graph does not apply) and check each is refused in one line naming the layer, and that a
window compiled off by one would fail the comparison with transformers: the checks can fail. The same for
gpt-oss's attention sinks: a column beside the scores other than one learned logit per head is refused, and sinks
moved to other heads or dropped fail the comparison.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tvm
from helpers import assert_logits_close, prompt_ids
from models import WINDOW

from ember.core.errors import ModelError
from ember.frontend.config import layer_windows


def _band(n: int, window: int, causal: bool = True) -> np.ndarray:
    query, key = np.indices((n, n))
    visible = (query - key < window) & (key <= query if causal else key - query < window)
    return np.where(visible, 0.0, -np.inf)[None, None]


@pytest.mark.parametrize("n, window, expected", [
    (40, 16, 16), (40, 1, 1), (40, 39, 39),  # windows shorter than the probe
    (16, 16, 0), (10, 16, 0),  # a window the probe does not reach looks causal at that length
])
def test_mask_window_reads_a_causal_window(n, window, expected):
    from ember.ir_passes.specialize_attention import mask_window

    assert mask_window(_band(n, window)) == expected


def test_mask_window_refuses_every_other_mask():
    from ember.ir_passes.specialize_attention import mask_window

    causal = _band(24, 24)
    assert mask_window(causal) == 0
    assert mask_window(_band(24, 8, causal=False)) is None  # a band without its causal part
    shifted = np.where(np.tri(24, k=-1, dtype=bool), 0.0, -np.inf)[None, None]
    assert mask_window(shifted) is None  # a query that cannot see itself
    per_head = np.concatenate([_band(24, 8), _band(24, 9)], axis=1)
    assert mask_window(per_head) is None  # windows that differ by head
    biased = causal + np.where(causal == 0, -0.5, 0.0)
    assert mask_window(biased) is None  # a bias on the visible keys (ALiBi)
    holed = causal.copy()
    holed[..., 20, 3] = -np.inf
    assert mask_window(holed) is None  # one key hidden inside the window


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "mistral", "sliding_window": 8}, (8, 8, 8, 8)),
    ({"model_type": "mistral"}, ()),
    ({"model_type": "gemma3_text", "sliding_window": 8,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]}, (8, 0, 8, 8)),
    ({"model_type": "gemma2", "sliding_window": 8}, (8, 0, 8, 0)),  # alternating, as its code does without types
    ({"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 2}, (8, 0, 8, 0)),
    ({"model_type": "cohere2", "sliding_window": 8}, (8, 8, 8, 0)),
    ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False}, ()),  # carried, unused
    ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2}, (0, 0, 8, 8)),
    ({"model_type": "gemma3_text", "layer_types": ["sliding_attention"] * 4}, ()),  # no window: whole context
])
def test_layer_windows_reads_each_familys_config(config, expected):
    assert layer_windows(config, 4) == expected


def test_layer_windows_refuses_a_layer_type_it_does_not_compile():
    with pytest.raises(ModelError, match="'layer_types' has 'chunked_attention'"):
        layer_windows({"model_type": "llama4", "sliding_window": 8, "layer_types": ["chunked_attention"] * 2}, 2)
    with pytest.raises(ModelError, match="'layer_types' names 3 layers, the model has 2"):
        layer_windows({"model_type": "gemma3_text", "layer_types": ["full_attention"] * 3}, 2)


def _decoder(mask_of):
    """A one-layer decoder whose attention adds `mask_of(n)` ([n, n], built from the length as a model's code
    builds it) to its scores."""
    import torch

    return _one_layer(lambda _model, q, k, v, n: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask_of(n)))


def _one_layer(attend, **weights):
    """A one-layer decoder (2 heads of 8) whose attention is `attend(model, q, k, v, n)` ([1, heads, n, 8] each),
    with the extra `weights` (name: values) as parameters."""
    import torch

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(32, 16)
            self.qkv = torch.nn.Linear(16, 48)
            self.head = torch.nn.Linear(16, 32)
            for name, values in weights.items():
                self.register_parameter(name, torch.nn.Parameter(torch.tensor(values)))

        def forward(self, input_ids, use_cache=False):
            n = input_ids.shape[1]
            q, k, v = (t.view(1, n, 2, 8).transpose(1, 2) for t in self.qkv(self.embed(input_ids)).split(16, -1))
            return self.head(attend(self, q, k, v, n).transpose(1, 2).reshape(1, n, 16))

    return Decoder().eval()


def _band_mask(window: int, causal: bool = True):
    import torch

    def mask_of(n):
        positions = torch.arange(n)
        distance = positions[:, None] - positions[None, :]
        visible = (distance < window) & ((distance >= 0) if causal else (distance > -window))
        return torch.where(visible, 0.0, float("-inf"))

    return mask_of


def _specialize(model, config_windows: list[int] | None):
    from ember.frontend.torch_export import import_module
    from ember.ir.attributes import CONFIG_WINDOWS_ATTR
    from ember.ir_passes.specialize_attention import specialize_attention

    mod, _shapes = import_module(model, max_seq_len=64)
    if config_windows is not None:
        mod = mod.with_attr(CONFIG_WINDOWS_ATTR, config_windows)
    return specialize_attention(tvm.target.Target("llvm"))(mod)


def test_a_window_the_config_names_is_compiled():
    from ember.ir.kv_cache import recorded_layer_windows

    assert recorded_layer_windows(_specialize(_decoder(_band_mask(8)), [8])) == (8,)


@pytest.mark.parametrize("graph_window, config_windows, words", [
    (8, [9], "the graph's mask is a sliding window of 8 tokens, and the config says a sliding window of 9 tokens"),
    (8, [7], "the graph's mask is a sliding window of 8 tokens, and the config says a sliding window of 7 tokens"),
    (8, None, "the graph's mask is a sliding window of 8 tokens, and the config says causal over the whole context"),
    (0, [8], "the graph's mask is causal over the whole context, and the config says a sliding window of 8 tokens"),
], ids=["window-plus-one", "window-minus-one", "window-the-config-does-not-name", "config-window-not-applied"])
def test_a_mask_that_disagrees_with_the_config_is_refused_naming_the_layer(graph_window, config_windows, words):
    mask = _band_mask(graph_window) if graph_window else _band_mask(64)
    with pytest.raises(ModelError, match="attention layer 0 ") as caught:
        _specialize(_decoder(mask), config_windows)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def _alibi_mask(slopes: list[float], window: int = 0):
    """BLOOM's way: each head's scores gain slope * key position, and a causal mask (through `window` if given)."""
    import torch

    def mask_of(n):
        positions = torch.arange(n)
        distance = positions[:, None] - positions[None, :]
        visible = (distance >= 0) & ((distance < window) if window else True)
        bias = torch.tensor(slopes)[:, None, None] * positions[None, None, :].float()
        return torch.where(visible, 0.0, float("-inf")) + bias

    return mask_of


def test_alibi_slopes_are_read_per_head_and_with_a_window():
    from ember.ir.kv_cache import recorded_layer_windows, recorded_scores

    compiled = _specialize(_decoder(_alibi_mask([0.5, 0.125])), None)
    assert recorded_scores(compiled)[1] == pytest.approx((0.5, 0.125))
    windowed = _specialize(_decoder(_alibi_mask([0.25, 0.0625], window=8)), [8])
    assert recorded_scores(windowed)[1] == pytest.approx((0.25, 0.0625)) and recorded_layer_windows(windowed) == (8,)


def test_a_bias_that_is_not_linear_in_the_distance_is_refused():
    import torch

    def squared(n):
        positions = torch.arange(n).float()
        distance = positions[:, None] - positions[None, :]
        return torch.where(distance >= 0, -0.01 * distance * distance, float("-inf"))

    with pytest.raises(ModelError, match="biases the scores otherwise than by distance"):
        _specialize(_decoder(squared), None)


def test_a_band_without_its_causal_part_is_refused():
    with pytest.raises(ModelError, match="the attention mask is neither causal nor a sliding window"):
        _specialize(_decoder(_band_mask(8, causal=False)), [8])


def test_a_reduction_over_the_tokens_outside_attention_is_refused():
    """longrope picks its factors by the longest position, a reduction over the tokens (here a mean), which would mix
    a decode batch's sequences, run as one row of tokens."""
    import torch

    model = _decoder(_band_mask(64))
    embed = model.embed

    class OverTheTokens(torch.nn.Module):
        def forward(self, input_ids):
            x = embed(input_ids)
            return x * x.mean(dim=1, keepdim=True)

    model.embed = OverTheTokens()
    with pytest.raises(ModelError, match=r"prefill: .* = mean over the sequence's tokens, outside attention"):
        _specialize(model, None)


def _prefill_leaves_transformers(model, model_dir, out_dir, what: str):
    """The checkpoint at `model_dir` compiled (q0f32, through torch.export) into `out_dir`: at a prompt of three
    windows its logits leave transformers' on `model`'s weights by more than the families' bound. Its engine."""
    from ember.driver.compiler import CompileOptions, compile_model
    from ember.runtime import Engine, load_artifact

    compile_model(model_dir, out_dir, CompileOptions(
        quantization="q0f32", prefill_chunk=64, max_batch=1, frontend="torch-export", show_progress=False))
    engine = Engine(load_artifact(out_dir))
    ids = prompt_ids(3 * WINDOW, seed=21)
    seq = engine.add_sequence()
    with pytest.raises(AssertionError, match="max abs diff"):
        assert_logits_close(engine.prefill(seq, ids, all_logits=True), model.reference_logits(ids), what)
    return engine


@pytest.mark.slow
def test_a_window_compiled_off_by_one_fails_the_comparison(tiny_models, tmp_path, monkeypatch):
    """The families' bound detects a window one token too long: with the graph's and the config's reading both
    moved by one (so the compile accepts it), the logits at a prompt of three windows leave transformers' by more
    than the bound."""
    from ember.frontend import config
    from ember.ir_passes import specialize_attention

    model = tiny_models.exported("starcoder2")
    read_window, read_mask = config.layer_windows, specialize_attention.mask_window
    monkeypatch.setattr(config, "layer_windows", lambda *args: tuple(w + 1 if w else 0 for w in read_window(*args)))
    monkeypatch.setattr(specialize_attention, "mask_window",
                        lambda values: (lambda w: w + 1 if w else w)(read_mask(values)))
    engine = _prefill_leaves_transformers(model, model.model_dir, tmp_path / "off-by-one", "off by one")
    assert engine.artifact.manifest.model["layer_windows"] == [WINDOW + 1, WINDOW + 1]


@pytest.mark.slow
def test_alibi_slopes_off_by_a_little_fail_the_comparison(tiny_models, tmp_path, monkeypatch):
    """The families' bound detects ALiBi slopes 2% too steep (the check can fail)."""
    from ember.ir_passes import specialize_attention

    model = tiny_models.exported("bloom")
    read = specialize_attention.distance_slopes
    monkeypatch.setattr(specialize_attention, "distance_slopes",
                        lambda *args: tuple(1.02 * s for s in read(*args) or ()) or read(*args))
    _prefill_leaves_transformers(model, model.model_dir, tmp_path / "steeper", "steeper")


def _sink_decoder(column_of):
    """A one-layer decoder whose causal attention joins `column_of(model, n)` ([1, heads, n, 1]) to its scores as
    gpt-oss joins its sinks: the column in the softmax, its probabilities dropped after it."""
    import torch

    def attend(model, q, k, v, n):
        positions = torch.arange(n)
        causal = torch.where(positions[None, :] <= positions[:, None], 0.0, float("-inf"))
        logits = torch.cat([q @ k.transpose(2, 3) / 8**0.5 + causal, column_of(model, n)], dim=-1)
        return torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1] @ v

    return _one_layer(attend, sinks=[0.5, -1.0], shared_sink=[0.25])


def test_sinks_written_as_gpt_oss_writes_them_reach_the_cache():
    """The sinks' column, the maximum subtracted before the softmax and the slice after it become attention over
    the cache with the sinks in a carrier head per KV head (2 query heads + 2 carriers)."""
    from ember.frontend.torch_export import import_module
    from ember.ir.kv_cache import recorded_sinks
    from ember.ir.module_utils import bindings, is_op
    from ember.ir_passes.specialize_attention import KV_ATTENTION, specialize_attention
    from ember.ir_passes.tidy_traced_graph import tidy_traced_graph

    mod, _shapes = import_module(_sink_decoder(lambda self, n: self.sinks.reshape(1, -1, 1, 1).expand(1, -1, n, -1)),
                                 max_seq_len=64)
    specialized = specialize_attention(tvm.target.Target("llvm"))(tidy_traced_graph(mod))
    assert recorded_sinks(specialized)
    calls = [b.value for b in bindings(specialized["decode"]) if is_op(b.value, "relax.call_dps_packed")
             and b.value.args[0].global_symbol == KV_ATTENTION]
    assert [int(c.ty.shape[1]) for c in calls] == [4]


@pytest.mark.parametrize("column_of, words", [
    (lambda self, n: self.sinks.new_zeros(1, 2, n, 1), "not a weight of one logit per head"),
    (lambda self, n: 2.0 * self.sinks.reshape(1, -1, 1, 1).expand(1, -1, n, -1), "not a weight of one logit per head"),
    (lambda self, n: self.shared_sink.reshape(1, 1, 1, 1).expand(1, 2, n, -1), "for 2 heads; ember takes one sink "),
], ids=["constant column", "scaled sinks", "one sink for all heads"])
def test_a_column_beside_the_scores_that_is_not_per_head_sinks_is_refused(column_of, words):
    from ember.frontend.torch_export import import_module
    from ember.ir_passes.specialize_attention import specialize_attention
    from ember.ir_passes.tidy_traced_graph import tidy_traced_graph

    mod, _shapes = import_module(_sink_decoder(column_of), max_seq_len=64)
    with pytest.raises(ModelError, match=words):
        specialize_attention(tvm.target.Target("llvm"))(tidy_traced_graph(mod))


def _sinks_moved(model_dir, out_dir, move) -> None:
    """A copy of the checkpoint at `model_dir` in `out_dir` with every layer's sinks replaced by `move(sinks)`."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    weights = load_file(str(out_dir / "model.safetensors"))
    for name in [n for n in weights if n.endswith("self_attn.sinks")]:
        weights[name] = np.ascontiguousarray(move(weights[name]))
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.slow
def test_sinks_moved_to_other_heads_fail_the_comparison(tiny_models, tmp_path):
    """The families' bound detects gpt-oss's sinks moved one head over (the check can fail): compiled from a copy
    whose sinks are so moved, the logits leave transformers' (on the original weights) by more than the bound."""
    model = tiny_models.exported("gpt_oss")
    _sinks_moved(model.model_dir, tmp_path / "moved", lambda sinks: np.roll(sinks, 1))
    _prefill_leaves_transformers(model, tmp_path / "moved", tmp_path / "artifact", "sinks moved")


@pytest.mark.slow
def test_a_config_naming_a_window_its_code_ignores_is_refused(tiny_models, tmp_path):
    """Llama's code applies no window whatever its config says: a `sliding_window` in a Llama config is a window
    the graph does not apply, and the compile stops naming the layer, rather than trusting either."""
    from ember.driver.compiler import CompileOptions, compile_model

    model_dir = tmp_path / "llama-with-window"
    shutil.copytree(tiny_models.checkpoint("llama"), model_dir)
    config_path = model_dir / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "sliding_window": WINDOW}))
    with pytest.raises(ModelError, match="attention layer 0 .* causal over the whole context, and the config says a "
                                         f"sliding window of {WINDOW} tokens"):
        compile_model(model_dir, tmp_path / "out", CompileOptions(quantization="q0f32", frontend="torch-export",
                                                                 show_progress=False))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type, overrides, construct", [
    ("mamba", dict(num_hidden_layers=2, hidden_size=64), "a state-space (recurrent) model"),
    ("falcon_mamba", dict(num_hidden_layers=2, hidden_size=64), "a state-space (recurrent) model"),
    ("bert", dict(num_hidden_layers=2, architectures=["BertForMaskedLM"]), "a bidirectional encoder"),
    ("t5", dict(num_layers=2), "an encoder-decoder"),
], ids=["mamba", "falcon-mamba", "bert", "t5"])
def test_a_model_built_of_what_ember_does_not_compile_is_refused_by_name(tmp_path, model_type, overrides, construct):
    """The model type and the construct in one line, before any key is looked for (Mamba was refused with a
    missing 'num_attention_heads')."""
    from helpers import assert_one_line_error, run_ember
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, vocab_size=256, **overrides).to_dict()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    result = run_ember("compile", str(tmp_path / "model"), "--frontend", "torch-export", "-o", str(tmp_path / "out"),
                       "--no-progress")
    assert_one_line_error(result, f"model_type '{model_type}' is {construct}", "ember does not compile")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, words", [
    (dict(sinks=True), "attention scores with attention sinks"),
    (dict(softcap=5.0), "attention scores soft-capped at 5"),
    (dict(alibi_slopes=(0.5, 0.25)), r"attention scores biased by distance \(ALiBi\)"),
])
def test_gpu_targets_refuse_what_only_the_cpu_kernels_compute(extra, words):
    from ember.ir.kv_cache import CacheShape, cache_functions

    with pytest.raises(ModelError, match=f"{words}, which ember's CPU kernels compute and TVM's cuda kernels do not"):
        cache_functions(CacheShape(2, 2, 2, 16, 64, **extra), "float32", tvm.target.Target("cuda"))
