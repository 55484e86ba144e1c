"""`ember analyze`: per-operator formulas on hand-computed cases, an independent
re-derivation of LLM-Viewer's counts, the Llama-2-7b / RTX A6000 reference case,
hardware presets and the `host` cache, the CLI's table, JSON and plots; and
`--measure` on the compiled tiny llama: every kernel timed, and the operations TVM
counts in its TIR checked against the formulas."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
from helpers import run_python

from ember.core.errors import ArtifactError, EmberError, ModelError, TargetError
from ember.driver.analyze import cli
from ember.driver.analyze.measure import attention_work, implemented_operators, measure, moved_bytes, with_int8_peak
from ember.driver.analyze.operators import (
    Architecture,
    Precision,
    architecture_from_config,
    decode,
    experts_touched,
    flash_tile_rows,
    load_architecture,
    model_presets,
    prefill,
)
from ember.driver.analyze.report import format_text
from ember.driver.analyze.roofline import Workload, analyze, evaluate, kv_cache_bytes, place, weight_bytes
from ember.targets import hardware as hw_module
from ember.targets.hardware import Hardware, hardware_presets, load_hardware
from ember.targets.registry import resolve_target

FP16 = Precision(16, 16, 16)
# h=8, I=16, H=2, Hkv=1, d=4, L=2, V=10: small enough to count every operator by hand.
TINY = {
    "model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
    "max_position_embeddings": 64, "torch_dtype": "float16",
}


def tiny(**overrides) -> Architecture:
    return architecture_from_config({**TINY, **overrides}, "tiny/config.json", "tiny")


def by_name(ops) -> dict:
    return {op.name: op for op in ops}


def toy_hardware(**peaks: float) -> Hardware:
    return Hardware("toy", "toy", "gpu", {"fp32": 10.0, **peaks}, memory_bandwidth=10.0,
                    memory_capacity=1e9, onchip_memory=1024, source="test")


# --- formulas on hand-computed cases -------------------------------------------------


def test_prefill_operators_match_hand_counts():
    stage = prefill(tiny(), FP16, batch=1, prompt_len=3)
    ops = by_name(stage.layer)
    # (ops, weight, act_read, act_write, kv_read, kv_write) in operations and bytes, fp16.
    expected = {
        "attn_norm": (96, 16, 48, 48, 0, 0),        # 4 x 3 x 8; g = 8 x 2 B
        "q_proj": (384, 128, 48, 48, 0, 0),         # 2 x 3 x 8 x 8
        "k_proj": (192, 64, 48, 24, 0, 0),          # 2 x 3 x 8 x 4
        "v_proj": (192, 64, 48, 0, 0, 24),          # written straight into the KV cache
        "rope": (108, 0, 96, 48, 0, 24),            # 3 x 3 x (2 + 1) x 4; q, k, cos/sin in
        "qk_matmul": (144, 0, 48, 36, 24, 0),       # 2 x 2 heads x 3 x 3 keys x 4
        "softmax": (90, 0, 36, 36, 0, 0),           # 5 x 18 scores
        "sv_matmul": (144, 0, 36, 48, 24, 0),
        "o_proj": (384, 128, 48, 48, 0, 0),
        "attn_add": (24, 0, 96, 48, 0, 0),          # two inputs read
        "mlp_norm": (96, 16, 48, 48, 0, 0),
        "gate_proj": (768, 256, 48, 96, 0, 0),      # 2 x 3 x 8 x 16
        "up_proj": (768, 256, 48, 96, 0, 0),
        "mlp_act": (240, 0, 192, 96, 0, 0),         # 5 x 3 x 16
        "down_proj": (768, 256, 96, 48, 0, 0),
        "mlp_add": (24, 0, 96, 48, 0, 0),
    }
    assert list(ops) == list(expected)
    for name, counts in expected.items():
        op = ops[name]
        assert (op.ops, op.weight_bytes, op.act_read, op.act_write, op.kv_read, op.kv_write) == counts, name
    once = by_name(stage.once)
    assert (once["embed_tokens"].ops, once["embed_tokens"].bytes) == (0, 96)
    # The head runs on the last position only: 1 row.
    assert (once["final_norm"].ops, once["lm_head"].ops, once["lm_head"].bytes) == (32, 160, 160 + 16 + 20)


def test_decode_attention_reads_the_whole_context():
    ops = by_name(decode(tiny(), FP16, batch=2, context=5).layer)
    qk = ops["qk_matmul"]
    assert qk.ops == 2 * 2 * 2 * 1 * 5 * 4           # batch, heads, 1 query, 5 keys, d
    assert qk.kv_read == 2 * 5 * 1 * 4 * 2           # K of the one KV head, once per sequence
    assert (qk.act_read, qk.act_write) == (2 * 2 * 4 * 2, 2 * 2 * 5 * 2)
    assert ops["softmax"].ops == 5 * 2 * 2 * 5
    assert ops["q_proj"].ops == 2 * 2 * 8 * 8


def test_roofline_bound_time_and_attainable():
    hw = toy_hardware(fp16=100.0)  # ridge point 10 op/B for fp16
    stage = prefill(tiny(), FP16, 1, 3)
    q = place(by_name(stage.layer)["q_proj"], hw)  # 384 op / 224 B = 1.71 op/B
    assert q.bound == "memory"
    assert q.intensity == pytest.approx(384 / 224)
    assert q.attainable == pytest.approx(384 / 224 * 10)
    assert q.time == pytest.approx(224 / 10)
    fast_memory = Hardware("toy", "toy", "gpu", {"fp32": 10.0, "fp16": 100.0}, 1e6, 1e9, 1024, "test")
    q = place(by_name(stage.layer)["q_proj"], fast_memory)
    assert (q.bound, q.attainable, q.time) == ("compute", 100.0, pytest.approx(3.84))


def test_stage_total_counts_every_layer_and_the_head_once():
    result = evaluate(prefill(tiny(), FP16, 1, 3), toy_hardware(fp16=100.0))
    per_layer = sum(p.op.ops for p in result.layer)
    assert result.ops == 2 * per_layer + 0 + 32 + 160
    assert result.time == pytest.approx(2 * sum(p.time for p in result.layer) + sum(p.time for p in result.once))


def test_bit_widths_change_bytes_and_compute_type():
    w4 = by_name(prefill(tiny(), Precision(4, 16, 8), 1, 3).layer)
    assert w4["q_proj"].weight_bytes == 64 * 0.5
    assert w4["q_proj"].dtype == "fp16"              # W4A16 dequantizes to 16-bit
    assert w4["v_proj"].kv_write == 3 * 4 * 1        # 8-bit cache
    assert by_name(prefill(tiny(), Precision(8, 8, 8), 1, 3).layer)["q_proj"].dtype == "int8"
    assert by_name(prefill(tiny(), Precision(4, 4, 4), 1, 3).layer)["q_proj"].dtype == "int4"
    assert Precision(16, 16, 16, "bf16").matmul_dtype(16, 16) == "bf16"


def test_flash_attention_tiles_and_fused_counts():
    prec = FP16
    # S=4, tiles of 2 rows: tile [0,2) sees 2 keys, tile [2,4) sees 4 -> 12 pairs, 6 K/V rows per head.
    flash = by_name(prefill(tiny(), prec, 1, 4, flash_tile=2).layer)["flash_attention"]
    assert flash.ops == 2 * 12 * (4 * 4 + 5)
    assert flash.kv_read == 2 * 2 * 6 * 4 * 2        # K and V, per query head in prefill
    assert flash.act_read == flash.act_write == 4 * 2 * 4 * 2
    # Decode: fused ops equal the unfused qk + softmax + sv; K/V read once per KV head.
    fused = by_name(decode(tiny(), prec, 3, 7, flash_tile=2).layer)["flash_attention"]
    unfused = by_name(decode(tiny(), prec, 3, 7).layer)
    assert fused.ops == sum(unfused[n].ops for n in ("qk_matmul", "softmax", "sv_matmul"))
    assert fused.kv_read == unfused["qk_matmul"].kv_read + unfused["sv_matmul"].kv_read
    # FlashAttention's block size: min(ceil(M / 4d), d), M in elements.
    assert flash_tile_rows(128 * 1024, 128, prec) == 128
    assert flash_tile_rows(32 * 1024, 128, prec) == 32


def test_sliding_window_caps_attention_but_not_the_kv_cache():
    """Every layer windowed (Mistral): 4 keys read, not 10; the cache keeps all 10 positions, as ember's does. With
    whole-context layers among the windowed ones (Qwen2 from max_window_layers on), every layer is charged the whole
    context."""
    arch = tiny(sliding_window=4)
    qk = by_name(decode(arch, FP16, 1, 10).layer)["qk_matmul"]
    assert qk.ops == 2 * 2 * 1 * 4 * 4               # 4 visible keys, not 10
    assert kv_cache_bytes(arch, FP16, 1, 10) == kv_cache_bytes(tiny(), FP16, 1, 10) == 2 * 2 * 1 * 4 * 2 * 10
    mixed = tiny(model_type="qwen2", sliding_window=4, use_sliding_window=True, max_window_layers=1)
    assert by_name(decode(mixed, FP16, 1, 10).layer)["qk_matmul"].ops == 2 * 2 * 1 * 4 * 10


def test_mixture_of_experts_reads_only_the_experts_it_routes_to():
    arch = tiny(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert (arch.num_experts, arch.experts_per_token) == (4, 2)
    one = by_name(decode(arch, FP16, 1, 5).layer)
    assert one["gate_proj"].weight_bytes == 2 * 8 * 16 * 2       # k = 2 experts for one token
    assert one["gate_proj"].ops == 2 * 2 * 8 * 16                # k x the dense MLP
    assert one["router"].ops == 2 * 8 * 4
    assert experts_touched(4, 2, 1) == 2
    assert experts_touched(4, 2, 1000) == pytest.approx(4)
    assert weight_bytes(arch, FP16) > weight_bytes(tiny(), FP16)
    with pytest.raises(ModelError, match="num_experts_per_tok"):
        tiny(model_type="mixtral", num_local_experts=2, num_experts_per_tok=3)


@pytest.mark.parametrize(("name", "expected"), [
    ("qwen3_moe", (8, 2, 32, 0)),      # moe_intermediate_size is the experts' width
    ("qwen2_moe", (6, 3, 32, 48)),     # and a shared expert beside them
    ("mixtral", (4, 2, 128, 0)),       # intermediate_size is the experts' width
    ("olmoe", (8, 2, 128, 0)),
    ("granitemoe", (4, 2, 128, 0)),
    ("gpt_oss", (4, 2, 128, 0)),
    ("gpt_oss_mqa", (4, 1, 128, 0)),
])
def test_every_moe_family_is_read_with_its_experts_sizes(name, expected):
    """Each family's config as transformers writes it: the experts' count, how many a token uses, their width and a
    shared expert's; a decode token's expert projections read k experts' weights, and the shared expert's always."""
    import models

    model_type, overrides = models.FAMILIES[name]
    from transformers import AutoConfig

    raw = AutoConfig.for_model(model_type, **models._EXPORTED_COMMON, **overrides).to_dict()
    arch = architecture_from_config(raw, f"{name}/config.json", name)
    assert (arch.num_experts, arch.experts_per_token, arch.expert_width,
            arch.shared_expert_intermediate_size) == expected
    experts, k, width, shared = expected
    h = arch.config.hidden_size
    one = by_name(decode(arch, FP16, 1, 5).layer)
    assert one["down_proj"].weight_bytes == k * width * h * 2
    assert ("shared_down_proj" in one) == bool(shared)
    assert analyze(arch, toy_hardware(), FP16, Workload(1, 4, 2)).memory.expert_weights == \
        3 * h * width * experts * arch.config.num_hidden_layers * 2


def test_an_moe_config_without_its_top_k_is_one_line():
    with pytest.raises(ModelError, match="'num_experts' is 8 and 'num_experts_per_tok' is missing"):
        tiny(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=4)


def test_generation_sums_one_decode_step_per_generated_token_after_the_first():
    hw = toy_hardware(fp16=100.0)
    a = analyze(tiny(), hw, FP16, Workload(batch=1, prompt_len=3, gen_len=4))
    steps = [evaluate(decode(tiny(), FP16, 1, c), hw).time for c in (4, 5, 6)]
    assert a.decode_steps_time == pytest.approx(sum(steps))
    assert a.generation_time == pytest.approx(a.prefill.time + sum(steps))
    single = analyze(tiny(), hw, FP16, Workload(batch=1, prompt_len=3, gen_len=1))
    assert single.generation_time == single.prefill.time


# --- an independent count: LLM-Viewer's published formulas, re-derived ---------------


def llm_viewer_layer(h, inter, heads, kv_heads, batch, seq, stage, w=2, a=2, kv=2):
    """LLM-Viewer's model_analyzer.py per-layer counts for a Llama layer, written out again
    in its own terms (ic/oc of each linear, OPs, load_weight, load_act, store_act, kv)."""
    d = h // heads
    rows = batch * seq if stage == "prefill" else batch
    out = {}
    for name, (ic, oc) in {"q_proj": (h, h), "k_proj": (h, h * kv_heads // heads),
                           "v_proj": (h, h * kv_heads // heads), "o_proj": (h, h),
                           "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}.items():
        out[name] = dict(OPs=ic * oc * rows * 2, load_weight=ic * oc * w, load_act=ic * rows * a)
        if name == "v_proj":
            out[name]["store_kv_cache"] = oc * rows * kv
        elif name != "k_proj":  # LLM-Viewer stores k to the cache; ember ropes it first
            out[name]["store_act"] = oc * rows * a
    if stage == "decode":
        out["qk_matmul"] = dict(OPs=seq * d * heads * batch * 2, load_act=d * batch * heads * a,
                                store_act=seq * batch * heads * a, load_kv_cache=seq * d * batch * kv_heads * kv)
        out["sv_matmul"] = dict(OPs=d * seq * heads * batch * 2, load_act=seq * batch * heads * a,
                                store_act=d * batch * heads * a, load_kv_cache=seq * d * batch * kv_heads * kv)
        out["softmax"] = dict(OPs=batch * heads * seq * 5, load_act=batch * heads * seq * a,
                              store_act=batch * heads * seq * a)
    else:
        out["qk_matmul"] = dict(OPs=seq * seq * d * heads * batch * 2, store_act=seq * seq * batch * heads * a,
                                load_kv_cache=seq * d * batch * kv_heads * kv)
        out["sv_matmul"] = dict(OPs=seq * d * seq * heads * batch * 2, load_act=seq * seq * batch * heads * a,
                                store_act=seq * d * batch * heads * a,
                                load_kv_cache=seq * d * batch * kv_heads * kv)
        out["softmax"] = dict(OPs=batch * heads * seq * seq * 5, load_act=batch * heads * seq * seq * a,
                              store_act=batch * heads * seq * seq * a)
    return out


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_counts_agree_with_llm_viewer_where_both_count_the_same_thing(stage):
    config = {**TINY, "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 8,
              "num_key_value_heads": 2}
    arch = tiny(**config)
    batch, seq = 3, 12
    step = prefill(arch, FP16, batch, seq) if stage == "prefill" else decode(arch, FP16, batch, seq)
    ours = by_name(step.layer)
    ours_fields = {"OPs": "ops", "load_weight": "weight_bytes", "load_act": "act_read",
                   "store_act": "act_write", "load_kv_cache": "kv_read", "store_kv_cache": "kv_write"}
    theirs = llm_viewer_layer(64, 160, 8, 2, batch, seq, stage)
    for name, counts in theirs.items():
        for field, value in counts.items():
            assert getattr(ours[name], ours_fields[field]) == value, (name, field)
    # Where ember deliberately differs from LLM-Viewer (see operators.py):
    lm_head = by_name(step.once)["lm_head"]
    assert lm_head.ops == 2 * batch * 64 * 10            # LLM-Viewer: 1 op per MAC
    assert ours["mlp_act"].ops == 5 * step.batch * step.new_tokens * 160  # LLM-Viewer: hidden size
    rows = batch * step.new_tokens
    assert ours["attn_add"].act_read == 2 * rows * 64 * 2  # LLM-Viewer: reads one input
    if stage == "prefill":                                # LLM-Viewer reads Q with the KV head count
        assert ours["qk_matmul"].act_read == seq * 8 * 8 * batch * 2


def test_decode_ops_are_two_per_parameter_and_bytes_are_the_weights():
    """The textbook count: at batch 1 a token costs ~2 ops per weight and reads every weight once."""
    arch = load_architecture("Llama-2-7b")
    c = arch.config
    step = decode(arch, FP16, 1, 1)
    matmul_ops = sum(op.ops for op in step.layer if op.name.endswith("_proj")) * c.num_hidden_layers
    matmul_ops += by_name(step.once)["lm_head"].ops
    non_embedding = c.num_parameters - c.vocab_size * c.hidden_size
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    assert matmul_ops == 2 * (non_embedding - norms)
    weights_read = sum(op.weight_bytes for op in step.layer) * c.num_hidden_layers
    weights_read += sum(op.weight_bytes for op in step.once)
    # Every weight once, except the embedding table, of which one row is gathered.
    assert weights_read == weight_bytes(arch, FP16) - (c.vocab_size - 1) * c.hidden_size * 2


# --- the reference case: Llama-2-7b, RTX A6000, seq 2048, batch 1, fp16 ---------------


def test_llama2_7b_on_a6000_reference_table():
    hw = load_hardware("nvidia-rtx-a6000")
    assert (hw.peak("fp16"), hw.memory_bandwidth) == (154.8e12, 768e9)
    a = analyze(load_architecture("Llama-2-7b"), hw, FP16, Workload(1, 2048, 256))
    pre = {p.op.name: p for p in a.prefill.layer}
    dec = {p.op.name: p for p in a.decode.layer}
    assert pre["q_proj"].op.ops == 2 * 2048 * 4096 * 4096
    assert pre["q_proj"].intensity == pytest.approx(1024)
    assert pre["gate_proj"].op.ops == 2 * 2048 * 4096 * 11008
    assert {n for n, p in pre.items() if p.bound == "compute"} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert pre["qk_matmul"].intensity == pytest.approx(113.78, abs=0.01)  # below the 201.6 ridge
    assert all(p.bound == "memory" for p in dec.values())
    assert dec["q_proj"].intensity == pytest.approx(1.0, abs=1e-3)
    assert dec["qk_matmul"].op.kv_read == 2048 * 4096 * 2
    # Decode reads all weights (13.5 GB) and the 1 GiB KV cache once: ~18.6 ms per token.
    embedding_table, kv_cache = 32000 * 4096 * 2, 2 * 32 * 4096 * 2 * 2048
    assert a.decode.time == pytest.approx((a.memory.weights - embedding_table + kv_cache) / 768e9, rel=0.01)
    assert a.prefill.ops == pytest.approx(28.8e12, rel=0.01)
    assert a.memory.weights == 6_738_415_616 * 2
    assert a.memory.kv_cache == 2 * 32 * 4096 * 2 * (2048 + 256)


def test_presets_have_the_published_parameter_counts():
    published = {"Llama-2-7b": 6_738_415_616, "Llama-2-70b": 68_976_648_192, "Llama-3.1-8B": 8_030_261_248,
                 "Llama-3.2-1B": 1_235_814_400, "Mistral-7B-v0.1": 7_241_732_096,
                 "Mixtral-8x7B-v0.1": 46_702_792_704, "Qwen2.5-0.5B": 494_032_768, "Qwen2.5-7B": 7_615_616_512}
    assert len(model_presets()) >= 12
    for name in model_presets():
        arch = load_architecture(name.upper())  # names are case-insensitive
        if name in published:
            assert weight_bytes(arch, FP16) == 2 * published[name], name


# --- model and hardware loading ------------------------------------------------------


def test_model_from_directory_and_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert load_architecture(str(tmp_path)).config.hidden_size == 8
    assert load_architecture(str(tmp_path / "config.json")).name == tmp_path.name
    with pytest.raises(ModelError, match="did you mean Llama-2-7b"):
        load_architecture("llama-2-7")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ModelError, match="bad.json: malformed JSON"):
        load_architecture(str(tmp_path / "bad.json"))


def test_every_hardware_preset_is_valid_and_cited():
    names = hardware_presets()
    assert len(names) >= 20
    for name in names:
        hw = load_hardware(name)
        assert hw.name == name and hw.kind in ("cpu", "gpu") and "https://" in hw.source
        assert min(hw.peak_flops["fp32"], hw.memory_bandwidth, hw.memory_capacity, hw.onchip_memory) > 0
        assert all(hw.peak(d) > 0 for d in ("fp32", "fp16", "bf16", "int8", "int4"))
    kinds = {load_hardware(n).kind for n in names}
    assert kinds == {"cpu", "gpu"}


def test_hardware_lookup_and_dtype_fallback():
    assert load_hardware("A6000").name == "nvidia-rtx-a6000"       # unique part, any case
    assert load_hardware("l4").name == "nvidia-l4"                 # name without vendor beats a part
    with pytest.raises(TargetError, match="ambiguous.*apple-m2-max"):
        load_hardware("m2-")
    with pytest.raises(TargetError, match="presets: .*nvidia-h100-sxm"):
        load_hardware("tpu-v9")
    assert load_hardware("t4").compute_dtype("bf16") == "fp16"     # Turing has no bf16
    assert load_hardware("h100").compute_dtype("int4") == "int8"   # Hopper has no int4
    assert load_hardware("13900k").compute_dtype("fp16") == "fp32"


def test_hardware_from_json_file(tmp_path):
    data = load_hardware("a6000").to_json()
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**data, "name": "mine"}))
    mine = load_hardware(str(path))
    assert mine.name == "mine" and mine.peak("fp16") == pytest.approx(154.8e12)
    assert mine.memory_capacity == 48 * 2**30
    path.write_text(json.dumps({**data, "peak_tflops": {"fp32": 1, "fp12": 3}}))
    with pytest.raises(TargetError, match="unknown data types fp12"):
        load_hardware(str(path))


def test_host_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = hw_module.measure_host(read_bytes=4 * 2**20, matmul_size=64, repeats=1)
    hardware = measured.hardware
    assert hardware.kind == "cpu" and hardware.peak_flops["fp32"] > 0 and hardware.memory_bandwidth > 0
    assert measured.others_share is None or 0 <= measured.others_share <= 1
    calls = []
    quiet = hw_module.HostMeasurement(hardware, 0.0)
    monkeypatch.setattr(hw_module, "measure_host", lambda: calls.append(1) or quiet)
    first = load_hardware("host")
    assert calls == [1] and hw_module.host_cache_path() == tmp_path / "ember" / "host-hardware.json"
    second = load_hardware("host")
    assert calls == [1] and second.memory_bandwidth == pytest.approx(first.memory_bandwidth)
    monkeypatch.setattr(hw_module, "_host_fingerprint", lambda: {"cpu": "another machine"})
    load_hardware("host")
    assert calls == [1, 1]


def test_the_compiled_read_probe_runs_on_this_cpu():
    """The bandwidth probe ember's kernels are judged by includes a read compiled by TVM for this CPU on TVM's
    thread pool (numpy's dot alone read 52 GB/s where ember's decode streamed 73 on a Zen 5)."""
    import math

    assert math.isfinite(hw_module.compiled_read_bandwidth(64 * 2**20, repeats=1))
    assert hw_module.compiled_read_bandwidth(64 * 2**20, repeats=1) > 0
    assert "TVM parallel max-reduction" in hw_module.BANDWIDTH_METHOD


def test_a_host_measured_beside_other_work_is_used_but_not_cached(tmp_path, monkeypatch, capsys):
    """A busy machine's low roofline is not kept: the next use measures again, and says why."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    busy = hw_module.HostMeasurement(GENEROUS, 0.31)
    monkeypatch.setattr(hw_module, "measure_host", lambda: calls.append(1) or busy)
    assert load_hardware("host") == GENEROUS and load_hardware("host") == GENEROUS
    assert calls == [1, 1] and not hw_module.host_cache_path().exists()
    assert "other work took 31% of the CPUs while this machine was measured" in capsys.readouterr().err


def test_other_work_during_a_host_measurement_is_seen(monkeypatch):
    """/proc/stat's busy time beyond this process's own counts as other work (here 3 of 2 CPUs' 4 CPU-seconds)."""
    since_boot = hw_module._system_busy_seconds()
    assert since_boot is None or since_boot > 0  # Linux: the CPUs' busy seconds since boot
    clock = {"busy": 100.0, "own": 10.0, "wall": 50.0}
    monkeypatch.setattr(hw_module, "_system_busy_seconds", lambda: clock["busy"])
    monkeypatch.setattr(hw_module.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(hw_module.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(hw_module.os, "cpu_count", lambda: 2)
    others = hw_module._OtherWork()
    clock.update(busy=105.0, own=12.0, wall=52.0)  # 5 CPU-s in all, 2 of them this process's
    assert others.share() == pytest.approx(0.75)
    assert not hw_module.HostMeasurement(GENEROUS, others.share()).quiet
    assert hw_module.HostMeasurement(GENEROUS, 0.05).quiet and hw_module.HostMeasurement(GENEROUS, None).quiet


# --- the command line ----------------------------------------------------------------


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="ember analyze")
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(list(argv)))


def test_cli_prints_tables_totals_and_memory(capsys):
    assert run_cli("Llama-2-7b", "--hardware", "a6000", "--prompt-len", "2048", "--gen-len", "4") == 0
    out = capsys.readouterr().out
    assert "Prefill: batch 1 x 2048 tokens" in out and "Decode: one step" in out
    q_proj = next(line for line in out.splitlines() if line.strip().startswith("q_proj"))
    assert q_proj.split()[1:4] == ["fp16", "68.7G", "67.1M"] and "compute" in q_proj
    assert "generation" in out and "KV cache" in out and "fits" in out


def test_report_warns_past_the_context_window():
    a = analyze(tiny(), load_hardware("a6000"), FP16, Workload(batch=1, prompt_len=64, gen_len=2))
    assert "66 tokens exceed the model's context window (64)" in format_text(a)


def test_cli_json_matches_the_analysis(capsys):
    run_cli("Qwen2.5-0.5B", "--hardware", "l4", "--batch", "2",
            "--prompt-len", "64", "--gen-len", "3", "--wbits", "4", "--flash-attention", "--json")
    data = json.loads(capsys.readouterr().out)
    assert data["precision"] == {"wbits": 4, "abits": 16, "kvbits": 16, "float16": "bf16"}
    assert data["workload"]["context"] == 64
    names = [op["name"] for op in data["decode"]["per_layer"]]
    assert "flash_attention" in names and "qk_matmul" not in names
    q = data["prefill"]["per_layer"][1]
    assert q["name"] == "q_proj" and q["ops"] == 2 * 2 * 64 * 896 * 896 + 2 * 64 * 896  # + bias
    assert q["bytes"] == q["weight_bytes"] + q["act_read"] + q["act_write"]
    assert data["generation"]["decode_steps"] == 2
    assert data["memory"]["fits"] is True


def test_cli_quant_is_the_format_as_stored(capsys):
    """--quant q4f32: 4.5 bits a weight (4 + a float16 scale per 32), float32 activations and KV
    cache, int8 projections; the decode step reads the projections' bytes at 4.5 bits, and the
    bundled demo model is named as `ember compile` names it."""
    run_cli("demo", "--hardware", "raspberry-pi-5", "--quant", "q4f32", "--prompt-len", "16", "--gen-len", "2",
            "--json")
    data = json.loads(capsys.readouterr().out)
    assert data["precision"] == {"wbits": 4.5, "abits": 32, "kvbits": 32, "float16": "fp16",
                                 "int8_projections": True}
    ops = {op["name"]: op for op in data["decode"]["per_layer"]}
    assert ops["q_proj"]["dtype"] == "int8" and ops["qk_matmul"]["dtype"] == "fp32"
    assert ops["q_proj"]["weight_bytes"] == 256 * 256 * 4.5 / 8  # demo: hidden 256
    with pytest.raises(EmberError, match="--quant sets the weight"):
        run_cli("demo", "--hardware", "raspberry-pi-5", "--quant", "q8f32", "--wbits", "8")


def test_cli_rejects_bad_options(capsys):
    with pytest.raises(SystemExit):
        run_cli("Llama-2-7b", "--hardware", "a6000", "--batch", "0")
    with pytest.raises(SystemExit):
        run_cli("Llama-2-7b", "--hardware", "a6000", "--wbits", "5")
    with pytest.raises(TargetError):
        run_cli("Llama-2-7b", "--hardware", "nonexistent")


def test_cli_writes_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    run_cli(str(config), "--hardware", "a6000", "--prompt-len", "16", "--gen-len", "2", "--plot",
            str(tmp_path / "plots"))
    for name in ("roofline.png", "batch_sweep.png", "seqlen_sweep.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(EmberError, match=r"pip install 'ember\[plot\]'"):
        run_cli("Llama-2-7b", "--hardware", "a6000", "--gen-len", "2", "--plot", str(tmp_path))


def test_cli_needs_hardware_unless_measuring():
    with pytest.raises(EmberError, match="--hardware is required"):
        run_cli("Llama-2-7b")


def test_analysis_without_measure_does_not_load_tvm():
    code = ("import sys; from ember.cli import main; "
            "main(['analyze', 'Llama-3.2-1B', '--hardware', 'm4', '--gen-len', '2']); "
            "assert 'tvm' not in sys.modules, 'analyze loaded TVM'")
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr


# --- --measure: the compiled tiny llama, timed kernel by kernel ------------------------

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
# A roof well above what any CPU here reaches, so every measured share of it lies in (0, 1).
GENEROUS = Hardware("generous", "generous", "cpu", {"fp32": 1e14}, memory_bandwidth=1e13, memory_capacity=1e12,
                    onchip_memory=2**20, source="test")


@pytest.fixture(scope="module")
def tiny_measurement(tiny_llama):
    """The tiny llama's prefill of 16 tokens and decode step of 2 sequences, timed (8 runs per kernel: the best
    of them, as the step's, even while another test worker shares the cores)."""
    return measure(tiny_llama.artifact_dir, prompt_len=16, batch=2, repeats=8, hardware=GENEROUS)


def test_measure_times_every_kernel_and_maps_it_to_the_operators(tiny_measurement, tiny_llama):
    m = tiny_measurement
    layers = m.arch.config.num_hidden_layers
    assert (m.prefill.batch, m.prefill.new_tokens, m.prefill.context) == (1, 16, 16)
    assert (m.decode.batch, m.decode.new_tokens, m.decode.context) == (2, 1, 17)
    for stage in (m.prefill, m.decode):
        assert stage.step_seconds > 0 and stage.predicted.stage.name == stage.name
        for k in stage.kernels:
            assert k.calls >= 1 and k.seconds > 0 and k.point.op.bytes > 0 and k.point.op.ops >= 0, k.name
            assert 0 < k.fraction < 1 and k.fraction == pytest.approx(k.point.time / k.seconds), k.name
        # Every operator analyze models has a kernel, except the residual adds (fused into
        # o_proj and down_proj) and mlp_act (a kernel that reads no weight, listed by name).
        implemented = {name for k in stage.kernels for name in k.implements}
        modelled = {p.op.name for p in stage.predicted.layer + stage.predicted.once}
        assert modelled - implemented == {"attn_add", "mlp_add", "mlp_act"}
        per_layer = [k for k in stage.kernels if "q_proj" in k.implements or "mlp_norm" in k.implements]
        assert [k.calls for k in per_layer] == [layers, layers]
        assert all(k.predicted > 0 for k in stage.kernels if k.implements)
        # Each kernel timed cold can exceed the warm step, but the kernels explain most of it.
        assert stage.kernel_seconds >= 0.25 * stage.step_seconds
    names = {k.name for k in m.prefill.kernels} | {k.name for k in m.decode.kernels}
    assert "vm.builtin.attention_kv_cache_attention_with_fused_qkv" in names


def test_measure_maps_quantized_kernels_to_the_operators(tiny_models):
    """A q4f32 artifact: the unpacking kernels are rebuilt and mapped through their packed weights."""
    m = measure(tiny_models.quantized("llama", "q4f32").artifact_dir, prompt_len=16, batch=1, repeats=1,
                hardware=GENEROUS)
    for stage in (m.prefill, m.decode):
        implemented = {name for k in stage.kernels for name in k.implements}
        assert set(PROJECTIONS) | {"embed_tokens", "lm_head"} <= implemented
        assert all(k.seconds > 0 for k in stage.kernels)
    # Projections of int8 activations are placed as int8 work (on the int8 roof where the device has one).
    int8 = resolve_target("cpu").int8_dot is not None
    assert m.precision.int8_projections == int8
    for k in m.prefill.kernels + m.decode.kernels:
        projection = bool(k.implements) and set(k.implements) <= set(PROJECTIONS) | {"lm_head"}
        assert k.point.op.dtype == ("int8" if int8 and projection else "fp32"), k.name


def test_the_host_gets_an_int8_roof_from_embers_int8_matmul():
    """numpy measures no int8 peak: ember's int8 prefill matmul on this CPU gives it, beside the fp32 one."""
    measured = with_int8_peak(GENEROUS, "cpu", shape=(16, 64, 64))
    if resolve_target("cpu").int8_dot is None:  # no int8 dot product here: nothing to measure it with
        assert measured == GENEROUS
        return
    # Its figure is a timing, so only its presence is asserted (speed is the benchmarks' business).
    assert measured.peak_flops["fp32"] == GENEROUS.peak_flops["fp32"] and 0 < measured.peak("int8") < float("inf")
    kernel = {"bf16": "AMX-BF16 prefill matmul", "int8": "AMX int8 prefill matmul",
              "": "int8 prefill matmul"}[resolve_target("cpu").int8_dot.tiles]
    assert measured.compute_dtype("int8") == "int8" and f"int8 peak: ember's {kernel} (16x64x64" in measured.source


@pytest.mark.parametrize("stage_name", ["prefill", "decode"])
def test_operations_counted_in_the_compiled_tir_match_the_formulas(tiny_measurement, stage_name):
    """The independent count: TVM's estimate_tir_flops on each kernel the artifact runs,
    at the shapes it ran with, against analyze's formulas for the operators it implements."""
    stage = getattr(tiny_measurement, stage_name)
    formulas = {p.op.name: p.op for p in stage.predicted.layer + stage.predicted.once}
    checked = set()
    for k in stage.kernels:
        if k.implements and set(k.implements) <= set(PROJECTIONS):
            expected = sum(formulas[name].ops for name in k.implements)
            # o_proj and down_proj carry the residual add as an epilogue: rows x h more operations.
            add = formulas["attn_add"].ops
            assert k.point.op.ops in (expected, expected + add), k.name
            checked.update(k.implements)
        elif k.implements in (("attn_norm",), ("mlp_norm",)):
            # TVM also counts the per-row mean and epsilon (2 per row); the formula omits them.
            assert k.point.op.ops == pytest.approx(formulas[k.implements[0]].ops, rel=0.01)
            checked.update(k.implements)
    assert checked == set(PROJECTIONS) | {"attn_norm", "mlp_norm"}
    # Over the whole step the counts agree within 5%: they differ only in elementwise
    # conventions (SiLU), the causal triangle of attention and the final norm's rows.
    counted = sum(k.calls * k.point.op.ops for k in stage.kernels)
    assert counted == pytest.approx(stage.predicted.ops, rel=0.05)


def test_measure_cli_prints_json_and_plots(tiny_llama, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hw_module, "measure_host", lambda: hw_module.HostMeasurement(GENEROUS, 0.0))
    assert run_cli(str(tiny_llama.artifact_dir), "--measure", "--prompt-len", "8", "--json",
                   "--plot", str(tmp_path / "plots")) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["name"] == "generous" and data["precision"]["wbits"] == 32
    kernels = data["decode"]["kernels"]
    assert data["prefill"]["new_tokens"] == 8 and data["decode"]["context"] == 9
    assert all(k["time_s"] > 0 and 0 < k["fraction_of_roofline"] < 1 for k in kernels)
    assert sum(k["calls"] * k["time_s"] for k in kernels) == pytest.approx(data["decode"]["kernels_s"])
    png = tmp_path / "plots" / "measured_roofline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measure_cli_refuses_what_does_not_apply(tiny_llama, tmp_path):
    artifact = str(tiny_llama.artifact_dir)
    with pytest.raises(EmberError, match="--wbits, --gen-len do not apply to --measure"):
        run_cli(artifact, "--measure", "--wbits", "4", "--gen-len", "8")
    with pytest.raises(EmberError, match="--measure runs on this machine"):
        run_cli(artifact, "--measure", "--hardware", "a6000")
    with pytest.raises(EmberError, match="--prompt-len 65: .* prefills at most 64 tokens"):
        measure(tiny_llama.artifact_dir, prompt_len=65, hardware=GENEROUS)
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        measure(tmp_path, hardware=GENEROUS)


@pytest.mark.slow
def test_measure_counts_the_experts_a_step_reads(tiny_models):
    """A q8f32 Qwen3-MoE artifact (8 experts, 2 a token): the expert kernels implement the experts' projections, and
    a batch-1 decode step's read 2 experts' weights, a 16-token prefill's more of them; every share of the roof is
    a share."""
    m = measure(tiny_models.exported("qwen3_moe", "q8f32").artifact_dir, prompt_len=16, batch=1, repeats=1,
                hardware=GENEROUS)
    assert (m.arch.num_experts, m.arch.experts_per_token, m.arch.expert_width) == (8, 2, 32)
    h, width, layers = m.arch.config.hidden_size, m.arch.expert_width, m.arch.config.num_hidden_layers
    one_expert = h * width * 8.5 / 8  # q8f32: 8 bits a weight and a float16 scale per 32

    def expert_kernels(stage, implements):
        return [k for k in stage.kernels if k.implements == implements]

    for stage, least, most in ((m.decode, 2, 2), (m.prefill, 3, 8)):
        for implements, rows, inner in ((("gate_proj", "up_proj"), 2 * width, h), (("down_proj",), h, width)):
            kernels = expert_kernels(stage, implements)
            assert sum(k.calls for k in kernels) == layers, (stage.name, implements)
            for k in kernels:
                pairs = k.point.op.ops / (2 * rows * inner)
                assert pairs == stage.new_tokens * stage.batch * 2
                # float32 inputs and outputs of the pairs, their order and the 9 offsets (int32)
                moved = pairs * (rows + inner) * 4 + pairs * 4 + 9 * 4
                experts_read = (k.point.op.bytes - moved) / (one_expert * rows / width * (inner / h))
                assert experts_read == pytest.approx(round(experts_read)) and least <= experts_read <= most, k.name
                assert 0 < k.fraction < 1
    assert "router" in {name for k in m.decode.kernels for name in k.implements}


def test_kernels_map_to_operators_by_the_weights_they_read():
    layer = "model.layers.3"
    assert implemented_operators([f"{layer}.self_attn.q_k_v_proj.weight", f"{layer}.self_attn.q_k_v_proj.bias"],
                                 10) == ("q_proj", "k_proj", "v_proj")
    assert implemented_operators([f"{layer}.mlp.gate_up_proj.weight"], 10) == ("gate_proj", "up_proj")
    assert implemented_operators([f"{layer}.post_attention_layernorm.weight"], 10) == ("mlp_norm",)
    assert implemented_operators(["model.embed_tokens.weight"], 0) == ("embed_tokens",)   # the lookup
    assert implemented_operators(["model.embed_tokens.weight"], 128) == ("lm_head",)      # a tied head
    quantized = ["model.embed_tokens.weight.packed", "model.embed_tokens.weight.scale"]
    assert implemented_operators(quantized, 4) == ("embed_tokens",)                       # lookup + unpacking
    assert implemented_operators(quantized, 128) == ("lm_head",)
    assert implemented_operators([f"{layer}.mlp.down_proj.weight.packed"], 128) == ("down_proj",)
    assert implemented_operators([], 10) == ()
    assert implemented_operators([f"{layer}.mlp.experts.gate_up_proj.packed"], 128) == ("gate_proj", "up_proj")
    assert implemented_operators([f"{layer}.mlp.gate.weight"], 16) == ("router",)
    assert implemented_operators([f"{layer}.mlp.shared_expert.down_proj.weight"], 16) == ("shared_down_proj",)


def test_attention_and_data_movement_bytes_by_hand():
    arch = tiny()  # H=2, Hkv=1, d=4
    # Prefill of 3 tokens: 6 causal pairs per head; K/V of 3 rows read once.
    ops, nbytes = attention_work(arch.config, batch=1, new=3, past=0, element_bytes=2)
    assert ops == 3 * 3 * 3 * 4 + 2 * 6 * (4 * 4 + 5)
    assert nbytes == 2 * (3 * 4 * 4 + 3 * 2 * 4 + 2 * 3 * 4 + 2 * 3 * 4)
    # Decode at context 5, 2 sequences: 5 pairs per head each; K/V of 5 rows per sequence.
    ops, nbytes = attention_work(arch.config, batch=2, new=1, past=4, element_bytes=2)
    assert ops == 3 * 2 * 3 * 4 + 2 * 2 * 5 * (4 * 4 + 5)
    assert nbytes == 2 * (2 * 4 * 4 + 2 * 2 * 4 + 2 * 2 * 4 + 2 * 2 * 5 * 4)
    # A matmul reads all its inputs; a gather (no arithmetic) only what it writes.
    assert moved_bytes([100, 1000, 40], num_inputs=2, ops=5) == 1140
    assert moved_bytes([4096, 8, 64], num_inputs=2, ops=0) == 128


@pytest.mark.parametrize("argv", [["--prompt-len", "1000000000", "--gen-len", "1000000000"],
                                  ["--prompt-len", "131000", "--gen-len", "100"],
                                  ["--context", "200000"]])
def test_cli_refuses_a_workload_past_the_context_window(argv):
    """1e9 + 1e9 tokens was accepted and would have evaluated a billion decode steps (~40 hours)."""
    with pytest.raises(EmberError, match=r"exceeds Llama-3\.2-1B's context window of 131072 tokens$"):
        run_cli("Llama-3.2-1B", "--hardware", "raspberry-pi-5", *argv)


def test_measured_report_fits_100_columns_unless_wide(tiny_measurement):
    """The default table fits a 100-column terminal (it needed ~170); --wide keeps every column."""
    from ember.driver.analyze.report import NARROW, format_measurement

    narrow, wide = format_measurement(tiny_measurement), format_measurement(tiny_measurement, wide=True)
    assert max(map(len, narrow.splitlines())) <= NARROW
    assert "roof op/s" in wide and "roof op/s" not in narrow
    assert max(map(len, wide.splitlines())) > NARROW
    header = next(line for line in narrow.splitlines() if line.strip().startswith("kernel"))
    assert header.split() == ["kernel", "implements", "calls", "time", "of", "roof", "bound", "predicted", "share"]
