"""ember's light runtime: load an artifact, manage the paged KV cache, generate text.

Imports only TVM's runtime, numpy, tokenizers and jinja2: never the compiler side
of ember (frontend, ir_passes, schedules), nor serving, torch or transformers, so it runs
on a device that has only TVM's runtime libraries (`TVM_USE_RUNTIME_LIB=1`): what `ember
package` ships. Serving many requests over HTTP is the layer above (`ember.serving`).
A device joins a farm with `python -m ember.runtime.rpc_device` (TVM's RPC server with
ember's device functions), which runs `ember.runtime.bench` for `ember bench`.
"""

from ember.core.without_torch import hide_torch_from_tvm

hide_torch_from_tvm()  # before TVM is imported: where torch is installed, TVM would load it too

from ember.runtime.artifact import Artifact, load_artifact  # noqa: E402
from ember.runtime.engine import Engine  # noqa: E402
from ember.runtime.generate import Generation, generate  # noqa: E402
from ember.runtime.sampling import SamplingParams  # noqa: E402

__all__ = ["Artifact", "Engine", "Generation", "SamplingParams", "generate", "load_artifact"]
