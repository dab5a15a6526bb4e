"""Where the loaders look for models.

Diffusers folders (a ``model_index.json`` naming one of the family's pipelines) in the ComfyUI folder types the
family declares (``models/diffusers`` for all; also ``models/CogVideo`` for CogVideoX, where the most popular GPU
wrapper downloads them), plus every folder ``extra_model_paths.yaml`` adds under those names. Single files (Wan): ComfyUI's own ``diffusion_models`` (and the
legacy ``unet``), ``text_encoders`` (and ``clip``) and ``vae`` folders, through ``folder_paths``.

Outside ComfyUI, ``$TPU_VIDEO_MODEL_DIRS`` (os.pathsep-separated) plays that role: diffusers folders directly
inside each entry, single files in its ``diffusion_models/``, ``text_encoders/`` and ``vae/`` subfolders.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MODEL_DIRS_ENV = "TPU_VIDEO_MODEL_DIRS"


def _env_roots() -> list[Path]:
    return [Path(p).expanduser() for p in os.environ.get(MODEL_DIRS_ENV, "").split(os.pathsep) if p]


def search_roots(spec) -> list[Path]:
    """The folders searched for family ``spec``'s diffusers folders, in order, whether or not they exist."""
    try:
        import folder_paths
    except ImportError:
        return _env_roots()
    for name in spec.folder_names:  # a folder type ComfyUI does not know (CogVideo): models/<name>
        if name not in folder_paths.folder_names_and_paths:
            folder_paths.add_model_folder_path(name, os.path.join(folder_paths.models_dir, name))
    roots: list[Path] = []
    for name in spec.folder_names:
        try:
            roots += [Path(p) for p in folder_paths.get_folder_paths(name)]
        except KeyError:
            continue
    return list(dict.fromkeys(roots))


def _pipeline(folder: Path) -> str:
    try:
        return json.loads((folder / "model_index.json").read_text()).get("_class_name", "")
    except (OSError, ValueError):
        return ""


def find_models(spec) -> dict[str, Path]:
    """Display name -> folder of every folder of family ``spec`` (any of its pipelines) directly inside a search
    root."""
    found: dict[str, Path] = {}
    for root in search_roots(spec):
        if not root.is_dir():
            continue
        for child in sorted(p for p in root.iterdir() if p.is_dir()):
            if _pipeline(child) in spec.pipelines:
                name = child.name if child.name not in found else f"{root.name}/{child.name}"
                found[name] = child
    return found


def folder_path(spec, name: str) -> Path:
    """The folder a loader's ``model`` choice names, or a ModelFolderError listing where we looked."""
    from tpu_runtime.errors import ModelFolderError

    found = find_models(spec)
    if name not in found:
        looked = ", ".join(str(r) for r in search_roots(spec)) or "(no model folders configured)"
        label = spec.display_name
        raise ModelFolderError(
            f"{label} model {name!r} not found. Looked in: {looked}. Put a diffusers {label} folder (with "
            "model_index.json) into one of them, or give its path in model_path"
        )
    return found[name]


def find_files(kind: str) -> dict[str, Path]:
    """Display name -> path of every .safetensors file of ComfyUI's folder type ``kind``."""
    try:
        import folder_paths
    except ImportError:
        found = {}
        for root in _env_roots():
            folder = root / kind
            if folder.is_dir():
                for p in sorted(folder.rglob("*.safetensors")):
                    found.setdefault(str(p.relative_to(folder)), p)
        return found
    found = {}
    try:
        names = folder_paths.get_filename_list(kind)
    except KeyError:  # a folder type this ComfyUI does not have
        names = []
    for name in names:
        if name.endswith(".safetensors"):
            path = folder_paths.get_full_path(kind, name)
            if path:
                found[name] = Path(path)
    return found


def file_path(kind: str, name: str) -> Path:
    """The file a loader's choice names, or a ModelFolderError saying where it should be."""
    from tpu_runtime.errors import ModelFolderError

    found = find_files(kind)
    if name in found:
        return found[name]
    path = Path(name).expanduser()
    if path.is_file():
        return path
    raise ModelFolderError(f"{name!r} is not in ComfyUI's models/{kind}/ (found: {', '.join(sorted(found)) or 'none'}"
                           f"): put the file there, or pick one of those")
