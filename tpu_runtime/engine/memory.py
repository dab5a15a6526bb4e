"""Out of device memory, said so that a user can act on it: which part of the model, what it needed against what the
chips have, the mesh, and the fix (a larger slice, ``fsdp``, a smaller size, ``plan``).

XLA reports it as RESOURCE_EXHAUSTED, in words that depend on where it happened; the numbers are read from them:

- placing an array: ``Error allocating device buffer: Attempting to allocate 1.00G. That was not possible. There are
  512.00M free.``
- compiling for the TPU: ``Ran out of memory in memory space hbm. Used 20.53G of 15.48G hbm. Exceeded hbm capacity by
  5.05G.`` or ``the total memory required for HLO temporaries (17.12G) exceeds available HBM (15.75G).``
- running (and on GPUs): ``Out of memory while trying to allocate 25.81GiB``, ``... allocate 1073741824 bytes``,
  ``Failed to allocate request for 32.00MiB (33554432B) on device ordinal 0``.

What a chip has comes from the device itself (``memory_stats()``'s ``bytes_limit`` and ``bytes_in_use``) where the
backend reports it (TPU and GPU; the CPU does not).
"""

from __future__ import annotations

import re

from ..errors import DeviceMemoryError

GIB = 2 ** 30
_UNITS = {"": 1, "b": 1, "bytes": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}
_SIZE = r"([\d.]+)\s*([KMGT]i?B?\b|B\b|bytes\b)?"
# (pattern, what the second number is), most specific first
_REPORTS = (
    (re.compile(rf"Used {_SIZE} of {_SIZE} \w+", re.I), "a chip has"),
    (re.compile(rf"required for HLO temporaries \({_SIZE}\) exceeds available \w+ \({_SIZE}\)", re.I), "a chip has"),
    (re.compile(rf"(?:allocate|reserve) {_SIZE}[^.]*\.[^.]*?(?:possible\.)?\s*There (?:are|is) {_SIZE} free", re.I),
     "free"),
    (re.compile(rf"(?:trying|attempting|tried) to (?:allocate|reserve) {_SIZE}", re.I), None),
    (re.compile(rf"allocate request for {_SIZE}", re.I), None),
)

PLAN_FAMILY = "python -m tpu_runtime plan --model MODEL --topology SLICE --height H --width W --frames F"
PLAN_NATIVE = "python -m tpu_runtime plan --comfy-model MODEL --comfy COMFYUI_DIR --topology SLICE"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the devices running out of memory (XLA's RESOURCE_EXHAUSTED, or a backend's OOM text) not
    yet said in words (a ``DeviceMemoryError`` already is)."""
    if isinstance(error, DeviceMemoryError):
        return False
    text = f"{type(error).__name__}: {error}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _bytes(number: str, unit: str | None) -> int:
    unit = (unit or "").lower()
    return int(float(number) * _UNITS.get(unit if unit == "bytes" else unit[:1], 1))


def reported_bytes(text: str) -> tuple[int | None, int | None, str | None]:
    """(bytes needed, bytes there, what the second number is: "a chip has" or "free") as XLA's message says them;
    None where it does not."""
    for pattern, there in _REPORTS:
        found = pattern.search(text)
        if found:
            numbers = found.groups()
            needed = _bytes(numbers[0], numbers[1])
            if there is None:
                return needed, None, None
            return needed, _bytes(numbers[2], numbers[3]), there
    return None, None, None


def chip_memory(devices) -> tuple[int | None, int | None]:
    """(bytes a chip has, bytes in use on the fullest chip) among ``devices``, as the devices report them; (None, None)
    on a backend without memory statistics (the CPU)."""
    limits, used = [], []
    for device in devices:
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001 - not every backend (or abstract device) has them
            stats = {}
        if "bytes_limit" in stats:
            limits.append(int(stats["bytes_limit"]))
            used.append(int(stats.get("bytes_in_use", 0)))
    if not limits:
        return None, None
    return min(limits), max(used)


def gib(count: int) -> str:
    """Bytes in GiB (MiB below one GiB), for messages."""
    return f"{count / GIB:.2f} GiB" if count >= GIB / 4 else f"{count / 2 ** 20:.0f} MiB"


def describe_mesh(mesh) -> str:
    """``dp=2,sp=1,tp=4 (8 devices, TPU v6e lite)``."""
    sizes = ",".join(f"{axis}={size}" for axis, size in dict(mesh.shape).items())
    devices = list(mesh.devices.flat)
    return f"{sizes} ({len(devices)} device{'s' if len(devices) != 1 else ''}, {devices[0].device_kind})"


def out_of_memory(part: str, doing: str, error: BaseException, mesh, needs: str = "", fix: str = "",
                  plan: str = PLAN_FAMILY) -> DeviceMemoryError:
    """The error for ``part`` (a model's component or program) running out of device memory while ``doing`` (``for
    inputs …``, ``while placing its weights``) on ``mesh``: what it needed against what a chip has (XLA's numbers,
    the devices' own limit, and ``needs``, what the caller knows it asked for), the mesh, ``fix`` and the ``plan``
    command that finds what fits before a run."""
    text = str(error).strip()
    needed, there, what = reported_bytes(text)
    limit, in_use = chip_memory(list(mesh.devices.flat))
    numbers = []
    if needs:
        numbers.append(needs)
    if needed is not None:
        if there is None:
            numbers.append(f"XLA asked for {gib(needed)}")
        elif what == "free":
            numbers.append(f"XLA asked for {gib(needed)} where {gib(there)} were free")
        else:
            numbers.append(f"XLA needed {gib(needed)} where a chip has {gib(there)}")
    if limit is not None:
        numbers.append(f"a chip has {gib(limit)}" + (f", {gib(in_use)} of it in use" if in_use else ""))
    first = text.splitlines()[0][:300] if text else type(error).__name__
    fix = fix or ("Use a larger slice (more chips share the weights and the activations), `fsdp` (splits the "
                  "transformer's and text encoder's weights over dp as well), or a smaller height, width or frame "
                  "count.")
    return DeviceMemoryError(
        f"{part} ran out of device memory {doing} on mesh {describe_mesh(mesh)}"
        + (f": {'; '.join(numbers)}" if numbers else "") + f". {fix} `{plan}` compiles every stage for a slice and "
        f"says what fits, before you rent or run it. (XLA: {first})")
