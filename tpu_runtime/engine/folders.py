"""Diffusers model folders, as every family reads them: where a folder is, its ``model_index.json``, and whether
every component it names is there, before anything loads.

A component's kind follows from the class ``model_index.json`` names for it: a scheduler (``*Scheduler``: its
``scheduler_config.json``), a tokenizer (``*Tokenizer*``: its vocabulary file), an image processor
(``*Processor``: its ``preprocessor_config.json``), otherwise a model (its ``config.json`` and safetensors
weights).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelFolderError

TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer.model")


def resolve_model_path(model: str | Path) -> Path:
    """A local folder as is; ``org/name`` hub ids are downloaded when the machine can reach the hub."""
    path = Path(model).expanduser()
    if path.exists() or not isinstance(model, str) or model.count("/") != 1 or model.startswith((".", "/", "~")):
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model))
    except Exception as exc:  # noqa: BLE001 - any failure means: not reachable from here
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = (lines[0][:160] if lines else type(exc).__name__).rstrip(".")
        raise ModelFolderError(
            f"model folder {path.absolute()} does not exist; read as a model-hub id, {model!r} could not be "
            f"downloaded either ({why}). Check the path, or download the model on a machine with network access "
            "and pass its folder"
        ) from None


def read_model_index(folder: Path, example: str = "") -> dict:
    """``folder``'s model_index.json, or a message saying what the folder is not."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise ModelFolderError(f"model folder {folder} does not exist: pass the folder that holds model_index.json"
                               + (f" (e.g. a download of {example})" if example else ""))
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise ModelFolderError(f"{folder} is not a diffusers model folder: model_index.json is missing. Download the "
                               "whole diffusers repository (model_index.json and every component folder)")
    try:
        return json.loads(index_file.read_text())
    except ValueError as exc:
        raise ModelFolderError(f"{index_file} is not valid JSON ({exc}): re-download it") from exc


def read_config(folder: Path, name: str = "config.json") -> dict:
    path = Path(folder) / name
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise ModelFolderError(f"{path} cannot be read ({exc}): re-download it") from exc
    except ValueError as exc:
        raise ModelFolderError(f"{path} is not valid JSON ({exc}): re-download it") from exc


def present(entry) -> bool:
    """Whether a model_index.json entry names a component (``[library, class]``; ``[null, null]`` is none)."""
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None


def component_kind(entry) -> str:
    cls = str(entry[1]) if present(entry) else ""
    if cls.endswith("Scheduler"):
        return "scheduler"
    if "Tokenizer" in cls:
        return "tokenizer"
    if cls.endswith("Processor"):
        return "processor"
    return "model"


def components(index: dict) -> list[str]:
    """The components a model_index.json names, in name order."""
    return sorted(k for k, v in index.items() if not k.startswith("_") and present(v))


def inspect_folder(folder: Path, index: dict, *, required: tuple[str, ...], weights: bool = True) -> None:
    """Check that every component ``index`` names (and every ``required`` one) is complete in ``folder``: one
    message lists everything missing; then every weight file is checked whole (``weights.read_header``: a
    download cut short is refused now, not when its tensors are read). ``weights=False``: configs only
    (planning needs no weights, no tokenizer)."""
    folder = Path(folder)
    missing = [f"{name} (not in model_index.json)" for name in required if not present(index.get(name))]
    weight_files = []
    for name in components(index):
        kind = component_kind(index[name])
        sub = folder / name
        if kind == "tokenizer" and not weights:
            continue
        if not sub.is_dir():
            missing.append(f"{name}/ (folder missing)")
        elif kind == "model":
            if not (sub / "config.json").is_file():
                missing.append(f"{name}/config.json")
            if weights and not any(p.name.endswith(".safetensors") for p in sub.iterdir()):
                missing.append(f"{name}/*.safetensors (no weights)")
            elif weights:
                weight_files.append((name, sub))
        elif kind == "scheduler" and not (sub / "scheduler_config.json").is_file():
            missing.append(f"{name}/scheduler_config.json")
        elif kind == "tokenizer" and not any((sub / f).is_file() for f in TOKENIZER_FILES):
            missing.append(f"{name}/{' or '.join(TOKENIZER_FILES)}")
        elif kind == "processor" and not (sub / "preprocessor_config.json").is_file():
            missing.append(f"{name}/preprocessor_config.json")
    if missing:
        raise ModelFolderError(f"model folder {folder} is incomplete, missing: {', '.join(missing)}. Re-download "
                               "those files from the model's diffusers repository")
    from .weights import check_files, safetensors_files

    for name, sub in weight_files:  # every shard whole, its header readable: seconds, no tensor read
        check_files(safetensors_files(sub), f"{name}")


def inspect_family_folder(folder: Path, spec, *, required: tuple[str, ...], index: dict | None = None,
                          weights: bool = True) -> dict:
    """``folder``'s model_index.json, checked to name a pipeline of family ``spec`` (its declaration) and to have
    every component complete (``inspect_folder``)."""
    folder = Path(folder).expanduser()
    index = index if index is not None else read_model_index(folder, example=spec.example_repo)
    cls = index.get("_class_name", "")
    if not cls.startswith(spec.pipeline_prefix):
        raise ModelFolderError(f"{folder} holds a {cls or 'unknown'} model, not {spec.display_name}: pick a "
                               f"{spec.display_name} folder")
    if cls not in spec.pipelines:
        raise ModelFolderError(f"{folder} holds a {cls} model; {spec.unsupported}")
    inspect_folder(folder, index, required=required, weights=weights)
    return index


class FolderOrFiles:
    """A model read from a diffusers folder (``path``) or from ComfyUI's single files (``files``: a dataclass,
    ``FILES``, of one path per file role of the family's declaration; its first field names the model). A part of
    the families that load both: what they read, and how messages and ``generation_config.json`` name it."""

    FILES: type | None = None

    def _folder_or_files(self, path, files) -> None:
        """Set ``path`` and ``files`` (one of the two given; a dict of files becomes ``FILES``), every file given
        checked to exist."""
        import dataclasses

        from ..errors import InputError

        roles = ", ".join(f.name for f in dataclasses.fields(self.FILES))
        if (path is None) == (files is None):
            raise InputError(f"give either a {self.FAMILY_NAME} diffusers folder or its single files ({roles}), "
                             "not both")
        if isinstance(files, dict):
            unknown = sorted(set(files) - {f.name for f in dataclasses.fields(self.FILES)})
            if unknown:
                raise InputError(f"{self.FAMILY_NAME} single files take {roles}, not {', '.join(unknown)}")
            files = self.FILES(**{k: Path(v).expanduser() for k, v in files.items() if v})
        self.files = files
        self.path = Path(path).expanduser() if path is not None else None
        for role in self.SPEC.file_roles if files is not None else ():
            given = getattr(files, role.name, None)
            if given is not None and not Path(given).exists():
                raise ModelFolderError(f"{role.name.replace('_', ' ')} file {given} does not exist: check the path "
                                       f"(ComfyUI keeps it in models/{role.folder})")

    @property
    def label(self) -> str:
        """The model's name in messages: its folder's, or its first file's."""
        import dataclasses

        if self.path is not None:
            return self.path.name
        return Path(getattr(self.files, dataclasses.fields(self.files)[0].name)).stem

    def file_paths(self) -> list[Path]:
        """The single files given (and folders given with them)."""
        return [Path(p) for p in vars(self.files).values() if p]

    def source_paths(self) -> list[Path]:
        return [self.path] if self.path is not None else self.file_paths()

    def describe_source(self) -> "str | dict":
        """What the model was read from, for generation_config.json."""
        return str(self.path) if self.path is not None else {k: str(v) for k, v in vars(self.files).items() if v}

