"""TPU slices as users name them (``v6e-8``, ``v5p-8``, ``v7x-8``), described for the TPU compiler that ``jax[tpu]``
installs: the abstract devices ``plan`` compiles for on a machine without a TPU.

A JAX device is a TensorCore. v5e and v6e chips have one; v4 and v5p chips have two that act as one device
(megacore); a v7x (Ironwood) chip has two that JAX counts as two devices, each with half the chip's HBM. v4, v5p
and v7x slices are named by TensorCores, as Google names them (v5p-8 and v7x-8 are 4 chips), v5e and v6e by chips.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from ..errors import InputError

GIB = 1024 ** 3
# HBM per chip (Cloud TPU documentation).
CHIP_HBM = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB, "v7x": 192 * GIB}
# JAX devices per chip: v7x's two TensorCores are two devices (v4/v5p's two act as one).
DEVICES_PER_CHIP = {"v7x": 2}
# Peak dense bfloat16 compute and HBM bandwidth per chip, as published in the Cloud TPU documentation's system
# architecture tables (the pages "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e" and "TPU7x (Ironwood)"): they turn a
# program's flops and bytes into a lower bound on its seconds (``plan``'s cost estimate).
CHIP_PEAK_BF16_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12, "v7x": 2307e12}
CHIP_HBM_BYTES_PER_SECOND = {"v4": 1200e9, "v5e": 819e9, "v5p": 2765e9, "v6e": 1638e9, "v7x": 7380e9}
# The kind as libtpu names it in a topology ("tpu7x:2x2x1").
LIBTPU_KIND = {"v7x": "tpu7x"}
# v5e/v6e slices are 2-D (chips); v4/v5p/v7x slices are named by TensorCores (2 per chip) and are 3-D.
_LAYOUT_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_LAYOUT_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8)}
_SLICE_SIZES = {"v5e": (1, 4, 8, 16, 32, 64), "v6e": (1, 4, 8, 16, 32, 64), "v5p": (8, 16, 32, 64, 128),
                "v4": (8, 16, 32, 64, 128), "v7x": (4, 8, 16, 32, 64)}  # chips
_TENSORCORE_NAMED = ("v4", "v5p", "v7x")
CPU = "cpu"  # not a TPU: this process's CPU devices (``cpu``, ``cpu-8``), for a CPU server's saved programs


@dataclass(frozen=True)
class Topology:
    """A TPU slice as users name it (``v6e-8``): chip kind, chip count, physical layout of the chips."""

    name: str
    kind: str
    chips: int
    layout: tuple[int, ...]

    @property
    def devices_per_chip(self) -> int:
        return DEVICES_PER_CHIP.get(self.kind, 1)

    @property
    def device_count(self) -> int:
        return self.chips * self.devices_per_chip

    @property
    def chip_hbm_bytes(self) -> int:
        if self.kind == CPU:  # the host's memory, shared by its CPU devices
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // self.chips
        return CHIP_HBM[self.kind]

    @property
    def hbm_bytes(self) -> int:
        """HBM of one JAX device (a v7x TensorCore has half its chip's)."""
        return self.chip_hbm_bytes // self.devices_per_chip

    @property
    def peak_flops(self) -> float:
        """Peak bfloat16 flop/s of one JAX device (a v7x TensorCore has half its chip's; 0: not published)."""
        return CHIP_PEAK_BF16_FLOPS.get(self.kind, 0.0) / self.devices_per_chip

    @property
    def hbm_bytes_per_second(self) -> float:
        """HBM bandwidth of one JAX device (a v7x TensorCore has half its chip's; 0: not published)."""
        return CHIP_HBM_BYTES_PER_SECOND.get(self.kind, 0.0) / self.devices_per_chip

    @property
    def hosts(self) -> int:
        return max(1, self.chips // self._chips_per_host)

    @property
    def _chips_per_host(self) -> int:
        # Single-host slices hold every chip (v5e/v6e up to 8); multi-host slices are made of 4-chip hosts.
        return self.chips if self.kind in ("v5e", "v6e") and self.chips <= 8 else 4

    def devices(self) -> list:
        """The slice's devices as abstract JAX devices (compile for them; nothing runs); for ``cpu`` this process's
        CPU devices (the programs then run here too: ``plan --save`` for a CPU server)."""
        from jax.experimental import topologies

        if self.kind == CPU:
            return cpu_devices(self.chips)
        quiet_libtpu(self)
        name = f"{LIBTPU_KIND.get(self.kind, self.kind)}:{'x'.join(map(str, self.layout))}"
        bounds = None
        if self.kind in ("v5e", "v6e") and self.chips <= 8:
            bounds = (*self.layout, 1)
        elif self.chips < 4:
            bounds = self.layout
        try:
            kwargs = {"chips_per_host_bounds": bounds} if bounds else {}
            devices = list(topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs).devices)
        except Exception as exc:  # noqa: BLE001 - no libtpu, or a layout this libtpu does not know
            raise InputError(f"cannot describe TPU topology {self.name} ({name}): {exc}. plan needs the TPU compiler "
                             "that jax[tpu] installs (pip install 'jax[tpu]')") from exc
        if len(devices) != self.device_count:
            raise InputError(f"TPU topology {self.name} ({name}) came back with {len(devices)} devices, not the "
                             f"{self.device_count} expected: this libtpu counts its chips another way")
        return devices

    def __str__(self) -> str:
        return self.name


def cpu_devices(count: int) -> list:
    """``count`` of this process's CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` makes N)."""
    import jax

    devices = jax.devices("cpu")
    if len(devices) < count:
        raise InputError(f"topology cpu-{count} needs {count} CPU devices, this process has {len(devices)}: start it "
                         f"with XLA_FLAGS=--xla_force_host_platform_device_count={count}")
    return devices[:count]


def quiet_libtpu(topology: Topology) -> None:
    """Describing a topology loads libtpu. On a machine without TPU chips libtpu prints initialisation errors
    ("could not determine TPU accelerator type", "unexpected worker hostname") that look like failures of the plan;
    it reads what a TPU VM would tell it from the environment, so say it here (one host, the slice's type).
    libtpu also takes a machine-wide lock for the TPU it drives; describing a topology drives none, so a plan may
    run beside another plan or a server that holds the chips."""
    from ..engine.runtime import tpu_chips_here

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not tpu_chips_here():
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type(topology))


def accelerator_type(topology: Topology) -> str:
    """The slice's Cloud TPU accelerator type (``v5litepod-8``, ``v6e-8``, ``v5p-8``, ``tpu7x-8``)."""
    kind = {"v5e": "v5litepod", "v7x": "tpu7x"}.get(topology.kind, topology.kind)
    return f"{kind}-{topology.chips * (2 if topology.kind in _TENSORCORE_NAMED else 1)}"


def parse_topology(text: str) -> Topology:
    """``v6e-8``, ``v5e-4``, ``v5p-8`` and ``v7x-8`` (TensorCores, as Google names v5p/v4/v7x slices: 4 chips),
    ``v6e-1``; or a chip layout such as ``v6e:2x4`` or ``v7x:2x2x1``; or ``cpu`` / ``cpu-N``, this machine's CPU
    devices."""
    raw = str(text).strip().lower().replace("v5litepod", "v5e").replace("tpu7x", "v7x")
    cpu = re.fullmatch(r"cpu(?:-(\d+))?", raw)
    if cpu:  # this machine's CPU devices: the target of a CPU server's saved programs (plan --save)
        count = int(cpu.group(1) or 1)
        if count < 1:
            raise InputError(f"topology {text!r}: give at least one CPU device (cpu, cpu-8)")
        return Topology(raw, CPU, count, (count,))
    match = re.fullmatch(r"(v4|v5e|v5p|v6e|v7x)[-:](\S+)", raw)
    if match:
        kind, size = match.groups()
        if ":" in raw:
            try:
                layout = tuple(int(x) for x in size.split("x"))
            except ValueError:
                layout = ()
            if layout and all(n > 0 for n in layout):
                return Topology(raw, kind, int(np.prod(layout)), layout)
        elif size.isdigit():
            n = int(size)
            if kind in ("v5e", "v6e") and n in _LAYOUT_2D:
                return Topology(raw, kind, n, _LAYOUT_2D[n])
            if kind in _TENSORCORE_NAMED and n // 2 in _LAYOUT_3D and n % 2 == 0:
                return Topology(raw, kind, n // 2, _LAYOUT_3D[n // 2])
    raise InputError(f"topology {text!r} is not a TPU slice this plan knows: use one of {', '.join(EXAMPLES)} "
                     "(or a chip layout such as v6e:2x4)")


EXAMPLES = ("v6e-8", "v6e-4", "v5e-8", "v5p-8", "v7x-8", "v6e-1", "v6e-16")
