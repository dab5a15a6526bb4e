"""Where the loader looks for CogVideoX folders: ComfyUI's ``models/diffusers`` and ``models/CogVideo`` (where the
most popular GPU wrapper downloads them), plus every folder ``extra_model_paths.yaml`` adds under those names.
Outside ComfyUI, ``$TPU_VIDEO_MODEL_DIRS`` (os.pathsep-separated) plays that role."""

from __future__ import annotations

import json
import os
from pathlib import Path

FOLDER_NAMES = ("diffusers", "CogVideo")
MODEL_DIRS_ENV = "TPU_VIDEO_MODEL_DIRS"


def search_roots() -> list[Path]:
    """The folders searched, in order, whether or not they exist."""
    try:
        import folder_paths
    except ImportError:
        return [Path(p).expanduser() for p in os.environ.get(MODEL_DIRS_ENV, "").split(os.pathsep) if p]
    if "CogVideo" not in folder_paths.folder_names_and_paths:
        folder_paths.add_model_folder_path("CogVideo", os.path.join(folder_paths.models_dir, "CogVideo"))
    roots: list[Path] = []
    for name in FOLDER_NAMES:
        try:
            roots += [Path(p) for p in folder_paths.get_folder_paths(name)]
        except KeyError:
            continue
    return list(dict.fromkeys(roots))


def _is_cogvideox_t2v(folder: Path) -> bool:
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):
        return False
    return index.get("_class_name") == "CogVideoXPipeline"


def find_models() -> dict[str, Path]:
    """Display name -> folder of every CogVideoX text-to-video folder directly inside a search root."""
    found: dict[str, Path] = {}
    for root in search_roots():
        if not root.is_dir():
            continue
        for child in sorted(p for p in root.iterdir() if p.is_dir()):
            if _is_cogvideox_t2v(child):
                name = child.name if child.name not in found else f"{root.name}/{child.name}"
                found[name] = child
    return found
