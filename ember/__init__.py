"""ember: compile large language models with TVM and run them with a light runtime.

Kept import-free on purpose: the runtime imports `ember.manifest` and `ember.errors`
on devices that have only TVM's runtime libraries, so nothing here may pull in the
compiler.
"""

__version__ = "0.1.0"
