"""ember: compile large language models with TVM and run them with a light runtime.

Kept import-free on purpose: the runtime imports `ember.manifest` and `ember.errors`
on devices that have only TVM's runtime libraries, so nothing here may pull in the
compiler.
"""

from pathlib import Path

__version__ = "0.1.0"

# The bundled demo checkpoint (`ember compile demo`): `compile_model(ember.DEMO_MODEL_DIR, ...)`.
DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"
# Its draft for speculative decoding (`ember compile demo-draft`; `scripts/train_demo_model.py --draft`).
DEMO_DRAFT_DIR = Path(__file__).parent / "demo_draft"
