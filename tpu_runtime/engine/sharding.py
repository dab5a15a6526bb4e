"""Meshes and sharding rules, as data.

A mesh is three axes ``("dp", "sp", "tp")`` (the seed measured +10.7% from this order): ``dp`` splits the CFG
batch of two, ``sp`` the sequence inside attention, ``tp`` attention heads and the feed-forward width.

Weights are placed by a per-family rule table (``families/<name>/rules.py``): the first regex (on the parameter name) that matches gives the
PartitionSpec; anything unmatched is replicated. Tensor parallelism follows Megatron: q/k/v and the first
feed-forward projection are split on their output dimension (column parallel), the attention output and the
second feed-forward projection on their input dimension (row parallel), so each block needs one all-reduce
after attention and one after the feed-forward. ``fsdp=True`` also splits every matrix over ``dp``, on a
dimension tp leaves whole (memory for speed: each is gathered over dp before use).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

from ..errors import InputError

AXES = ("dp", "sp", "tp")

@dataclass(frozen=True)
class MeshSpec:
    dp: int = 1
    sp: int = 1
    tp: int = 1

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (self.dp, self.sp, self.tp)

    @property
    def devices(self) -> int:
        return self.dp * self.sp * self.tp

    def __str__(self) -> str:
        return f"dp={self.dp},sp={self.sp},tp={self.tp}"


def parse_mesh(text: str | dict | MeshSpec | None) -> MeshSpec | None:
    """``"dp=2,sp=1,tp=4"`` (or a dict) to a MeshSpec; ``None``/``"auto"``/``""`` mean: choose for me."""
    if text is None or isinstance(text, MeshSpec):
        return text
    if isinstance(text, dict):
        items = dict(text)
    else:
        text = text.strip()
        if text in ("", "auto"):
            return None
        items = {}
        for part in text.split(","):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or not value.strip().isdigit():
                raise InputError(f"mesh {text!r}: write it as dp=N,sp=N,tp=N (e.g. dp=2,sp=1,tp=4)")
            items[name] = int(value)
    unknown = sorted(set(items) - set(AXES))
    if unknown:
        raise InputError(f"mesh axis {unknown[0]!r} is not one of {AXES}: write the mesh as dp=N,sp=N,tp=N")
    for name, value in items.items():
        if value < 1:
            raise InputError(f"mesh axis {name}={value} must be at least 1")
    return MeshSpec(**{a: int(items.get(a, 1)) for a in AXES})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_mesh(devices: int, heads: int, cfg: bool = True) -> MeshSpec:
    """CFG's batch of two on dp (when the device count is even), then as much tp as the heads allow, rest on sp.

    On 8 devices with 48 heads (5b, 1.5) this is the seed's best: dp=2, tp=4.
    """
    dp = 2 if cfg and devices % 2 == 0 else 1
    rest = devices // dp
    tp = max(d for d in _divisors(rest) if heads % d == 0)
    return MeshSpec(dp=dp, sp=rest // tp, tp=tp)


def validate_mesh(mesh: MeshSpec, devices: int, heads: int, batch: int | None = None) -> None:
    """Raise ``InputError`` naming the axis that does not fit, before anything compiles."""
    if mesh.devices != devices:
        raise InputError(
            f"mesh {mesh} uses {mesh.devices} devices but {devices} are available: choose sizes whose product "
            f"is {devices}"
        )
    if heads % mesh.tp:
        ok = [d for d in _divisors(devices) if heads % d == 0]
        raise InputError(f"mesh axis tp={mesh.tp} does not divide the model's {heads} attention heads: "
                         f"use tp in {ok}")
    if batch is not None and batch % mesh.dp:
        raise InputError(
            f"mesh axis dp={mesh.dp} does not divide the batch of {batch} "
            f"({'CFG batch of negative and positive prompt' if batch == 2 else 'no CFG: guidance <= 1'}): "
            f"use dp=1{' or dp=2' if batch == 2 else ''}"
        )


def spec_for(name: str, rules) -> tuple:
    for pattern, spec in rules:
        if re.search(pattern, name):
            return spec
    return ()


def split_axes(mesh_sizes: dict[str, int], size: int) -> tuple[str, ...]:
    """The mesh axes to split a dimension of ``size`` over: the combination of axes (in mesh order) with the most
    devices whose product divides ``size``; () when none does."""
    axes = [(a, n) for a, n in mesh_sizes.items() if n > 1]
    best, most = (), 1
    for r in range(len(axes), 0, -1):
        for combo in itertools.combinations(axes, r):
            n = math.prod(n for _, n in combo)
            if size % n == 0 and n > most:
                best, most = tuple(a for a, _ in combo), n
    return best


def frame_split_spec(mesh_sizes: dict[str, int], shape: tuple[int, ...]) -> tuple:
    """The VAE's width split of a ``[..., H, W]`` tensor: W over the axes with the most devices that divide it,
    then H over those of the axes left that divide it; () when neither splits."""
    columns = split_axes(mesh_sizes, shape[-1])
    rows = split_axes({a: n for a, n in mesh_sizes.items() if a not in columns}, shape[-2])
    if not columns and not rows:
        return ()
    return (None,) * (len(shape) - 2) + (rows or None, columns or None)


def fsdp_spec(shape: tuple[int, ...], dp: int, spec: tuple = ()) -> tuple:
    """``spec`` with ``dp`` added on the largest dimension it leaves free that ``dp`` divides (a tp-split matrix
    gets dp on its other dimension); vectors and indivisible tensors keep ``spec``."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    if dp == 1 or len(shape) < 2:
        return spec
    for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if spec[i] is None and shape[i] % dp == 0:
            return tuple("dp" if j == i else spec[j] for j in range(len(shape)))
    return spec


def partition_specs(named_shapes: dict[str, tuple[int, ...]], rules, mesh_sizes: dict[str, int],
                    fsdp: bool = False) -> dict[str, tuple]:
    """The PartitionSpec (as a tuple) for every parameter; axes that do not divide a dimension are dropped."""
    specs = {}
    for name, shape in named_shapes.items():
        spec = spec_for(name, rules)
        if fsdp:
            spec = fsdp_spec(shape, mesh_sizes.get("dp", 1), spec)
        spec = tuple(
            axis if axis is not None and shape[i] % mesh_sizes.get(axis, 1) == 0 else None
            for i, axis in enumerate(spec)
        )
        specs[name] = spec
    return specs
