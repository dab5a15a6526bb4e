"""Notices for the user, in the log and wherever else the user looks.

The runtime knows nothing of ComfyUI; a model that stays on the host (the automatic mode's fallbacks and refusals)
must still be said in the page, not only in a console nobody watches. ``warn`` logs the message and hands it to every
listener: ComfyUI's node layer installs one at load (``nodes/comfy_bridge.py``) that sends it to the page as a
toast. A listener that fails costs its message, never the caller's work.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

Listener = Callable[[str, str], None]  # (text, level)

_listeners: list[Listener] = []
_lock = threading.Lock()


def add_listener(listener: Listener) -> None:
    """Call ``listener(text, level)`` with every notice from now on (once, however often it is added)."""
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def warn(logger: logging.Logger, text: str) -> None:
    """Log ``text`` as a warning on ``logger`` and show it wherever a listener shows notices."""
    logger.warning("%s", text)
    publish(text, "warning")


def publish(text: str, level: str = "warning") -> None:
    """Hand ``text`` to every listener."""
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(text, level)
        except Exception as error:  # noqa: BLE001 - a notice that cannot be shown is still in the log
            log.debug("a notice listener failed: %s: %s", type(error).__name__, error)
