"""Run by tests/test_edge.py with a device's Python (under qemu-aarch64, or this machine's for the x86 reference):
load an artifact with ember's runtime alone, write the logits of a prompt and the greedy tokens after it.

    python edge_run.py ARTIFACT PROMPT_IDS_JSON NEW_TOKENS OUT_PREFIX

Writes OUT_PREFIX.npy (the prompt's logits, [tokens, vocab]) and OUT_PREFIX.json (the greedy tokens,
the machine, and the heavy libraries found loaded: none expected).
"""

import json
import platform
import sys
from pathlib import Path

import numpy as np

from ember.runtime import Engine, load_artifact

HEAVY_MODULES = ("torch", "transformers", "tvm.relax", "ember.frontend", "ember.ir_passes", "ember.schedules")


def main() -> None:
    artifact_dir, prompt_json, new_tokens, out_prefix = sys.argv[1:]
    prompt = json.loads(prompt_json)
    engine = Engine(load_artifact(Path(artifact_dir)))
    seq = engine.add_sequence()
    logits = engine.prefill(seq, prompt, all_logits=True)
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < int(new_tokens):
        tokens.append(int(np.argmax(engine.decode([seq], [tokens[-1]])[0])))
    maps = Path("/proc/self/maps").read_text()
    np.save(out_prefix + ".npy", logits)
    Path(out_prefix + ".json").write_text(json.dumps({
        "tokens": tokens, "machine": platform.machine(),
        "heavy_modules": [name for name in HEAVY_MODULES if name in sys.modules],
        "compiler_library_loaded": "libtvm.so" in maps,
    }))


if __name__ == "__main__":
    main()
