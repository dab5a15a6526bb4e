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


def executing_node() -> str | None:
    """The id of the node ComfyUI is running in this thread (its execution context where the server has one, else
    the node the server last said was executing), or None outside a running ComfyUI server."""
    import sys

    utils = sys.modules.get("comfy_execution.utils")
    context = getattr(utils, "get_executing_context", lambda: None)()
    if context is not None:
        return str(context.node_id)
    server = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    node_id = getattr(server, "last_node_id", None)
    return None if node_id is None else str(node_id)


def send_progress_text(text: str, node_id: str | None) -> bool:
    """``text`` under the node ``node_id`` in the page: ComfyUI's progress text (the server's
    ``send_progress_text``), to the client that queued the prompt. False outside a running ComfyUI server, without
    a node, or on a server without progress text."""
    import sys

    server = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    if node_id is None or server is None or not hasattr(server, "send_progress_text"):
        return False
    server.send_progress_text(text, node_id, getattr(server, "client_id", None))
    return True


def show_compile_progress_on_the_node() -> None:
    """While the runtime compiles a program (``tpu_runtime.engine.progress``), the node that asked for it shows what
    and for how long; a program loaded from a cache says so."""
    from tpu_runtime.engine import progress

    progress.set_context(executing_node)
    progress.add_listener(_progress_on_the_node)


def _progress_on_the_node(text: str, shown) -> None:
    send_progress_text(text, shown.context)
