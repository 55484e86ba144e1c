"""Graph passes: IRModule in, IRModule out, one pass per file; `pipeline.py` lists them in order.

A pass that meets a model ember cannot compile raises one of ember's errors. TVM's pass
machinery re-raises an exception that crosses it as the class registered under its
name, else as a RuntimeError: ember's are registered here, so the CLI still prints
them as one line.
"""

import tvm_ffi

from ember.core import errors

for _error in (errors.EmberError, *errors.EmberError.__subclasses__()):
    tvm_ffi.register_error(_error)
