"""Loading safetensors weights into a torch module without building it twice: the one loading path of every
family.

A model is built with its parameters on the ``meta`` device (no memory, no random init) and its buffers real
(RoPE tables, position ids: what the library computes at construction and no file stores), under the run dtype
as the library's own ``from_pretrained`` builds it. Then every tensor is read from the file (memory-mapped),
dequantised if needed, cast to the run dtype (or kept float32 where the model class says so, by the same rule
as its library) and assigned in place: host memory peaks at about one copy of the model in the run dtype, and
host work is one pass over the file. This serves diffusers folders (``*.safetensors``, sharded or not) and
ComfyUI's single files alike; ``plan`` builds the same module and never reads a tensor.

Quantised files: ``float8_e4m3fn``/``float8_e5m2`` tensors are upcast. ComfyUI writes scaled fp8 two ways, and
both hold ``weight * scale``, which is what is loaded: the older "scaled fp8" files (a ``scaled_fp8`` marker
tensor, a 0-dim ``<layer>.scale_weight`` per Linear, maybe ``.scale_input``) and its per-layer format (the
``<layer>.weight_scale`` beside each quantised weight, maybe ``.input_scale``, the layer's format in a
``<layer>.comfy_quant`` JSON tensor or in the ``_quantization_metadata`` entry of the file's metadata: LTX-2's
fp8 checkpoints). NVFP4 layers of the same per-layer format (ComfyUI's ``_fp4`` and ``_fp4_mixed`` files: two
4-bit values a byte, a float8 scale per 16 values in ``.weight_scale``, one float32 in ``.weight_scale_2``) are
dequantised too; ``read_header`` reports their unpacked shape. Scales, formats and markers are consumed, not
reported as unknown keys; other formats (mxfp8, int8) are refused when the file is opened.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..errors import ModelFolderError

log = logging.getLogger(__name__)

FP8_MARKERS = ("scaled_fp8",)
# What quantised files keep beside a layer's ``.weight``: the older scaled-fp8 format's scales, and the per-layer
# format's scales and format record.
QUANT_SUFFIXES = (".scale_weight", ".scale_input", ".weight_scale", ".weight_scale_2", ".input_scale", ".comfy_quant")
WEIGHT_SCALES = (".scale_weight", ".weight_scale")
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")


def quant_aux(keys: Iterable[str]) -> set[str]:
    """The keys of ``keys`` that are quantisation bookkeeping (markers, a layer's scales and format), not
    weights: a scale counts only beside its layer's ``.weight``, so a parameter that happens to be named
    ``weight_scale`` stays a weight."""
    keys = set(keys)
    aux = {k for k in keys if k in FP8_MARKERS}
    for k in keys:
        for suffix in QUANT_SUFFIXES:
            if k.endswith(suffix) and f"{k[: -len(suffix)]}.weight" in keys:
                aux.add(k)
    return aux


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


# Bytes per element of each dtype a safetensors header may name.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2,
               "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
               "C64": 8}


class DamagedFile(ModelFolderError):
    """A weight file that is not whole: ``reason`` says what is wrong with it."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def read_header(path: Path, what: str = "") -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype string) of every tensor in a safetensors file, without reading any tensor; and the
    checks that catch a damaged or half-downloaded file before anything runs: the header parses, every dtype is
    known, and every tensor's bytes lie inside the file (a download cut inside its data keeps a valid header, and
    safetensors only fails when the missing tensor is read, which for the VAE is after every sampling step)."""
    path = Path(path)
    name = f"{what} file {path}" if what else str(path)

    def damaged(reason: str) -> DamagedFile:
        return DamagedFile(f"{name} {reason}: re-download it", reason)

    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if file_size < 8 or size <= 0 or size > 100 * 2**20 or 8 + size > file_size:
                raise ValueError("not a safetensors file, or cut inside its header")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("its header is not a table of tensors")
    except OSError as exc:
        raise ModelFolderError(f"{name} cannot be read ({exc}): check the path") from exc
    except ValueError as exc:
        raise damaged(f"is not a readable safetensors file ({exc})") from exc
    data = file_size - 8 - size
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise damaged(f"has a damaged header (tensor {key})") from None
        if dtype not in DTYPE_BYTES:
            raise ModelFolderError(f"{name}: tensor {key} has dtype {dtype}, which this pack cannot read: use a "
                                   "file in a float format (fp32, fp16, bf16, fp8)")
        if not 0 <= begin <= end or end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise damaged(f"has a damaged header (tensor {key}'s size does not match its shape)")
        if end > data:
            raise damaged(f"is cut short: it holds {data + 8 + size:,} bytes but its tensor {key} ends at byte "
                          f"{end + 8 + size:,} (an interrupted download?)")
        tensors[key] = (shape, dtype)
    _check_quantisation(name, tensors, header.get("__metadata__") or {})
    for key in [k for k in tensors if k.endswith(".weight") and f"{k}_scale_2" in tensors]:
        (rows, half), _ = tensors[key]  # NVFP4: two 4-bit values a byte; the layer's shape is twice as wide
        tensors[key] = ((rows, 2 * half), "NVFP4")
    return tensors


def _check_quantisation(name: str, tensors: dict, metadata: dict) -> None:
    """Refuse a quantisation this pack does not dequantise (a format other than fp8 and NVFP4 in the file's
    ``_quantization_metadata`` or ``.comfy_quant`` records, e.g. mxfp8 or int8; packed weights of another kind) when
    the file is opened, not when its weights are read."""
    formats = set()
    if "_quantization_metadata" in metadata:
        try:
            layers = json.loads(metadata["_quantization_metadata"]).get("layers", {})
            formats = {str(conf.get("format")) for conf in layers.values()}
        except (ValueError, AttributeError):
            raise DamagedFile(f"{name} has a damaged _quantization_metadata entry: re-download it",
                              "damaged quantisation metadata") from None
    packed = sorted(k for k in tensors if k.endswith(".weight_scale") and f"{k}_2" not in tensors
                    and tensors.get(k[: -len("_scale")], ((), ""))[1] in ("U8", "I8"))
    unknown = sorted(formats - set(FP8_FORMATS) - {"nvfp4"})
    if packed or unknown:
        what = ", ".join(unknown) if unknown else f"packed integers ({packed[0][: -len('_scale')]})"
        raise ModelFolderError(f"{name} is quantised as {what}, which this pack does not dequantise: use the "
                               "bf16, fp16, fp8 or nvfp4 version of the file")


def check_files(files: Iterable[Path], what: str = "") -> None:
    """Every file readable and whole (``read_header``), before anything loads or runs."""
    for f in files:
        read_header(f, what)


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
        self._aux = quant_aux(self.where)

    def keys(self) -> list[str]:
        """Tensor names, without fp8 markers, scales and format records."""
        return [k for k in self.where if k not in self._aux]

    def raw(self, key: str) -> torch.Tensor:
        return self._handles[self.where[key]].get_tensor(key)

    def get(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``key`` in ``dtype``; fp8 upcast, and multiplied by its scale (``scale_weight`` or
        ``weight_scale``: one number, or one per output row) in scaled-fp8 files."""
        tensor = self.raw(key)
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        scale_key = next((base + s for s in WEIGHT_SCALES if base is not None and base + s in self.where), None)
        if base is not None and f"{base}.weight_scale_2" in self.where:
            return dequantise_nvfp4(tensor, self.raw(f"{base}.weight_scale"), self.raw(f"{base}.weight_scale_2"),
                                    dtype)
        scale = self.raw(scale_key).float() if scale_key else torch.tensor(1.0)
        if tensor.dtype in FP8_DTYPES and scale.numel() == 1 and dtype in _SAME_SIZE_INT:
            return dequantise_fp8(tensor, scale, dtype)
        if tensor.dtype in FP8_DTYPES or scale_key:
            tensor = tensor.float()
            if scale.numel() > 1:  # per output row
                scale = scale.reshape(-1, *([1] * (tensor.ndim - 1)))
            tensor = tensor * scale
        if not tensor.is_floating_point():
            return tensor
        return tensor.to(dtype)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SAME_SIZE_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_FP8_VALUES: dict = {}
_POOL: list = []


def dequantise_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(q.float() * scale).to(dtype)`` for an fp8 tensor ``q`` and one scale, element for element, through a table
    of the 256 products already in ``dtype`` indexed by ``q``'s bytes, over the host's cores: torch's own float8
    conversion costs several times more per weight, which for a 19B fp8 checkpoint is minutes of host time."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    if q.dtype not in _FP8_VALUES:  # every value of the 8-bit type, by bit pattern
        _FP8_VALUES[q.dtype] = torch.arange(256, dtype=torch.uint8).view(q.dtype).float()
    table = (_FP8_VALUES[q.dtype] * scale.float().reshape(())).to(dtype).view(_SAME_SIZE_INT[dtype]).numpy()
    codes = q.contiguous().view(torch.uint8).numpy().reshape(-1)
    out = np.empty(codes.shape, dtype=table.dtype)
    chunk = 1 << 20
    if codes.size <= 2 * chunk:
        np.take(table, codes, out=out)
    else:  # numpy releases the GIL in take: the chunks run on every core
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(max(1, min(32, os.cpu_count() or 1)), thread_name_prefix="fp8"))
        spans = [slice(i, min(i + chunk, codes.size)) for i in range(0, codes.size, chunk)]
        list(_POOL[0].map(lambda sl: np.take(table, codes[sl], out=out[sl]), spans))
    return torch.from_numpy(out).view(dtype).reshape(q.shape)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantise_nvfp4(packed: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """ComfyUI's NVFP4 weight (its ``..._fp4`` / ``..._fp4_mixed`` files) as a ``dtype`` matrix: ``packed`` holds
    two E2M1 values a byte (the even column in the high nibble), ``block_scales`` one float8_e4m3fn scale per 16
    values of a row, stored in cuBLAS' tiled layout (128 rows x 4 scales a tile, tiles row-major, each written as
    32 x 16: row ``r`` of a tile at ``(r % 32, (r // 32) * 4 + column)``), ``tensor_scale`` one float32. Each
    weight is value x (tensor scale x block scale) in float32, as ComfyUI's own dequantisation computes it in
    float32, then cast to ``dtype``."""
    import numpy as np

    rows, cols = packed.shape[0], 2 * packed.shape[1]
    tiles_r, tiles_c = -(-rows // 128), -(-(cols // 16) // 4)
    tiled = block_scales.float().numpy().reshape(tiles_r, tiles_c, 32, 4, 4)  # [tile r, tile c, r % 32, r // 32, c]
    scales = tiled.transpose(0, 3, 2, 1, 4).reshape(tiles_r * 128, tiles_c * 4)[:rows, : cols // 16]
    total = np.float32(tensor_scale.float().item()) * scales
    codes = packed.contiguous().numpy()
    values = np.empty((rows, cols), np.float32)
    table = np.array(E2M1_VALUES, np.float32)
    values[:, 0::2] = table[codes >> 4]
    values[:, 1::2] = table[codes & 15]
    out = values.reshape(rows, cols // 16, 16) * total[:, :, None]
    return torch.from_numpy(out.reshape(rows, cols)).to(dtype)


def _keep_fp32(name: str, patterns: Iterable[str]) -> bool:
    return any(re.search(rf"(^|\.){re.escape(p)}(\.|$)", name) for p in patterns)


def keep_fp32_modules(cls: type, dtype: torch.dtype) -> tuple[str, ...]:
    """The modules of model class ``cls`` whose tensors its library's ``from_pretrained`` keeps in float32 when
    loading in ``dtype``: diffusers keeps ``_keep_in_fp32_modules`` in float32 for any dtype; transformers keeps
    ``_keep_in_fp32_modules`` for float16 only and ``_keep_in_fp32_modules_strict`` for float16 and bfloat16."""
    if dtype == torch.float32:
        return ()
    if cls.__module__.startswith("diffusers."):
        return tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    names = list(getattr(cls, "_keep_in_fp32_modules", None) or ()) if dtype == torch.float16 else []
    if dtype in (torch.float16, torch.bfloat16):
        names += list(getattr(cls, "_keep_in_fp32_modules_strict", None) or ())
    return tuple(names)


def tied_weights(module: torch.nn.Module) -> dict[str, str]:
    """Parameter -> the parameter it shares its tensor with (transformers' ``_tied_weights_keys``, e.g. T5's
    ``encoder.embed_tokens.weight`` -> ``shared.weight``): files store the second only."""
    ties = getattr(module, "_tied_weights_keys", None)
    return dict(ties) if isinstance(ties, dict) else {}


@contextlib.contextmanager
def _parameters_on_meta(dtype: torch.dtype):
    """While a module is built: each parameter is created on ``meta`` as it is registered (no memory, its random
    init a no-op), buffers are computed for real, and floating tensors default to ``dtype``, as the libraries'
    ``from_pretrained`` builds a model under the requested dtype."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    previous = torch.get_default_dtype()
    torch.nn.Module.register_parameter = register
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original
        torch.set_default_dtype(previous)


def build_empty(build: Callable[[], torch.nn.Module], dtype: torch.dtype,
                keep_fp32: Iterable[str] = ()) -> torch.nn.Module:
    """The module ``build()`` makes, its parameters on ``meta`` in the dtype loading gives them (``dtype``, or
    float32 under ``keep_fp32``), its buffers real. Loading assigns the parameters; planning needs no more."""
    with _parameters_on_meta(dtype):
        module = build()
    keep_fp32 = tuple(keep_fp32)
    for prefix, owner in module.named_modules():
        for name, param in list(owner._parameters.items()):
            if param is None or not param.is_floating_point():
                continue
            want = torch.float32 if _keep_fp32(f"{prefix}.{name}".lstrip("."), keep_fp32) else dtype
            if param.dtype != want:
                owner._parameters[name] = torch.nn.Parameter(param.detach().to(want), requires_grad=False)
    return module.eval()


def load_into_meta_module(build: Callable[[], torch.nn.Module], source: TensorSource, names: dict[str, str],
                          dtype: torch.dtype, what: str, keep_fp32: Iterable[str] = (),
                          ignore: Iterable[str] = ()) -> torch.nn.Module:
    """Build a module with ``build_empty`` and assign it the tensors of ``source``.

    ``names`` maps file keys to module names (keys absent from it are unknown). ``keep_fp32``: module names whose
    tensors stay float32 whatever ``dtype`` is. Parameters tied to another (``tied_weights``) share its tensor
    when the file leaves them out. ``ignore``: regexes of file keys to skip (e.g. buffers some exporters
    include). Missing or unexpected tensors, and shape mismatches, raise ``ModelFolderError`` naming them.
    """
    keep_fp32 = tuple(keep_fp32)
    module = build_empty(build, dtype, keep_fp32)
    expected = dict(module.state_dict(keep_vars=True))
    ignore = [re.compile(p) for p in ignore]
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for key, name in names.items():
        if name not in expected:
            if not any(p.search(name) for p in ignore):
                unexpected.append(key)
            continue
        target = expected[name]
        want = torch.float32 if _keep_fp32(name, keep_fp32) else dtype
        tensor = source.get(key, want)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelFolderError(f"{what}: tensor {key} has shape {tuple(tensor.shape)} but the architecture "
                                   f"read from the file expects {tuple(target.shape)}: the file is damaged "
                                   "or of another model")
        state[name] = tensor
    ties = tied_weights(module)
    for name, target in ties.items():
        if name not in state and target in state:
            state[name] = state[target]
    # state_dict() holds persistent tensors only; buffers are real already and need no file.
    missing = [n for n, t in expected.items() if n not in state and t.is_meta]
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) (e.g. {', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unknown tensor(s) (e.g. {', '.join(unexpected[:4])})")
        raise ModelFolderError(f"{what} does not fit the architecture read from it: {'; '.join(parts)}. The file "
                               "is incomplete or holds another model")
    module.load_state_dict(state, strict=False, assign=True)
    for name, target in ties.items():  # one tensor, one device copy: the tie survives assign=True
        if name in expected and target in expected:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, module.get_parameter(target))
    return module.eval()


def meta_tensors(module: torch.nn.Module) -> list[str]:
    """Names of parameters and buffers still on ``meta`` (left unset by a load)."""
    named = list(module.named_parameters()) + list(module.named_buffers())
    return [n for n, t in named if t.is_meta]
