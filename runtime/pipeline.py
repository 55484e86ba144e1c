"""A model split by layers (`ember compile --pipeline-stages K`), run stage by stage.

A pipeline artifact is a directory whose manifest names its stages (`Manifest.pipeline`), each a complete artifact
of a range of layers with a KV cache of its own layers (`Manifest.pipeline_stage`). A `StageEngine` runs one stage
over its cache: the first takes token ids, the others float32 hidden states [n, hidden_size]; the last gives
logits, the others hidden states. `LocalPipeline` chains them in this process with `Engine`'s API; across machines
the same stages are driven by `ember.cluster`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ember.core.errors import ArtifactError, GenerationError
from ember.core.manifest import read_manifest, verify_pipeline_stages
from ember.runtime.artifact import Artifact, load_artifact
from ember.runtime.engine import Engine


def pipeline_stage_dirs(pipeline_dir: Path) -> list[Path]:
    """The stage directories of the pipeline artifact at `pipeline_dir`, in order, after checking its files and
    each stage's own manifest and files."""
    pipeline_dir = Path(pipeline_dir)
    return verify_pipeline_stages(pipeline_dir, read_manifest(pipeline_dir))


class StageEngine(Engine):
    """One stage of a pipeline over its own KV cache: `prefill` and `decode` take what the stage takes (token ids,
    or hidden states [n, hidden_size]) and give what it gives (logits, or hidden states)."""

    def __init__(self, artifact: Artifact | Path, max_context: int | None = None) -> None:
        if not isinstance(artifact, Artifact):
            artifact = load_artifact(Path(artifact), stage=True)
        stage = artifact.manifest.pipeline_stage
        if stage is None:
            raise ArtifactError(f"{artifact.path}: not a pipeline stage (its manifest has no pipeline_stage)")
        super().__init__(artifact, max_context)
        self.index, self.count = int(stage["index"]), int(stage["count"])
        self.layers = tuple(stage["layers"])
        self.hidden_size = int(stage["hidden_size"])
        self.takes_tokens = stage["input"] == "token_ids"
        self.gives_logits = stage["output"] == "logits"

    def prefill(self, seq_id: int, x: Sequence[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Append n positions to `seq_id` (token ids [n], or hidden [n, hidden_size]); the last stage's logits
        ([vocab] for the last position, [n, vocab] with `all_logits`), another's hidden states [n, hidden_size]."""
        self._check_known(seq_id)
        rows = self._inputs(x)
        if not len(rows):
            raise GenerationError("prefill needs at least one token")
        self._check_room({seq_id: len(rows)})
        every = all_logits or not self.gives_logits
        outputs = []
        for begin in range(0, len(rows), self.prefill_chunk):
            chunk = rows[begin: begin + self.prefill_chunk]
            last = begin + len(chunk) >= len(rows)
            positions = np.arange(len(chunk), dtype=np.int32) if every else np.array([len(chunk) - 1], np.int32)
            out = self._forward("prefill", [seq_id], [len(chunk)], chunk[None], positions)
            if every or last:
                outputs.append(np.array(out[0]))
        result = np.concatenate(outputs, axis=0)
        return result if every else result[-1]

    def decode(self, seq_ids: Sequence[int], x: Sequence[int] | np.ndarray) -> np.ndarray:
        """Append one position to each sequence (token ids [b], or hidden [b, hidden_size]); [b, vocab] logits or
        [b, hidden_size] hidden states."""
        rows = self._inputs(x)
        if len(seq_ids) != len(rows) or not seq_ids:
            raise GenerationError("decode needs one token per sequence")
        for seq_id in seq_ids:
            self._check_known(seq_id)
        self._check_room({seq_id: 1 for seq_id in seq_ids})
        return np.array(self._forward("decode", list(seq_ids), [1] * len(seq_ids), rows[:, None])[:, 0, :])

    def _inputs(self, x: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token ids as int32 [n] (checked against the vocabulary), or hidden states as float32 [n, hidden_size]."""
        if self.takes_tokens:
            return self._check_tokens(x) if len(x) else np.zeros(0, np.int32)
        rows = np.ascontiguousarray(x, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] != self.hidden_size:
            raise GenerationError(f"stage {self.index} takes hidden states [n, {self.hidden_size}], "
                                  f"got shape {list(rows.shape)}")
        return rows


class LocalPipeline:
    """Every stage of a pipeline artifact in this process, chained: `Engine`'s prefill / decode /
    add_sequence / remove_sequence, one sequence id naming the same sequence in every stage."""

    def __init__(self, pipeline_dir: Path, max_context: int | None = None) -> None:
        self.stages = [StageEngine(path, max_context) for path in pipeline_stage_dirs(pipeline_dir)]
        last = self.stages[-1]
        self.vocab_size, self.max_batch, self.context_window = last.vocab_size, last.max_batch, last.context_window
        self.prefill_chunk = last.prefill_chunk
        self.tokenizer = self.stages[0].artifact.tokenizer

    def add_sequence(self) -> int:
        """Start an empty sequence in every stage; returns its id."""
        ids = {stage.add_sequence() for stage in self.stages}
        if len(ids) != 1:
            raise GenerationError(f"the stages gave one sequence different ids {sorted(ids)}")
        return ids.pop()

    def remove_sequence(self, seq_id: int) -> None:
        """Free a sequence's pages in every stage."""
        for stage in self.stages:
            stage.remove_sequence(seq_id)

    def length(self, seq_id: int) -> int:
        """Tokens currently cached for `seq_id`."""
        return self.stages[0].length(seq_id)

    def prefill(self, seq_id: int, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append `token_ids` to `seq_id` through every stage; logits [vocab] for the last, or [n, vocab]."""
        x = self.stages[0].prefill(seq_id, token_ids, all_logits)
        for stage in self.stages[1:]:
            x = stage.prefill(seq_id, x, all_logits)
        return x

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append one token to each sequence through every stage; logits [len(seq_ids), vocab]."""
        x = self.stages[0].decode(seq_ids, token_ids)
        for stage in self.stages[1:]:
            x = stage.decode(seq_ids, x)
        return x
