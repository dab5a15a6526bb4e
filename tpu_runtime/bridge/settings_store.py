"""ComfyUI's settings store: the values its settings dialog saved (``comfy.settings.json`` of the default user), and
the process-wide settings the pack reads from it.

``TPUVideo.CacheDir`` (added to the dialog by ``web/tpu_video_widgets.js``): the persistent compilation cache
folder. A process has one (``engine.runtime.get_runtime``), so it is a setting of the server, not an input of each
node: the runtime starts with it when a node (or the automatic mode) first needs the runtime; a folder chosen later
takes effect at the next start, and the log says so once. Empty: ``$TPU_VIDEO_CACHE_DIR`` or the per-user default.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_DIR_SETTING = "TPUVideo.CacheDir"
_warned: set[str] = set()


def settings_file() -> str | None:
    """ComfyUI's settings store of its (default) user, or None outside ComfyUI (or a ComfyUI without users)."""
    user_directory = getattr(sys.modules.get("folder_paths"), "get_user_directory", None)
    if user_directory is None:
        return None
    return os.path.join(user_directory(), "default", "comfy.settings.json")


def comfy_setting(name: str):
    """The value the settings dialog saved for ``name``, or None (not set, or outside ComfyUI)."""
    path = settings_file()
    if path is None:
        return None
    try:
        with open(path) as f:
            return json.load(f).get(name)
    except (OSError, ValueError, AttributeError):
        return None


def runtime():
    """The process-wide runtime, started with the settings' compilation cache folder if it is not running yet."""
    from ..engine.runtime import get_runtime, runtime_started

    folder = str(comfy_setting(CACHE_DIR_SETTING) or "").strip()
    if not runtime_started():
        return get_runtime(cache_dir=folder or None)
    current = get_runtime()
    if folder and Path(folder).expanduser() != current.cache_dir and folder not in _warned:
        _warned.add(folder)
        log.warning("the compilation cache folder %s (setting %s) takes effect at the next start of ComfyUI; this "
                    "process keeps %s", folder, CACHE_DIR_SETTING, current.cache_dir)
    return current
