"""The builder of `ember tune`'s candidates: one worker process for a whole tuning job.

meta_schedule's `LocalBuilder` starts a new worker process for every batch of candidates it builds (TVM
restarts it to bound a memory leak of its workers), and one more when it is made, to check that its build
function exists. Each start imports TVM (with the torch it loads beside it where torch is installed) and
ember's schedules, which costs more than building one of ember's rounds of four candidates on a small
machine. This builder keeps its worker for the job and replaces it after `BUILDS_PER_WORKER` builds, which
bounds what a leak can hold; TVM's pool replaces a worker that a build kills or that outlives the timeout.

A candidate is built in the worker, never here: a kernel that crashes LLVM or hangs fails that trial only.
"""

from __future__ import annotations

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.support.popen_pool import MapResult, PopenPoolExecutor, StatusKind

from ember.schedules.tuning import build_candidate

BUILDS_PER_WORKER = 256


@derived_object
class CandidateBuilder(ms.builder.PyBuilder):
    """Builds candidates one at a time in a worker process kept between batches; each is written as a shared
    library linked by `linker` (None: the host's compiler), which the runner loads where it times it."""

    def __init__(self, linker: str | None, timeout_sec: float) -> None:
        super().__init__()
        self.linker = linker
        self.timeout_sec = timeout_sec
        self._pool = PopenPoolExecutor(max_workers=1, timeout=timeout_sec, maximum_process_uses=BUILDS_PER_WORKER)

    def build(self, build_inputs: list[ms.builder.BuilderInput]) -> list[ms.builder.BuilderResult]:
        linker = self.linker
        outcomes = self._pool.map_with_error_catching(
            lambda job: build_candidate(*job), [(build.mod, build.target, linker) for build in build_inputs])
        return [self._result(outcome) for outcome in outcomes]

    def _result(self, outcome: MapResult) -> ms.builder.BuilderResult:
        if outcome.status == StatusKind.COMPLETE:
            return ms.builder.BuilderResult(outcome.value, None)
        if outcome.status == StatusKind.TIMEOUT:
            return ms.builder.BuilderResult(None, f"build timed out: killed after {self.timeout_sec:g} s")
        return ms.builder.BuilderResult(None, f"build failed: {outcome.value}")

    def close(self) -> None:
        """Stop the worker."""
        self._pool.shutdown()
