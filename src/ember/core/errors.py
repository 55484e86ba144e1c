"""The errors ember reports to users.

Every failure a user can cause (a bad model directory, an unknown target, a tampered
artifact, a prompt longer than the context window) raises a subclass of `EmberError`
with a message that names the file, tensor or option at fault. The CLI catches
`EmberError` once and prints the message without a traceback.
"""


class EmberError(Exception):
    """Base class of user-facing errors."""


class ModelError(EmberError):
    """The model directory, its config or its weights are unusable."""


class TargetError(EmberError):
    """The requested target is unknown, malformed, or not built into this TVM."""


class ArtifactError(EmberError):
    """A compiled artifact is missing files, tampered with, or from another version."""


class GenerationError(EmberError):
    """A request to the runtime cannot be served (context overflow, bad sampling options)."""


class TuningError(EmberError):
    """A tuning database cannot be used or written (wrong machine for tuning, damaged files)."""


class FarmError(EmberError):
    """A device farm cannot be used: its tracker is unreachable, no device of a key registers or frees up,
    or a device fails a request."""
