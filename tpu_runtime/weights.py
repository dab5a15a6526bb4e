"""Loading safetensors weights into a torch module without building it twice.

A model is built on the ``meta`` device (no memory, no random init), then every tensor is read from the file
(memory-mapped), dequantised if needed, cast to the run dtype and assigned in place: host memory peaks at about
one copy of the model in the run dtype, and host work is one pass over the file. This serves diffusers folders
(``diffusion_pytorch_model*.safetensors``, sharded or not) and ComfyUI's single files alike.

Quantised files: ``float8_e4m3fn``/``float8_e5m2`` tensors are upcast; ComfyUI's "scaled" fp8 files (a
``scaled_fp8`` marker tensor and a 0-dim ``<layer>.scale_weight`` per Linear) hold ``weight * scale_weight``,
which is what is loaded. Scale tensors and markers are consumed, not reported as unknown keys.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable, Iterable

import torch

from .errors import ModelFolderError

log = logging.getLogger(__name__)

FP8_MARKERS = ("scaled_fp8",)
_SCALE_SUFFIXES = (".scale_weight", ".scale_input")


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a diffusers component folder: the index's shards, or the single file."""
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        shards = sorted(set(json.loads(index[0].read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelFolderError(f"{folder} is incomplete: the shards {missing} listed in {index[0].name} are "
                                   "missing. Re-download them")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"{folder} has no .safetensors weights: re-download the component (only "
                               "safetensors files are loaded)")
    return files


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype string) of every tensor in a safetensors file, without reading any tensor."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size <= 0 or size > 100 * 2**20:
                raise ValueError("not a safetensors header")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as exc:
        raise ModelFolderError(f"{path} is not a readable safetensors file ({exc}): check the path, or "
                               "re-download it") from exc
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}


def strip_prefix(names: Iterable[str], prefixes: Iterable[str]) -> dict[str, str]:
    """Map each name to itself without the first of ``prefixes`` it starts with."""
    out = {}
    for name in names:
        for p in prefixes:
            if name.startswith(p):
                name_out = name[len(p):]
                break
        else:
            name_out = name
        out[name] = name_out
    return out


class TensorSource:
    """The tensors of one or more safetensors files, read one at a time, dequantised, in the requested dtype."""

    def __init__(self, files: Iterable[Path]):
        from safetensors import safe_open

        self.files = [Path(f) for f in files]
        self._handles = {}
        self.where: dict[str, Path] = {}
        for f in self.files:
            handle = safe_open(str(f), framework="pt")
            self._handles[f] = handle
            for key in handle.keys():
                self.where[key] = f
        self.scaled_fp8 = any(m in self.where for m in FP8_MARKERS)

    def keys(self) -> list[str]:
        """Tensor names, without fp8 markers and scale tensors."""
        return [k for k in self.where if k not in FP8_MARKERS and not k.endswith(_SCALE_SUFFIXES)]

    def raw(self, key: str) -> torch.Tensor:
        return self._handles[self.where[key]].get_tensor(key)

    def get(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``key`` in ``dtype``; fp8 upcast, and multiplied by its ``scale_weight`` in scaled-fp8 files."""
        tensor = self.raw(key)
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        scale_key = f"{base}.scale_weight" if base is not None else None
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or (scale_key and scale_key in self.where):
            tensor = tensor.float()
            if scale_key and scale_key in self.where:
                tensor = tensor * self.raw(scale_key).float()
        if not tensor.is_floating_point():
            return tensor
        return tensor.to(dtype)


def _keep_fp32(name: str, patterns: Iterable[str]) -> bool:
    return any(re.search(rf"(^|\.){re.escape(p)}(\.|$)", name) for p in patterns)


def load_into_meta_module(build: Callable[[], torch.nn.Module], source: TensorSource, names: dict[str, str],
                          dtype: torch.dtype, what: str, keep_fp32: Iterable[str] = (),
                          ties: dict[str, str] | None = None, ignore: Iterable[str] = ()) -> torch.nn.Module:
    """Build a module on ``meta`` and assign it the tensors of ``source``.

    ``names`` maps file keys to module parameter names (keys absent from it are unknown). ``keep_fp32``: module
    names whose tensors stay float32 whatever ``dtype`` is (diffusers' ``_keep_in_fp32_modules``). ``ties``:
    parameters that share another's tensor when the file leaves them out (T5's embeddings). ``ignore``: regexes
    of file keys to skip (e.g. buffers some exporters include). Missing or unexpected tensors, and shape
    mismatches, raise ``ModelFolderError`` naming them.
    """
    with torch.device("meta"):
        module = build()
    expected = dict(module.state_dict(keep_vars=True))
    ignore = [re.compile(p) for p in ignore]
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for key, name in names.items():
        if name not in expected:
            if not any(p.search(name) for p in ignore):
                unexpected.append(key)
            continue
        want = torch.float32 if _keep_fp32(name, keep_fp32) else dtype
        tensor = source.get(key, want)
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelFolderError(f"{what}: tensor {key} has shape {tuple(tensor.shape)} but the architecture "
                                   f"read from the file expects {tuple(expected[name].shape)}: the file is damaged "
                                   "or of another model")
        state[name] = tensor
    for name, target in (ties or {}).items():
        if name not in state and target in state:
            state[name] = state[target]
    missing = [n for n in expected if n not in state]  # state_dict() holds persistent tensors only
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) (e.g. {', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unknown tensor(s) (e.g. {', '.join(unexpected[:4])})")
        raise ModelFolderError(f"{what} does not fit the architecture read from it: {'; '.join(parts)}. The file "
                               "is incomplete or holds another model")
    module.load_state_dict(state, strict=False, assign=True)
    return module.eval()


def cast_meta_module(build: Callable[[], torch.nn.Module], dtype: torch.dtype,
                     keep_fp32: Iterable[str] = ()) -> torch.nn.Module:
    """The module ``load_into_meta_module`` would give, without its tensors: built on ``meta``, every floating
    parameter and buffer in ``dtype`` except those under ``keep_fp32`` (planning needs only shapes and dtypes)."""
    with torch.device("meta"):
        module = build()
    for prefix, owner in module.named_modules():
        for table in (owner._parameters, owner._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_floating_point():
                    continue
                want = torch.float32 if _keep_fp32(f"{prefix}.{name}".lstrip("."), keep_fp32) else dtype
                if tensor.dtype != want:
                    cast = tensor.detach().to(want)
                    table[name] = torch.nn.Parameter(cast, requires_grad=False) \
                        if isinstance(tensor, torch.nn.Parameter) else cast
    return module.eval()


def meta_tensors(module: torch.nn.Module) -> list[str]:
    """Names of parameters and buffers still on ``meta`` (left unset by a load)."""
    named = list(module.named_parameters()) + list(module.named_buffers())
    return [n for n, t in named if t.is_meta]
