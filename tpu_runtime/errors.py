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
