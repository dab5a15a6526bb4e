"""Compiling one stage program for a TPU topology this machine does not have, and reading what the compiler says
about it: per-chip memory (``memory_analysis()``), the collectives and Mosaic kernels in the compiled HLO, the
compile time (with a "still compiling" line every ``PROGRESS_EVERY`` seconds). ``plan`` (``plan.py``) calls it for
every program of a generation and every candidate mesh.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import time
from dataclasses import dataclass, replace

import numpy as np

from .topology import GIB, Topology

log = logging.getLogger("tpu_runtime.tools.plan")

MOSAIC = "tpu_custom_call"  # a Pallas kernel lowered for TPU
_COLLECTIVES = {"all_reduces": "all-reduce", "all_gathers": "all-gather", "reduce_scatters": "reduce-scatter",
                "all_to_alls": "all-to-all", "collective_permutes": "collective-permute"}


@dataclass
class StageReport:
    compiled: bool
    error: str | None = None
    skipped: bool = False  # not compiled: the verdict was already "does not fit"
    describe: str = ""
    weights_bytes_per_chip: int = 0
    argument_bytes_per_chip: int = 0
    temp_bytes_per_chip: int = 0
    output_bytes_per_chip: int = 0
    total_bytes_per_chip: int = 0
    all_reduces: int = 0
    all_gathers: int = 0
    reduce_scatters: int = 0
    all_to_alls: int = 0
    collective_permutes: int = 0
    mosaic_kernels: int = 0
    compile_seconds: float = 0.0


# --- compiling -------------------------------------------------------------------------------------------------
def shard_bytes(state: dict) -> int:
    """Bytes per chip of a state of shape structs (each distinct struct once, by its shard's shape); a state may
    nest several components' (LTX-2's audio decode takes the audio VAE's and the vocoder's)."""
    import jax

    seen, total = set(), 0
    for struct in jax.tree_util.tree_leaves(state):
        if id(struct) in seen:
            continue
        seen.add(id(struct))
        total += int(np.prod(struct.sharding.shard_shape(struct.shape), dtype=np.int64)) * struct.dtype.itemsize
    return total


def count_ops(hlo: str) -> dict[str, int]:
    """Collectives and Mosaic kernels in a compiled program's HLO text (instructions, not executions).

    A collective the compiler cuts into a chain of pieces keeps its channel id and counts once: for v5e it splits
    a large all-gather of keys/values into four, which counted as instructions gave CogVideoX-2b's step 151
    all-gathers on v5e-8 against 61 on v6e-8 for the same program."""
    patterns = {key: re.compile(rf"\b{op}(?:-start)?\(") for key, op in _COLLECTIVES.items()}
    counts = dict.fromkeys(_COLLECTIVES, 0)
    channels: set[tuple[str, str]] = set()
    for line in hlo.splitlines():
        for key, pattern in patterns.items():
            if pattern.search(line):
                channel = re.search(r"\bchannel_id=(\d+)", line)
                if channel is None or (key, channel.group(1)) not in channels:
                    counts[key] += 1
                if channel is not None:
                    channels.add((key, channel.group(1)))
                break
    counts["mosaic_kernels"] = hlo.count(f'custom_call_target="{MOSAIC}"')
    return counts


_COMPILED: dict[tuple, StageReport] = {}  # (topology, program text) -> report: identical programs compile once


def compile_program(program, topo: Topology) -> StageReport:
    """Compile one ``StageProgram`` for its (TPU) mesh and read its memory and collectives."""
    import jax

    from ..engine.runtime import lower

    weights_bytes = shard_bytes(program.example[0])
    inputs = [x for x in jax.tree_util.tree_leaves(program.example[1:]) if hasattr(x, "sharding")]
    inputs_bytes = shard_bytes(dict(enumerate(inputs)))
    report = StageReport(compiled=False, describe=program.describe, weights_bytes_per_chip=weights_bytes)
    if weights_bytes > topo.hbm_bytes:
        report.error = _weights_alone(weights_bytes, topo)
        return report
    start = time.perf_counter()
    try:
        key, compiled = _in_background(lambda: _lower_and_compile(program, topo, lower), program.describe, topo)
        if compiled is None:
            return replace(_COMPILED[key], describe=program.describe)
    except MemoryError:
        report.error = "this machine ran out of host memory compiling it: plan on a machine with more memory"
        return report
    except Exception as exc:  # noqa: BLE001 - the compiler's own message is the report (e.g. HBM exhausted)
        # The compiler's first lines say what ran out and where (e.g. which fusion needs how much VMEM).
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        report.error = f"{type(exc).__name__}: {' '.join(lines[:4])[:800]}"
        report.compile_seconds = round(time.perf_counter() - start, 1)
        return report
    report.compile_seconds = round(time.perf_counter() - start, 1)
    report.compiled = True
    memory = compiled.memory_analysis()
    if memory is not None:
        report.argument_bytes_per_chip = int(memory.argument_size_in_bytes)
        report.output_bytes_per_chip = int(memory.output_size_in_bytes)
        report.temp_bytes_per_chip = int(memory.temp_size_in_bytes)
        # Weights and inputs as placed (the compiler leaves unused arguments out of its count; they are still
        # on the chip), plus what the program allocates.
        report.total_bytes_per_chip = int(weights_bytes + inputs_bytes + memory.output_size_in_bytes
                                          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
    for name, value in count_ops(compiled.as_text()).items():
        setattr(report, name, value)
    _COMPILED[key] = report
    return report


def _weights_alone(weights_bytes: int, topo: Topology) -> str:
    return (f"not compiled: its weights alone need {weights_bytes / GIB:.1f} GiB per chip, the chip has "
            f"{topo.hbm_bytes / GIB:.0f} GiB")


def _lower_and_compile(program, topo: Topology, lower):
    """(key, executable) of ``program`` for ``topo``; the executable is None when an identical program (same text,
    same topology) was compiled before in this process."""
    with program.scope():
        lowered = lower(program.fn, *program.example)
    key = (topo.name, hashlib.sha256(lowered.as_text().encode()).hexdigest())
    if key in _COMPILED:
        return key, None
    return key, lowered.compile()


PROGRESS_EVERY = 30.0  # seconds between "still compiling" lines


def _in_background(work, describe: str, topo: Topology):
    """``work()`` in a thread, this thread waiting in short slices: long compiles say every ``PROGRESS_EVERY``
    seconds what is compiling and for how long, and SIGINT/SIGTERM are handled at once, not when the compiler
    returns (minutes, for a VAE decode)."""
    import threading

    result: dict = {}

    def target():
        try:
            result["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting thread
            result["error"] = exc

    thread = threading.Thread(target=target, name="plan-compile", daemon=True)
    start = time.perf_counter()
    _PROGRESS["compiling"] = f"{describe} for {topo}"
    thread.start()
    next_note = PROGRESS_EVERY
    while thread.is_alive():
        thread.join(timeout=0.5)
        elapsed = time.perf_counter() - start
        if thread.is_alive() and elapsed >= next_note:
            log.info("still compiling %s for %s: %.0f s", describe, topo, elapsed)
            next_note += PROGRESS_EVERY
    _PROGRESS["compiling"] = None
    if "error" in result:
        raise result["error"]
    return result["value"]


# What a plan in progress has done, for a stop by SIGINT/SIGTERM to report.
_PROGRESS: dict = {"compiling": None, "stages": None}


@contextlib.contextmanager
def _no_persistent_cache():
    """Planned programs are neither read from nor written to the compilation cache: they are for another
    machine (a TPU executable can be 170 MB), and a cache hit would hide the compile time being measured. JAX
    decides once per process whether the cache is used, so the decision is reset on the way in and out."""
    import jax
    from jax._src import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()
