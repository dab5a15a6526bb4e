"""Errors a user can act on.

Every check that can fail because of what a user typed, picked or downloaded raises ``InputError`` before any
compile, with a message that names the input and says how to fix it. ComfyUI shows the message on the node.
"""


class InputError(ValueError):
    """Bad input: the message names the input and the fix."""


class ModelFolderError(InputError):
    """A model folder that is missing, incomplete, or not the model family asked for."""


class StageFileError(InputError):
    """A saved stage file that does not fit the model or request it is used with."""


class Interrupted(RuntimeError):
    """Sampling stopped at a step boundary because the user asked for it."""


class SliceError(RuntimeError):
    """A multi-host slice lost a process or fell out of step: the message names the host and what to restart."""


class AcceleratorUnavailable(RuntimeError):
    """The machine has a TPU (or one was asked for) but the runtime would run on the CPU: the message says why (libtpu
    missing, the chips held by another process, mismatched releases, JAX's own error) and the fix. Not an
    ``InputError``: nothing the user typed into a node is wrong, and no caller may fall back to the host on it."""


class DeviceMemoryError(InputError):
    """A part of a model did not fit the devices' memory: the message names the part, what it needed against what the
    chips have, the mesh, and the fix (a larger slice, ``fsdp``, a smaller size, ``plan``)."""
