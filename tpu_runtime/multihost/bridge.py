"""The native bridge on a slice of several hosts: ComfyUI runs on the first host only, the workers never import it.

ComfyUI's sampler loop, its model and its host weights live in the first process. What every process must do
alike is what touches the devices, so a bridged module on a slice replays exactly that, as calls of the slice
(op ``bridge``, the worker command is the same ``python -m tpu_runtime worker``):

- ``place``: the weights, sent from the first process through the devices' own collectives (a broadcast of byte
  chunks: one small program per chunk size), each process then placing its own shards;
- ``program``: a compiled program, as a serialized ``jax.export`` of what the first process traced (the workers
  need neither ComfyUI nor torch code to run it; every process compiles the same StableHLO);
- ``run``: one model call: its input tensors broadcast the same way, the program run everywhere, its result
  gathered (the first process returns it, the workers drop it). Arrays the program leaves for the next call (a
  causal VAE's caches) stay on the devices: every process keeps its shards of them under keys the first process
  names (``<call>:<index>``), and the next call names the keys it takes instead of sending them;
- ``release``: the device weights dropped.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CHUNK_MIN = 1 << 20  # bytes: chunks are powers of two from here up to CHUNK_MAX (few programs, little padding)
CHUNK_MAX = 1 << 28
_ids = itertools.count(1)


def broadcast_bytes(data: bytes | None, size: int) -> bytes:
    """``size`` bytes from the first process (``data``; None elsewhere) to every process, through the devices."""
    from jax.experimental import multihost_utils

    out = bytearray()
    offset = 0
    while offset < size:
        part = min(size - offset, CHUNK_MAX)
        chunk = min(CHUNK_MAX, max(CHUNK_MIN, 1 << (part - 1).bit_length()))
        buffer = np.zeros(chunk, np.uint8)
        if data is not None:
            buffer[:part] = np.frombuffer(data, np.uint8, count=part, offset=offset)
        got = multihost_utils.broadcast_one_to_all(buffer)
        out += np.asarray(got, np.uint8)[:part].tobytes()
        offset += part
    return bytes(out)


def _meta(array: np.ndarray) -> list:
    return [list(array.shape), array.dtype.name]


def _dtype(name: str):
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def pack(arrays: list[np.ndarray]) -> bytes:
    return b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def unpack(data: bytes, metas: list) -> list[np.ndarray]:
    out, offset = [], 0
    for shape, dtype in metas:
        dt = _dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        out.append(np.frombuffer(data, dt, count=count, offset=offset).reshape(shape).copy())
        offset += count * dt.itemsize
    return out


def _size(metas: list) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) * _dtype(dtype).itemsize for shape, dtype in metas)


# --- the same steps on every process ---------------------------------------------------------------------------------
def _place(runtime, mesh, state: dict, names: list[str], metas: list, specs: list, values: list | None) -> None:
    """Broadcast the named tensors (the first process passes ``values``) and place each process's shards."""
    data = pack(values) if values is not None else None
    arrays = unpack(broadcast_bytes(data, _size(metas)), metas)
    for name, array, spec in zip(names, arrays, specs):
        state[name] = runtime.put(array, runtime.sharding(mesh, tuple(spec)))


def _run(runtime, mesh, state: dict, executable, metas: list, specs: list, values: list | None, order: list,
         kept: dict, serial: int):
    """Broadcast the host inputs, run the program on them and the device values ``order`` names (``kept``: key ->
    array), gather its result on every process (the first returns it). The arrays the program leaves replace
    ``kept``'s, under the keys ``<serial>:<index>``; returns (result, those arrays, their keys)."""
    data = pack(values) if values is not None else None
    arrays = unpack(broadcast_bytes(data, _size(metas)), metas)
    host = [runtime.put(a, runtime.sharding(mesh, tuple(s))) for a, s in zip(arrays, specs)]
    missing = [ref for kind, ref in order if kind == "device" and ref not in kept]
    if missing:
        raise RuntimeError(f"the devices hold no value named {missing[0]} (a cache of an earlier call)")
    inputs = [kept[ref] if kind == "device" else host[ref] for kind, ref in order]
    out, left = executable(state, inputs)
    keys = [f"{serial}:{i}" for i in range(len(left))]
    kept.clear()
    kept.update(zip(keys, left))
    return runtime.to_cpu(out), left, keys


def _mesh(runtime, sizes: list[int]):
    from ..engine.sharding import MeshSpec

    return runtime.make_mesh(MeshSpec(*sizes))


def compile_exported(blob: bytes):
    """The program a serialized ``jax.export`` holds, as a jitted function of (weights, inputs) (the saved programs'
    own reader, ``engine/program_store.py``)."""
    from ..engine.program_store import compile_stablehlo

    return compile_stablehlo(blob)


# --- the first process -----------------------------------------------------------------------------------------------
class DriverBridge:
    """A bridged module's device work replayed on the slice's workers (the first process's side)."""

    def __init__(self, slice_, runtime, label: str):
        self.slice, self.runtime, self.label = slice_, runtime, label
        self.uid = next(_ids)
        self.kept: dict = {}  # the arrays the last call left on the devices, by key (as every worker keeps them)
        self.calls = itertools.count(1)

    def _call(self, method: str, args: tuple, run):
        return self.slice.call("bridge", None, method, args, {}, lambda a, k: run(), cls_name=f"bridge {self.label}")

    def place(self, mesh, state: dict, named: list[tuple[str, np.ndarray, tuple]]) -> None:
        names = [n for n, _, _ in named]
        metas = [_meta(v) for _, v, _ in named]
        specs = [list(s) for _, _, s in named]
        values = [v for _, v, _ in named]
        sizes = [mesh.shape[a] for a in ("dp", "sp", "tp")]
        self._call("place", (self.uid, sizes, names, metas, specs),
                   lambda: _place(self.runtime, mesh, state, names, metas, specs, values))

    def add_program(self, number: int, blob: bytes) -> None:
        self._call("program", (self.uid, number, blob), lambda: None)

    def run(self, mesh, state: dict, executable, number: int, inputs: list[np.ndarray], specs: list[tuple],
            order: list):
        """One call: ``inputs`` (host arrays) and the kept device values ``order`` names, in the program's order.
        Returns (result, arrays left for the next call, their keys)."""
        metas = [_meta(a) for a in inputs]
        specs = [list(s) for s in specs]
        serial = next(self.calls)
        return self._call("run", (self.uid, number, metas, specs, order, serial),
                          lambda: _run(self.runtime, mesh, state, executable, metas, specs, inputs, order, self.kept,
                                       serial))

    def release(self) -> None:
        self.kept.clear()
        self._call("release", (self.uid,), lambda: None)


def export_program(fn, example: tuple) -> tuple[bytes, Any]:
    """``fn`` traced once on ``example`` (shape structs with shardings), serialized, and the jitted program the
    first process runs (compiled from the same serialized module as the workers')."""
    from ..engine.runtime import export_stablehlo

    blob = export_stablehlo(fn, example)
    return blob, compile_exported(blob)


# --- a worker --------------------------------------------------------------------------------------------------------
@dataclass
class _WorkerModule:
    mesh: Any = None
    state: dict = field(default_factory=dict)
    programs: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)  # arrays the last call left on the devices, by key


_modules: dict[int, _WorkerModule] = {}
_lock = threading.Lock()


def worker_call(runtime, method: str, args: list):
    """What a worker runs for one ``bridge`` call of the first process."""
    uid = args[0]
    with _lock:
        module = _modules.setdefault(uid, _WorkerModule())
    if method == "place":
        _, sizes, names, metas, specs = args
        module.mesh = module.mesh or _mesh(runtime, sizes)
        _place(runtime, module.mesh, module.state, names, metas, specs, None)
    elif method == "program":
        _, number, blob = args
        module.programs[number] = compile_exported(blob)
    elif method == "run":
        _, number, metas, specs, order, serial = args
        _run(runtime, module.mesh, module.state, module.programs[number], metas, specs, None, order, module.kept,
             serial)
    elif method == "release":
        module.state.clear()
        module.kept.clear()
    else:
        raise ValueError(f"unknown bridge call {method!r}")
    return None
