"""GGUF files made by llama.cpp's own tools, and llama.cpp's answers on them, for the GGUF tests.

Files are written by `convert_hf_to_gguf.py` from the llama-cpp-python sdist (pinned by
`scripts/build_llama_cpp.py`'s VERSION) and quantized by `llama_cpp.llama_model_quantize`;
never by ember. llama.cpp runs in a subprocess with the avx2 build on its path (as
`scripts/peers.py` does), so this process imports neither llama_cpp nor the sdist's gguf-py.
Results are cached under ~/.cache/ember/gguf/, keyed by a hash of the inputs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "ember" / "gguf"
# llama.cpp's LLAMA_FTYPE_MOSTLY_* codes for `llama_model_quantize`.
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
# The demo tokenizer's pre-tokenizer hash is unknown to llama.cpp; it is GPT-2's byte-level split.
_CONVERT = """
import sys
from conversion import base
pre = sys.argv[1]
if pre != "-":
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def _build_script():
    if "build_llama_cpp" not in sys.modules:
        spec = importlib.util.spec_from_file_location("build_llama_cpp", REPO_ROOT / "scripts" / "build_llama_cpp.py")
        sys.modules["build_llama_cpp"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["build_llama_cpp"])
    return sys.modules["build_llama_cpp"]


def llama_cpp_dir() -> Path:
    """The avx2 build of llama-cpp-python (built on first use, ~10 min on 2 cores)."""
    build = _build_script()
    return build.ensure_built(build.LEVELS["avx2"])


def _converter_dir() -> Path:
    """llama.cpp's converter and its gguf-py, unpacked from the pinned sdist once."""
    build = _build_script()
    dest = build.CACHE / f"convert-{build.VERSION}"
    if not (dest / "convert_hf_to_gguf.py").exists():
        prefix = f"llama_cpp_python-{build.VERSION}/vendor/llama.cpp/"
        with tarfile.open(build._sdist(build.VERSION, sys.stderr)) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile() and (
                m.name[len(prefix):] == "convert_hf_to_gguf.py"
                or m.name[len(prefix):].startswith(("conversion/", "gguf-py/")))]
            partial = dest.with_suffix(".partial")
            for member in members:
                member.name = member.name[len(prefix):]
                tar.extract(member, partial, filter="data")
            os.replace(partial, dest)
    return dest


def _key(*parts: object) -> str:
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path) and part.is_dir():
            for file in sorted(part.iterdir()):
                digest.update(file.name.encode() + file.read_bytes())
        elif isinstance(part, Path):
            digest.update(part.read_bytes())
        else:
            digest.update(repr(part).encode())
    return digest.hexdigest()[:16]


def convert(model_dir: Path, outtype: str = "f32", pre: str = "-") -> Path:
    """`model_dir` converted by llama.cpp's convert_hf_to_gguf.py (`pre`: the pre-tokenizer name to assume)."""
    path = CACHE / f"{_key(model_dir, outtype, pre)}-{outtype}.gguf"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tools = _converter_dir()
        env = {**os.environ, "PYTHONPATH": f"{tools / 'gguf-py'}{os.pathsep}{tools}"}
        partial = path.with_suffix(".partial")
        subprocess.run([sys.executable, "-c", _CONVERT, pre, str(model_dir), "--outtype", outtype,
                        "--outfile", str(partial)], env=env, check=True, capture_output=True)
        os.replace(partial, path)
    return path


def _llama_cpp(code: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": str(llama_cpp_dir())}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode:
        raise RuntimeError(f"llama.cpp worker failed:\n{result.stderr[-3000:]}")
    return result.stdout


def quantize(source: Path, type_name: str) -> Path:
    """`source` quantized by llama.cpp into `type_name` (a key of FTYPES)."""
    path = source.with_name(f"{source.stem}-{type_name}.gguf")
    if not path.exists():
        partial = path.with_suffix(".partial")
        _llama_cpp(f"""
import ctypes, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = {FTYPES[type_name]}
assert llama_cpp.llama_model_quantize({str(source).encode()!r}, {str(partial).encode()!r}, ctypes.byref(params)) == 0
""")
        os.replace(partial, path)
    return path


# llama.cpp's context options for the comparisons: its keys and values cached in float32 (GGML_TYPE_F32), not its
# default float16, which rounds every attention input and flips near-tied expert choices.
_CONTEXT = "type_k=0, type_v=0, n_threads=2, verbose=False"


def logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits [len(ids), vocab] for `ids` in one batch (2 threads)."""
    out = CACHE / f"logits-{_key(path, ids, _CONTEXT)}.npy"
    if not out.exists():
        _llama_cpp(f"""
import numpy as np
from llama_cpp import Llama
llm = Llama({str(path)!r}, logits_all=True, n_ctx={len(ids) + 8}, n_batch={len(ids)}, {_CONTEXT})
llm.eval({ids!r})
np.save({str(out)!r}, np.array(llm.scores[:{len(ids)}], dtype=np.float32))
""")
    return np.load(out)


def greedy(path: Path, ids: list[int], new_tokens: int) -> list[int]:
    """llama.cpp's greedy continuation of `ids` (argmax of its logits, one token at a time)."""
    return json.loads(_llama_cpp(f"""
import json, numpy as np
from llama_cpp import Llama
llm = Llama({str(path)!r}, n_ctx={len(ids) + new_tokens + 8}, n_batch={len(ids)}, {_CONTEXT})
llm.eval({ids!r})
out = []
for _ in range({new_tokens}):
    token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
    out.append(token)
    llm.eval([token])
print(json.dumps(out))
"""))


def perplexity(path: Path, windows: list[list[int]]) -> float:
    """llama.cpp's perplexity over `windows`, scored as `runtime/evaluate.py` scores them: each window in a
    fresh context, every token after its first predicted from the logits of the tokens before it."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(windows, file)
    try:
        return float(_llama_cpp(f"""
import json, math, numpy as np
from llama_cpp import Llama
windows = json.load(open({file.name!r}))
longest = max(map(len, windows))
llm = Llama({str(path)!r}, logits_all=True, n_ctx=longest + 8, n_batch=longest, n_threads=2, verbose=False)
nll = tokens = 0
for ids in windows:
    llm.reset()
    llm.eval(ids[:-1])
    logits = np.array(llm.scores[:len(ids) - 1], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    nll -= log_probs[np.arange(len(ids) - 1), ids[1:]].sum()
    tokens += len(ids) - 1
print(math.exp(nll / tokens))
""", timeout=1800))
    finally:
        os.unlink(file.name)


def tokenize(path: Path, texts: list[str]) -> list[list[int]]:
    """llama.cpp's token ids for each of `texts` (BOS/EOS as the file says, special tokens matched)."""
    return json.loads(_llama_cpp(f"""
import json
from llama_cpp import Llama
llm = Llama({str(path)!r}, vocab_only=True, verbose=False)
# add_bos=True lets llama.cpp add the special tokens its vocabulary asks for (add_bos_token / add_eos_token).
print(json.dumps([llm.tokenize(t.encode(), add_bos=True, special=True) for t in {texts!r}]))
"""))


def sentencepiece_model(model_type: str, vocab_size: int = 1000, **overrides: object) -> Path:
    """A random tiny `model_type` checkpoint (config `overrides`) whose tokenizer is a SentencePiece BPE model
    (byte fallback) trained on the demo model's validation text, converted by llama.cpp (tokenizer.ggml.model
    "llama")."""
    import models
    import sentencepiece

    from ember import DEMO_MODEL_DIR

    model_dir = CACHE / f"sentencepiece-{model_type}-{vocab_size}{f'-{_key(overrides)}' if overrides else ''}"
    if not (model_dir / "tokenizer.model").exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        config = models.make_config(model_type, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, **overrides)
        model = models.random_model(config)
        model.save_pretrained(model_dir, safe_serialization=True)
        sentencepiece.SentencePieceTrainer.train(
            input=str(Path(DEMO_MODEL_DIR) / "validation.txt"), model_prefix=str(model_dir / "partial"),
            model_type="bpe", vocab_size=vocab_size, byte_fallback=True, character_coverage=1.0,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
        os.replace(model_dir / "partial.model", model_dir / "tokenizer.model")
    return convert(model_dir, "f32")
