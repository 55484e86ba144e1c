"""Run by tests/test_edge.py with a device's Python (under qemu-aarch64, or this machine's for the x86 reference):
load artifacts with ember's runtime alone, write the logits of a prompt and the greedy tokens after it.

    python edge_run.py PROMPT_IDS_JSON NEW_TOKENS OUT_DIR ARTIFACT...

For each ARTIFACT writes OUT_DIR/NAME.npy (the prompt's logits, [tokens, vocab]) and OUT_DIR/NAME.json (the
greedy tokens, the machine, and the heavy libraries found loaded at the end: none expected on a device).
One process runs them all: importing TVM under emulation takes ~20 s.
"""

import json
import platform
import sys
from pathlib import Path

import numpy as np

from ember.runtime import Engine, load_artifact

HEAVY_MODULES = ("torch", "transformers", "tvm.relax", "ember.frontend", "ember.ir_passes", "ember.schedules")


def greedy(artifact_dir: Path, prompt: list[int], new_tokens: int) -> tuple[np.ndarray, list[int]]:
    engine = Engine(load_artifact(artifact_dir))
    seq = engine.add_sequence()
    logits = engine.prefill(seq, prompt, all_logits=True)
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < new_tokens:
        tokens.append(int(np.argmax(engine.decode([seq], [tokens[-1]])[0])))
    return logits, tokens


def main() -> None:
    prompt_json, new_tokens, out_dir, *artifacts = sys.argv[1:]
    results = {Path(a).name: greedy(Path(a), json.loads(prompt_json), int(new_tokens)) for a in artifacts}
    loaded = {"machine": platform.machine(),
              "heavy_modules": [name for name in HEAVY_MODULES if name in sys.modules],
              "compiler_library_loaded": "libtvm.so" in Path("/proc/self/maps").read_text()}
    for name, (logits, tokens) in results.items():
        np.save(Path(out_dir) / f"{name}.npy", logits)
        (Path(out_dir) / f"{name}.json").write_text(json.dumps({"tokens": tokens, **loaded}))


if __name__ == "__main__":
    main()
