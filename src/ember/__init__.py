"""ember: compile large language models with TVM and run them with a light runtime.

The package is layered, each layer importing only those below it (pyproject.toml's
import-linter contracts check this):

    ember.cli        the command line, a thin shell over ember.driver
    ember.driver     compile driver, codegen, weight conversion, tune, farm, bench, analyze, package
    ember.cluster    serving on a Ray cluster (replicas, pipeline stages), beside the driver (the cluster extra)
    ember.serving    batching scheduler, the OpenAI API's server, protocol and tool calls, over the runtime
    ember.frontend | ember.ir_passes | ember.runtime     the stages (the runtime imports only ember.core)
    ember.schedules  kernel schedules and tuning databases
    ember.ir | ember.targets   the shared vocabulary and what a target is
    ember.core       errors, the artifact manifest, machine facts, the torch guard

Kept import-free: the runtime imports `ember.core` on devices that have only TVM's runtime
libraries, so nothing here may pull in the compiler.
"""

from importlib import metadata
from pathlib import Path

# The one version source is the distribution's metadata (pyproject.toml); `ember package` writes
# that metadata beside the runtime it copies to a device.
__version__ = metadata.version("ember")

# The bundled demo checkpoint (`ember compile demo`): `compile_model(ember.DEMO_MODEL_DIR, ...)`.
DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"
# Its draft for speculative decoding (`ember compile demo-draft`; `scripts/train_demo_model.py --draft`).
DEMO_DRAFT_DIR = Path(__file__).parent / "demo_draft"
