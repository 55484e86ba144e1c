"""GGUF import, checked against llama.cpp on the same files (made by llama.cpp's converter and quantizer).

Tolerances (max |logit difference| / max |logit|, 64-token prompt, demo model):
F32 and F16 1e-3 (F32 measured 1.1e-4: both sides float32, summation order differs; ember
computes F16 weights in float32, llama.cpp rounds activations to f16 for them). Q8_0 1e-2
(measured 5e-3) and Q4_0 1e-2 (6e-3): the weights are the file's bits on both sides,
and both round activations to int8 per 32 values, but not at the same points (ember
quantizes once per projection input, llama.cpp also the attention's inputs). Q4_1
2e-2 (7.7e-3): int8 activations on both sides too, with the minimum times the
activations' sum (llama.cpp's Q8_1 keeps that sum in f16, ember in float32).
llama.cpp's quantizer stores the tied embedding/output head as Q6_K in all these
files; for the three types above it is kept float (`keep_embedding`, its exact
dequantized values), so their bounds measure the stored blocks alone. The K-quant
mixes compile as a user's default does, each tensor in the format closest to its own
type with at least its bits: Q4_K_M 5e-2 (2.1e-2): its Q4_K tensors re-quantized to
q4f32_zp, its Q5_0 and Q6_K ones (v, down, head) to q8f32, its Q8_0 kept. Q5_K_M 3e-2
(1.0e-2) and Q6_K 2e-2 (1.1e-2): 5- and 6-bit tensors re-quantized to q8f32 (0.5%
relative RMS weight error each), int8 activations in the head too.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import artifact_cache
import gguf
import gguf_files
import numpy as np
import pytest
from helpers import run_ember

from ember import DEMO_MODEL_DIR
from ember.core.errors import ModelError
from ember.driver.analyze.measure import measure
from ember.driver.compiler import CompileOptions, compile_model
from ember.frontend.gguf import GGUFWeights, Metadata, gguf_config, open_gguf
from ember.frontend.gguf_tokenizer import write_tokenizer_files
from ember.ir.quant_formats import FORMATS
from ember.runtime import Engine, load_artifact
from ember.runtime.tokenizer import Tokenizer
from ember.targets.hardware import Hardware

PROMPT_LEN, NEW_TOKENS = 64, 32
# A roof above any CPU here, for timing kernels against (`ember analyze --measure`).
ROOMY = Hardware("roomy", "roomy", "cpu", {"fp32": 1e14}, memory_bandwidth=1e13, memory_capacity=1e12,
                 onchip_memory=2**20, source="test")
# file type -> (ember --quant, relative logit tolerance); see the module docstring.
# file type -> (ember --quant (None: the file's own types, per tensor), relative logit tolerance); the stored
# types compile with their own format for every weight and the Q6_K embedding/head kept float (`keep_embedding`),
# which checks the kept blocks alone; see the module docstring.
CASES = {"f32": (None, 1e-3), "f16": ("q0f32", 1e-3), "Q8_0": ("q8f32", 1e-2), "Q4_0": ("q4f32", 1e-2),
         "Q4_1": ("q4f32_zp", 2e-2), "Q4_K_M": (None, 5e-2), "Q5_K_M": (None, 3e-2), "Q6_K": (None, 2e-2)}
STORED = {"Q8_0": "q8f32", "Q4_0": "q4f32", "Q4_1": "q4f32_zp"}


@pytest.fixture(scope="module")
def demo_gguf() -> dict[str, Path]:
    """The demo model as llama.cpp writes it (F32), and quantized by llama.cpp."""
    f32, f16 = (gguf_files.convert(Path(DEMO_MODEL_DIR), outtype, pre="gpt-2") for outtype in ("f32", "f16"))
    return {"f32": f32, "f16": f16, **{t: gguf_files.quantize(f32, t) for t in CASES if t not in ("f32", "f16")}}


@pytest.fixture(scope="module")
def compiled(demo_gguf, tmp_path_factory):
    """compile(file type) -> a fresh Engine over the compiled artifact (each compiled once)."""
    artifacts = {}

    def compile_one(file_type: str) -> Engine:
        if file_type not in artifacts:
            out = tmp_path_factory.mktemp("gguf") / file_type
            quantization = CASES[file_type][0]
            keep = quantization is not None and FORMATS[quantization].quantizes
            options = CompileOptions(quantization=quantization, keep_embedding=keep, keep_lm_head=keep,
                                     max_batch=1, show_progress=False)
            artifact_cache.build(artifact_cache.artifact_key(f"demo-gguf-{file_type}", options, [demo_gguf[file_type]]),
                                 out, lambda dest: compile_model(demo_gguf[file_type], dest, options))
            artifacts[file_type] = load_artifact(out)
        return Engine(artifacts[file_type])

    return compile_one


def prompt() -> list[int]:
    rng = np.random.default_rng(0)
    return [1] + rng.integers(4, 4096, PROMPT_LEN - 1).tolist()


@pytest.mark.parametrize("file_type", list(CASES))
def test_logits_match_llama_cpp(demo_gguf, compiled, file_type) -> None:
    engine = compiled(file_type)
    ids = prompt()
    ours = engine.prefill(engine.add_sequence(), ids, all_logits=True)
    theirs = gguf_files.logits(demo_gguf[file_type], ids)
    error = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    assert error <= CASES[file_type][1], f"{file_type}: relative logit error {error:.3g}"


@pytest.mark.parametrize("file_type", ["f32", "f16", "Q8_0"])
def test_greedy_continuation_matches_llama_cpp(demo_gguf, compiled, file_type) -> None:
    engine = compiled(file_type)
    ids = prompt()[:16]
    seq = engine.add_sequence()
    token = int(np.argmax(engine.prefill(seq, ids)))
    ours = [token]
    for _ in range(NEW_TOKENS - 1):
        token = int(np.argmax(engine.decode([seq], [token])[0]))
        ours.append(token)
    assert ours == gguf_files.greedy(demo_gguf[file_type], ids, NEW_TOKENS)


@pytest.mark.parametrize("file_type", list(STORED))
def test_stored_blocks_are_kept_bit_for_bit(demo_gguf, file_type) -> None:
    """Every Q8_0/Q4_0/Q4_1 tensor packs into ember's format with the file's levels and scales, unchanged:
    unpacking gives exactly gguf's own dequantization of the file."""
    path = demo_gguf[file_type]
    reader = open_gguf(path)
    weights = GGUFWeights(path, reader, gguf_config(reader, path))
    fmt = FORMATS[STORED[file_type]]
    checked = 0
    for name, record in weights.records.items():
        stored = weights.stored_quantization(name, fmt.bits, fmt.zero_point)
        if record.type_name != file_type:
            assert stored is None
            continue
        parts = fmt.pack(stored["levels"], stored["scale"], stored.get("min"))
        np.testing.assert_array_equal(fmt.dequantize(parts, record.shape[1]), weights.load(name), err_msg=name)
        checked += 1
    assert checked >= 42


def test_k_quant_conversion_is_measured(demo_gguf) -> None:
    """Q4_K_M: each tensor goes to the format closest to its type with at least its bits (Q4_K to q4f32_zp,
    Q5_0 and Q6_K to q8f32), its Q8_0 tensors are kept bit for bit, the rest converted with the error measured."""
    path = demo_gguf["Q4_K_M"]
    reader = open_gguf(path)
    weights = GGUFWeights(path, reader, gguf_config(reader, path))
    formats = weights.stored_formats("float32")
    assert set(formats) == {name for name, record in weights.records.items() if len(record.shape) == 2}
    report = weights.conversion_report({name: FORMATS[fmt] for name, fmt in formats.items()})
    kinds = {(entry["gguf_type"], entry["stored_as"], entry["conversion"]) for entry in report.values()}
    assert kinds == {("Q8_0", "q8f32", "kept"), ("Q4_K", "q4f32_zp", "converted"), ("Q5_0", "q8f32", "converted"),
                     ("Q6_K", "q8f32", "converted"), ("F32", "float", "kept")}
    errors = {entry["stored_as"]: entry["relative_rms_error"] for entry in report.values()
              if entry["conversion"] == "converted"}
    assert 0 < errors["q8f32"] < 0.01  # int8 re-quantization of 5-6 bit values: measured 0.55%
    assert 0 < errors["q4f32_zp"] < 0.1  # Q4_K sub-blocks of 32 re-fit to one scale and minimum each: measured 3.3%


def tokenizer_texts(special: list[str]) -> list[str]:
    """200 strings: ASCII words, Unicode, emoji, whitespace runs, digits, special-token text."""
    pieces = ["Hello", "world", " the", "LORD", "said", "don't", "I'll", "we've", "x", "ABC", "élan", "naïve",
              "中文字", "日本語", "русский", "ﬁ", "🎉", "👍🏽", "🇫🇷", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ",
              "0", "12", "345", "2024-11-24", "3.14159", "1,000,000", "!?", "...", "(a)", "[b]", "{c}", "'s",
              "#$%", "~", "_", "@", *special]
    rng = np.random.default_rng(1)
    texts = ["", " ", "  ", "\n", *pieces]
    while len(texts) < 200:
        count = int(rng.integers(1, 8))
        texts.append("".join(pieces[i] + (" " if rng.random() < 0.5 else "")
                             for i in rng.integers(0, len(pieces), count)))
    return texts


@pytest.fixture(scope="module")
def sentencepiece_gguf() -> dict[str, Path]:
    """Random tiny llama and qwen2 models with a SentencePiece tokenizer, converted by llama.cpp."""
    return {model_type: gguf_files.sentencepiece_model(model_type) for model_type in ("llama", "qwen2")}


@pytest.mark.parametrize("tokenizer_model", ["gpt2", "llama"])
def test_tokenizer_matches_llama_cpp(demo_gguf, sentencepiece_gguf, tmp_path, tokenizer_model) -> None:
    """200 strings tokenize as llama.cpp tokenizes them: byte-level BPE (demo) and SentencePiece BPE."""
    path = demo_gguf["f32"] if tokenizer_model == "gpt2" else sentencepiece_gguf["llama"]
    write_tokenizer_files(Metadata(open_gguf(path), path), tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    texts = tokenizer_texts(["<s>", "</s>", "<unk>", "<pad>"])
    mismatches = [(text, ours.encode(text), ids) for text, ids in zip(texts, gguf_files.tokenize(path, texts))
                  if ours.encode(text) != ids]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, first: {mismatches[0]}"


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_random_model_logits_match_llama_cpp(sentencepiece_gguf, tmp_path, model_type) -> None:
    """GQA q/k un-permutation (llama) and biased q/k/v (qwen2) on random weights, F32."""
    error = _float32_logit_error(sentencepiece_gguf[model_type], tmp_path, 32)
    assert error <= 1e-3, f"{model_type}: relative logit error {error:.3g}"


def _float32_logit_error(path: Path, tmp_path: Path, tokens: int) -> float:
    """max |logit difference| / max |logit| of `path` compiled at q0f32 against llama.cpp, over `tokens`
    random tokens of a 1000-token vocabulary after <s>."""
    options = CompileOptions(quantization="q0f32", max_batch=1, show_progress=False)
    artifact_cache.build(artifact_cache.artifact_key(f"gguf-{path.stem}", options, [path]), tmp_path / "out",
                         lambda dest: compile_model(path, dest, options))
    engine = Engine(load_artifact(tmp_path / "out"))
    ids = [1] + np.random.default_rng(0).integers(3, 1000, tokens - 1).tolist()
    ours = engine.prefill(engine.add_sequence(), ids, all_logits=True)
    theirs = gguf_files.logits(path, ids)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.llama_cpp
def test_llama3_rope_scaling_from_rope_freqs_matches_llama_cpp(tmp_path) -> None:
    """llama.cpp's converter stores Llama 3 RoPE scaling only as the 'rope_freqs.weight' divisors; the scaling
    recovered from them is the checkpoint's (factor, and low/high_freq_factor relative to the original context),
    and the logits match llama.cpp's on the file. The tiny config puts its 8 frequencies in all three regions."""
    import models

    model_type, overrides = models.TINY_MODELS["llama3_rope"]
    path = gguf_files.sentencepiece_model(model_type, **overrides)
    assert "rope_freqs.weight" in {t.name for t in open_gguf(path).tensors}
    scaling = gguf_config(open_gguf(path), path).rope_scaling
    original = overrides["rope_parameters"]
    context = scaling["original_max_position_embeddings"] / original["original_max_position_embeddings"]
    assert scaling["factor"] == pytest.approx(original["factor"], rel=1e-6)
    for key in ("low_freq_factor", "high_freq_factor"):
        assert scaling[key] / context == pytest.approx(original[key], rel=1e-4), key
    error = _float32_logit_error(path, tmp_path, 96)
    assert error <= 1e-3, f"relative logit error {error:.3g}"


def test_llama_3_1_rope_freqs_give_back_its_scaling(tmp_path) -> None:
    """Llama 3.1's own RoPE parameters (head_dim 128, theta 500000): the divisors a converter stores are
    transformers' unscaled over scaled frequencies; the recovered scaling gives transformers' frequencies
    back. A tensor that is not Llama 3 scaling, of the wrong length, or of all ones is told apart."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ember.frontend.gguf_rope import llama3_divisors, llama3_rope_scaling

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, rope_parameters=rope)
    scaled = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].double().numpy()
    plain = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    divisors = (plain / scaled).astype(np.float32)
    scaling = llama3_rope_scaling(divisors, 500000.0, 128, tmp_path)
    assert scaling is not None and scaling["factor"] == pytest.approx(8.0)
    recovered = plain / llama3_divisors(plain, scaling)
    assert np.allclose(recovered, scaled, rtol=1e-5, atol=0)
    assert llama3_rope_scaling(np.ones(64, np.float32), 500000.0, 128, tmp_path) is None
    with pytest.raises(ModelError, match=r"'rope_freqs.weight' is not Llama 3 RoPE scaling"):
        llama3_rope_scaling(divisors[::-1].copy(), 500000.0, 128, tmp_path)
    with pytest.raises(ModelError, match=r"'rope_freqs.weight' has 32 values; a head of 128 rotates 64"):
        llama3_rope_scaling(divisors[:32], 500000.0, 128, tmp_path)


def _edit_tensor(name: str, part: int, value: object):
    def edit(reader) -> None:
        field = next(t.field for t in reader.tensors if t.name == name)
        field.parts[part][...] = value
    return edit


def _edit_field(key: str, part: int, value: object):
    def edit(reader) -> None:
        reader.fields[key].parts[part][...] = value
    return edit


def _last_tensor_offset_past_end(reader) -> None:
    reader.tensors[-1].field.parts[5][...] = 10**9


# name -> (edit of the file: bytes -> bytes, or a function of a writable GGUFReader; what the error says)
BAD_FILES = {
    "truncated": (lambda data: data[: len(data) // 2], "past the end of the file"),
    "truncated_header": (lambda data: data[:1000], "truncated or corrupt GGUF header"),
    "wrong_magic": (lambda data: b"GGUX" + data[4:], "not a GGUF file"),
    "unsupported_version": (lambda data: data[:4] + (7).to_bytes(4, "little") + data[8:], "GGUF version 7"),
    "size_mismatch": (_edit_tensor("token_embd.weight", 3, [256, 4097]), "overlaps the bytes of tensor"),
    "offset_past_end": (_last_tensor_offset_past_end, "past the end of the file"),
    "unsupported_architecture": (_edit_field("general.architecture", 4, list(b"rwkv6")),
                                 "general.architecture 'rwkv6' is not supported; supported: llama, qwen2, "),
    # A Llama file labelled another architecture transformers reads: that model's tensors are not in it.
    "mislabelled_architecture": (_edit_field("general.architecture", 4, list(b"bloom")),
                                 "tensor 'transformer.word_embeddings_layernorm.weight' "
                                 "(GGUF 'token_embd_norm.weight') is missing from the file"),
    "unsupported_tensor_type": (_edit_tensor("blk.0.ffn_up.weight", 4, gguf.GGMLQuantizationType.IQ2_XXS.value),
                                "type IQ2_XXS, which ember does not read; supported: F32"),
    "wrong_metadata_type": (_edit_field("llama.block_count", 2, gguf.GGUFValueType.FLOAT32.value),
                            "metadata 'llama.block_count' must be an integer, got float32"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_fails_with_one_line_and_writes_nothing(demo_gguf, tmp_path, case) -> None:
    edit, expected = BAD_FILES[case]
    path = tmp_path / "model.gguf"
    shutil.copyfile(demo_gguf["f32"], path)
    if edit.__code__.co_varnames[:1] == ("data",):
        path.write_bytes(edit(path.read_bytes()))
    else:
        reader = gguf.GGUFReader(path, "r+")
        edit(reader)
        reader.data.flush()
        del reader
    out = tmp_path / "out"
    with pytest.raises(ModelError) as err:
        compile_model(path, out, CompileOptions(show_progress=False))
    message = str(err.value)
    assert message.startswith(str(path)) and "\n" not in message and expected in message, message
    assert not out.exists()


@pytest.mark.slow
def test_cli_compiles_inspects_and_analyzes_a_gguf_file(demo_gguf, tmp_path) -> None:
    """`ember compile FILE.gguf` with no --quant keeps the file's own types per tensor (Q4_K_M: mostly Q4_K,
    so q4f32_zp, with its Q6_K head and Q8_0 tensors in q8f32), prints what each group of tensors became with
    the re-quantization error, and records it for `ember inspect`; `ember analyze` reads the file's metadata."""
    path = tmp_path / "demo-Q4_K_M.gguf"
    path.symlink_to(demo_gguf["Q4_K_M"])
    out = tmp_path / "out"
    result = run_ember("compile", str(path), "-o", str(out), "--no-progress")
    assert result.returncode == 0, result.stderr
    report = [line for line in result.stderr.splitlines() if "GGUF weights:" in line]
    assert any("Q8_0 -> q8f32: kept as stored" in line for line in report), result.stderr
    assert any(re.search(r"Q4_K -> q4f32_zp: re-quantized, relative RMS weight error mean \d", line)
               for line in report), result.stderr
    assert any("3 tensors Q6_K -> q8f32: re-quantized" in line for line in report), result.stderr
    assert any("F32 -> float: kept as stored" in line for line in report), result.stderr

    shown = run_ember("inspect", str(out))
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"quantization\s+q4f32_zp \(5 bits/weight, float32 compute\); per tensor as the file stores "
                     r"them: q4f32_zp, q8f32", shown.stdout), shown.stdout
    assert re.search(rf"GGUF file\s+{path.name} \(sha256 [0-9a-f]{{12}}\)", shown.stdout), shown.stdout
    assert "Q4_K -> q4f32_zp: re-quantized" in shown.stdout

    # The mixed artifact's kernels are rebuilt from its manifest (v and down separate from the 4-bit q/k
    # and gate/up where the file holds them in Q6_K), timed and mapped to every projection.
    measured = measure(out, prompt_len=8, batch=1, repeats=1, hardware=ROOMY)
    assert 5.0 < measured.precision.wbits < 8.5  # between q4f32_zp's 5 bits/weight and q8f32's 8.5
    for stage in (measured.prefill, measured.decode):
        implemented = {name for k in stage.kernels for name in k.implements}
        assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"} <= implemented

    analyzed = run_ember("analyze", str(path), "--hardware", "raspberry-pi-5", "--wbits", "4", "--prompt-len", "128",
                         "--gen-len", "128")
    assert analyzed.returncode == 0, analyzed.stderr
    assert "demo-Q4_K_M" in analyzed.stdout


def test_llama_cpp_sources_come_into_an_empty_cache(tmp_path, monkeypatch) -> None:
    """On a machine that never ran the suite, ~/.cache/ember/llama-cpp/ does not exist: the sdist download
    (the converter's first step, before any build) makes it, rather than failing every GGUF test with
    FileNotFoundError as it did on a fresh machine. pip is replaced by a stand-in that writes the file."""
    build = gguf_files._build_script()
    cache = tmp_path / "cold" / "llama-cpp"
    monkeypatch.setattr(build, "CACHE", cache)
    downloads = []

    def pip_download(command, check):
        folder = Path(command[command.index("-d") + 1])
        (folder / f"llama_cpp_python-{build.VERSION}.tar.gz").write_bytes(b"sdist")
        downloads.append(command)

    monkeypatch.setattr(build.subprocess, "run", pip_download)
    log = tmp_path / "log"
    with log.open("w") as out:
        path = build._sdist(build.VERSION, out)
        assert build._sdist(build.VERSION, out) == path  # downloaded once
    assert path.parent == cache and path.read_bytes() == b"sdist" and len(downloads) == 1
    assert [p.name for p in cache.iterdir()] == [path.name]  # no download folder left behind
