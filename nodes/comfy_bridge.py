"""The few ComfyUI services the nodes use, each with a stand-in when ComfyUI is not there (tests, CLI)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def progress_bar(total: int):
    """ComfyUI's progress bar for ``total`` units, or ``None`` outside ComfyUI."""
    try:
        import comfy.utils
    except ImportError:
        return None
    return comfy.utils.ProgressBar(total)


def interrupt_requested() -> bool:
    """True once the user pressed Cancel in ComfyUI (always False outside ComfyUI)."""
    try:
        import comfy.model_management as mm
    except ImportError:
        return False
    return bool(mm.processing_interrupted())


def raise_if_interrupted() -> None:
    """Raise ComfyUI's own interrupt exception so the server reports a cancelled prompt, not an error."""
    try:
        import comfy.model_management as mm
    except ImportError:
        return
    mm.throw_exception_if_processing_interrupted()


def output_directory():
    """ComfyUI's output folder (a Path), or ``None`` outside ComfyUI."""
    try:
        import folder_paths
    except ImportError:
        return None
    from pathlib import Path

    return Path(folder_paths.get_output_directory())
