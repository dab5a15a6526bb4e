"""Which accelerator this machine has, and why JAX did not take it.

A TPU VM shows its chips before any library loads: PCI devices of Google's vendor id (0x1ae0) with a TPU device id
under ``/sys/bus/pci/devices``, and the device files libtpu opens, ``/dev/accel0``.. (TPU v2 to v4) or
``/dev/vfio/0``.. (v5e and later). When the runtime ends up on the CPU of such a machine (libtpu not installed, the
chips held by another process, jax, jaxlib and libtpu of different releases), a video model would run on the host
for hours: ``start_backend`` stops instead, before any model loads, with the reason and the fix.
``TPU_VIDEO_EXPECT=tpu`` (or ``gpu``) asks the same of any machine; ``TPU_VIDEO_ALLOW_CPU=1`` accepts the CPU with one
warning line. A ``JAX_PLATFORMS=cpu`` set on a machine without chips (CI, the tests) is a choice, not a fallback.

Every path is read under a root folder, ``/`` or ``$TPU_VIDEO_HOST_ROOT``: tests fake a machine with chips, and the
processes holding them, in a temporary folder.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import AcceleratorUnavailable, InputError

log = logging.getLogger(__name__)

EXPECT_ENV = "TPU_VIDEO_EXPECT"
ALLOW_CPU_ENV = "TPU_VIDEO_ALLOW_CPU"
HOST_ROOT_ENV = "TPU_VIDEO_HOST_ROOT"
GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device ids of Google's TPU chips (Google's vendor id also covers its virtual NIC, gVNIC, which is no TPU).
TPU_PCI_DEVICES = {"0x0027": "v2/v3", "0x0056": "TPU", "0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e",
                   "0x006f": "v6e", "0x0076": "v7x"}
PROCESSING_ACCELERATOR_CLASS = "0x12"  # PCI class 0x12: processing accelerators (a TPU id not in the table above)
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
_TRUE = ("1", "true", "yes", "on")
_PLATFORM_NAMES = {"tpu": "TPU", "gpu": "GPU"}


def host_root(environ=os.environ) -> Path:
    """The folder ``/dev``, ``/sys`` and ``/proc`` are read under: ``/``, or ``$TPU_VIDEO_HOST_ROOT`` (tests)."""
    return Path(environ.get(HOST_ROOT_ENV) or "/")


@dataclass(frozen=True)
class Chips:
    """The TPU chips a machine shows: PCI addresses (with the chip's generation) and the device files libtpu opens, as
    the machine names them (``/dev/vfio/0``)."""

    pci: tuple[tuple[str, str], ...] = ()
    device_files: tuple[str, ...] = ()
    pci_visible: bool = True

    @property
    def count(self) -> int:
        if self.pci:
            return len(self.pci)
        accel = [f for f in self.device_files if f.startswith("/dev/accel")]
        # /dev/vfio/N alone (no PCI information to tell a TPU from another VFIO device) counts where sysfs is hidden
        return len(accel) or (0 if self.pci_visible else len(self.device_files))

    def __bool__(self) -> bool:
        return self.count > 0

    def describe(self) -> str:
        kinds = sorted({kind for _, kind in self.pci})
        kind = f" {'/'.join(kinds)}" if kinds and "TPU" not in kinds else ""
        where = []
        if self.pci:
            where.append("PCI " + ", ".join(address for address, _ in self.pci[:4]) + (" …" if len(self.pci) > 4
                                                                                         else ""))
        if self.device_files:
            where.append(", ".join(self.device_files[:4]) + (" …" if len(self.device_files) > 4 else ""))
        return f"{self.count} TPU{kind} chip{'s' if self.count != 1 else ''} ({'; '.join(where)})"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def find_chips(root: Path | None = None) -> Chips:
    """The TPU chips under ``root`` (default: this machine), read from PCI and ``/dev`` without loading anything."""
    root = host_root() if root is None else Path(root)
    devices = root / "sys" / "bus" / "pci" / "devices"
    pci = []
    for vendor in sorted(devices.glob("*/vendor")):
        if _read(vendor) != GOOGLE_PCI_VENDOR:
            continue
        device = _read(vendor.parent / "device")
        if device in TPU_PCI_DEVICES or _read(vendor.parent / "class").startswith(PROCESSING_ACCELERATOR_CLASS):
            pci.append((vendor.parent.name, TPU_PCI_DEVICES.get(device, "TPU")))
    dev = root / "dev"
    files = sorted(f"/dev/{p.name}" for p in dev.glob("accel[0-9]*"))
    files += sorted(f"/dev/vfio/{p.name}" for p in (dev / "vfio").glob("[0-9]*"))
    return Chips(tuple(pci), tuple(files), devices.is_dir())


def tpu_chips_here() -> int:
    """TPU chips on this machine (0 elsewhere)."""
    return find_chips().count


@dataclass(frozen=True)
class Holder:
    """A process with a chip's device file open."""

    pid: int
    command: str
    device_file: str


def chip_holders(chips: Chips, root: Path | None = None, own_pid: int | None = None) -> tuple[list[Holder], int]:
    """The other processes holding ``chips``' device files (found through ``/proc/*/fd``), and how many processes
    could not be looked into (another user's, without root)."""
    root = host_root() if root is None else Path(root)
    own_pid = os.getpid() if own_pid is None else own_pid
    wanted = set(chips.device_files)
    found, hidden = [], 0
    if not wanted:
        return found, hidden
    try:
        processes = sorted((p for p in (root / "proc").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    except OSError:
        return found, hidden
    for process in processes:
        if int(process.name) == own_pid:
            continue
        try:
            descriptors = list((process / "fd").iterdir())
        except PermissionError:
            hidden += 1
            continue
        except OSError:  # the process ended meanwhile
            continue
        for descriptor in descriptors:
            try:
                target = os.readlink(descriptor)
            except OSError:
                continue
            if target in wanted:
                found.append(Holder(int(process.name), _command(process), target))
                break
    return found, hidden


def _command(process: Path) -> str:
    try:
        command = process.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    command = command or _read(process / "comm") or "?"
    return command if len(command) <= 120 else command[:117] + "..."


def libtpu_installed() -> bool:
    """Whether JAX can find libtpu: ``$TPU_LIBRARY_PATH`` naming a file, or the ``libtpu`` package (``jax[tpu]``)."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path and os.path.isfile(path):
        return True
    return importlib.util.find_spec("libtpu") is not None


def release_mismatches(extra: str = "tpu") -> list[str]:
    """Where the installed jaxlib (and libtpu, or the CUDA plugin) is not a release the installed jax asks for with its
    ``extra`` (``jax[tpu]`` pins the jaxlib and libtpu it was built with)."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
        jax_version = metadata.version("jax")
        wanted = [Requirement(r) for r in metadata.requires("jax") or ()]
    except Exception:  # noqa: BLE001 - no metadata to compare (or no packaging to read it): nothing to say
        return []
    found = []
    for requirement in wanted:
        name = requirement.name.lower().replace("_", "-")
        if name not in ("jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda13-plugin") or (
                requirement.marker is not None and not requirement.marker.evaluate({"extra": extra})):
            continue
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # a missing libtpu or plugin is said on its own
        if not requirement.specifier.contains(installed, prereleases=True):
            found.append(f"jax {jax_version} needs {name}{requirement.specifier}, but {name} {installed} is installed")
    return found


@dataclass(frozen=True)
class Expectation:
    """What the runtime must start on (``platform``: "tpu", "gpu", or None when the CPU is fine), why, and whether the
    user accepts the CPU anyway."""

    platform: str | None
    why: str = ""
    chips: Chips = Chips()
    allow_cpu: bool = False
    root: Path = Path("/")

    @property
    def name(self) -> str:
        return _PLATFORM_NAMES.get(self.platform or "", "accelerator")


def expectation(environ=os.environ, root: Path | None = None) -> Expectation:
    """What this machine, ``TPU_VIDEO_EXPECT`` and a ``JAX_PLATFORMS`` that names an accelerator first ask of the
    runtime (a bad value of ``TPU_VIDEO_EXPECT`` raises ``InputError``)."""
    root = host_root(environ) if root is None else Path(root)
    value = environ.get(EXPECT_ENV, "").strip().lower()
    if value not in ("", "tpu", "gpu", "cpu"):
        raise InputError(f"{EXPECT_ENV}={environ.get(EXPECT_ENV)!r}: use tpu, gpu or cpu (or leave it unset: the TPU "
                         "wherever the machine has TPU chips)")
    chips = find_chips(root)
    allow = environ.get(ALLOW_CPU_ENV, "").strip().lower() in _TRUE
    if value == "cpu":
        return Expectation(None, f"{EXPECT_ENV}=cpu", chips, allow, root)
    if value:
        why = f"{EXPECT_ENV}={value}" + (f" and this machine has {chips.describe()}" if value == "tpu" and chips else "")
        return Expectation(value, why, chips, allow, root)
    if chips:
        return Expectation("tpu", f"this machine has {chips.describe()}", chips, allow, root)
    chosen = environ.get("JAX_PLATFORMS", "").strip().lower()
    first = chosen.split(",")[0].strip()
    if first in ("tpu", "cuda", "gpu"):  # a platform asked of JAX by name is expected as much
        return Expectation("tpu" if first == "tpu" else "gpu", f"JAX_PLATFORMS={chosen}", chips, allow, root)
    return Expectation(None, "", chips, allow, root)


def user_platforms() -> str:
    """The platforms a user chose (``JAX_PLATFORMS``, or ``jax.config`` set before the runtime), or ""."""
    import jax

    return os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""


def choose_platform(expected: Expectation) -> str | None:
    """Ask JAX for the platform the runtime must start on, before any backend starts. Expecting a TPU (or GPU), ask
    for it by name, so that a failure to start it is JAX's error rather than a quiet CPU. With no TPU here and
    nothing asked for, keep JAX from starting libtpu (installed by ``jax[tpu]``), which prints initialisation
    errors that look like failures: the GPU where JAX's CUDA plugin is installed and a GPU present, else the CPU.
    A platform the user chose always stays. Returns what was asked for (None: left to JAX)."""
    import jax

    if user_platforms():
        return None
    if expected.platform is not None:
        if expected.allow_cpu:
            if expected.platform == "tpu" and not expected.chips:
                jax.config.update("jax_platforms", "cpu")  # nothing for libtpu to open: spare its start-up errors
                return "cpu"
            return None  # JAX's own choice; a failure falls back to the CPU with a warning
        platforms = "tpu,cpu" if expected.platform == "tpu" else "cuda,cpu"
        jax.config.update("jax_platforms", platforms)
        return platforms
    if expected.chips:
        return None
    cuda = any(importlib.util.find_spec(m) for m in CUDA_PLUGINS) and \
        bool(list((expected.root / "dev").glob("nvidia[0-9]*")))
    platforms = "cuda,cpu" if cuda else "cpu"
    jax.config.update("jax_platforms", platforms)
    log.info("no TPU on this machine: JAX runs on %s (set JAX_PLATFORMS to choose)", platforms.split(",")[0])
    return platforms


def start_backend(expected: Expectation, asked: str | None = None) -> tuple[list, str]:
    """Start JAX's backend: its devices, and "" or (the CPU accepted with ``TPU_VIDEO_ALLOW_CPU=1``) why the runtime is
    on the CPU against the expectation. Raises ``AcceleratorUnavailable`` naming the cause and the fix when it is.
    ``asked``: what ``choose_platform`` asked JAX for."""
    import jax

    if expected.platform == "tpu" and not expected.chips and asked == "tpu,cpu":
        # Asked for by name on a machine that shows no chip: nothing for libtpu to open (and no start-up noise).
        raise AcceleratorUnavailable(explain(expected, "", None))
    try:
        devices = jax.devices()
    except RuntimeError as error:
        if expected.platform is None:
            raise
        if not expected.allow_cpu:
            raise AcceleratorUnavailable(explain(expected, "", str(error))) from None
        text = explain(expected, "", str(error), short=True)
        jax.config.update("jax_platforms", "cpu")
        return jax.devices(), text
    backend = devices[0].platform
    if expected.platform is None or backend == expected.platform or (
            expected.platform == "gpu" and backend in ("gpu", "cuda", "rocm")):
        return devices, ""
    text = explain(expected, backend, _quiet_error(expected.platform), short=expected.allow_cpu)
    if not expected.allow_cpu:
        raise AcceleratorUnavailable(text)
    return devices, text


def _quiet_error(platform: str) -> str | None:
    """The error JAX kept to itself when it started the CPU in place of ``platform`` (it logs it at INFO only)."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return None
    errors = getattr(xla_bridge, "_backend_errors", {}) or {}
    return errors.get(platform) or (errors.get("cuda") if platform == "gpu" else None)


def reasons(expected: Expectation) -> list[str]:
    """Why the runtime is not on the expected platform, each with its fix, most likely first."""
    found = []
    python = sys.executable or "python"
    chosen = user_platforms()
    wanted = "tpu" if expected.platform == "tpu" else "cuda"
    if chosen and wanted not in chosen and not (expected.platform == "gpu" and "gpu" in chosen):
        found.append(f"JAX_PLATFORMS={chosen} keeps JAX off the {expected.name}: unset it (or add {wanted})")
    if expected.platform == "tpu":
        if not expected.chips:
            found.append("this machine shows no TPU chip (no Google TPU device under /sys/bus/pci/devices, no "
                         "/dev/accel* or /dev/vfio/* device file): run on the TPU VM itself (`gcloud compute tpus "
                         "tpu-vm ssh NAME --zone ZONE`), or inside a container give it the devices (--privileged)")
        if not libtpu_installed():
            found.append(f"libtpu is not installed in this Python ({python}), so JAX cannot drive the chips: "
                         f"`{python} -m pip install -U \"jax[tpu]\"` (the pack's requirements.txt brings it)")
        holders, hidden = chip_holders(expected.chips, expected.root)
        for holder in holders:
            found.append(f"the TPU is held by another process: pid {holder.pid} (`{holder.command}`) has "
                         f"{holder.device_file} open, and a TPU is driven by one process at a time: stop it (`kill "
                         f"{holder.pid}`) or let it finish")
        if hidden and not holders:
            found.append(f"{hidden} process(es) of other users could not be looked into for the chips' device files: "
                         f"`sudo lsof {' '.join(sorted({f.rsplit('/', 1)[0] + '/*' for f in expected.chips.device_files}))}`"
                         " lists those holding them")
    elif expected.platform == "gpu":
        if not any(importlib.util.find_spec(m) for m in CUDA_PLUGINS):
            found.append(f"JAX's CUDA plugin is not installed in this Python ({python}): "
                         f"`{python} -m pip install -U \"jax[cuda12]\"` (the pack's `cuda` extra)")
        if not list((expected.root / "dev").glob("nvidia[0-9]*")):
            found.append("no NVIDIA GPU device file (/dev/nvidia0) on this machine: check `nvidia-smi` and the driver")
    extra = "tpu" if expected.platform == "tpu" else "cuda12"
    mismatched = release_mismatches(extra)
    if mismatched:
        from importlib import metadata

        found.append("the JAX releases installed do not belong together (" + "; ".join(mismatched) + f"): "
                     f"`{python} -m pip install -U \"jax[{extra}]=={metadata.version('jax')}\"` installs the "
                     "matching ones")
    return found


def explain(expected: Expectation, backend: str, jax_error: str | None, short: bool = False) -> str:
    """The message of a runtime that would run on the CPU instead of ``expected``'s platform: why it expects it, each
    cause found with its fix, JAX's own words, and how to accept the CPU anyway."""
    causes = reasons(expected)
    if backend:
        started = f"JAX started on the {backend.upper()}"
    elif jax_error:
        started = f"JAX could not start the {expected.name}"
    else:
        started = f"there is no {expected.name} here to start"
    head = (f"the runtime would run on the CPU, not the {expected.name}: {expected.why}, but {started}; a video "
            f"model would then run on the host for hours")
    said = ""
    if jax_error:
        lines = [line.strip() for line in str(jax_error).strip().splitlines() if line.strip()]
        said = " ".join(lines[:3])
        said = said if len(said) <= 600 else said[:597] + "..."
    if short:  # one log line
        return (f"{expected.why}, but {started}" + (": " + "; ".join(causes) if causes else "")
                + (f" (JAX: {said})" if said else ""))
    parts = [head + "."]
    if causes:
        parts += [f"- {cause}." for cause in causes]
    else:
        parts.append("- no cause was found on this machine beyond what JAX says below; `python -c \"import jax; "
                     "print(jax.devices())\"` shows it again.")
    if said:
        parts.append(f"JAX said: {said}")
    parts.append(f"Fix the cause and start again (ComfyUI too: a process starts its backend once). To run on the CPU "
                 f"anyway, set {ALLOW_CPU_ENV}=1.")
    return "\n".join(parts)
