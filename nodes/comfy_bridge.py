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


NOTICE_EVENT = "tpu_video.notice"  # the page's listener: web/tpu_video_notices.js


def send_notice(text: str, level: str = "warning", node_id: str | None = None) -> bool:
    """Show ``text`` in ComfyUI's page (a toast; the node's status where the page has no toasts): sent through
    ComfyUI's server as the custom event ``tpu_video.notice`` with the node that was running (``node_id``, or the
    one the server last said was executing) to the client that queued the prompt (every client when none did).
    False outside a running ComfyUI server (the message is in the log either way)."""
    import sys

    server = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    if server is None or not hasattr(server, "send_sync"):
        return False
    node_id = node_id if node_id is not None else getattr(server, "last_node_id", None)
    server.send_sync(NOTICE_EVENT, {"text": text, "level": level, "node": node_id},
                     getattr(server, "client_id", None))
    return True


def show_notices_in_the_page() -> None:
    """Send every runtime notice (``tpu_runtime.engine.notices``: the automatic mode's host fallbacks and refused
    models) to the page as well as the log."""
    from tpu_runtime.engine import notices

    notices.add_listener(send_notice)
