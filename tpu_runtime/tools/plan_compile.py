"""Compiling one stage program for a TPU topology this machine does not have, and reading what the compiler says
about it: per-chip memory (``memory_analysis()``), the collectives and Mosaic kernels in the compiled HLO, the
compiler's cost estimate of one call (``cost_analysis()``, with the attention kernels it cannot see added from
their shapes: ``ProgramCost``), the compile time (with a "still compiling" line every ``PROGRESS_EVERY`` seconds).
``plan`` (``plan.py``) calls it for every program of a generation and every candidate mesh.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from .topology import GIB, Topology

log = logging.getLogger("tpu_runtime.tools.plan")

MOSAIC = "tpu_custom_call"  # a Pallas kernel lowered for TPU
_COLLECTIVES = {"all_reduces": "all-reduce", "all_gathers": "all-gather", "reduce_scatters": "reduce-scatter",
                "all_to_alls": "all-to-all", "collective_permutes": "collective-permute"}


@dataclass
class ProgramCost:
    """One call of a compiled program on one JAX device (a chip; on v7x one of a chip's two TensorCores), as the
    TPU compiler's cost model counts it, plus what that model cannot see, and the lower bound on seconds they give.

    The cost model treats a Mosaic kernel (splash attention) as an opaque custom call: measured with this JAX's
    libtpu, a program of one splash kernel reports no flops at all and only the bytes of the segment ids built
    beside it, not the kernel's queries, keys, values or output. The attention kernels' work is therefore added
    here from the operand shapes the compiled kernels take on a device (padded to the kernel's blocks, as the
    kernel computes them): ``2·Lq·Lk·(D + Dv)`` flops per batch element and head (``4·B·H·Lq·Lk·D`` when the
    value width is the key width), and their operands read and output written once (the least HBM traffic they
    can have), at the chip's published peak flops or bandwidth, whichever takes longer (``attention_seconds``).

    The rest is the compiler's (``compiler_seconds``): its ``optimal_seconds`` where that can be trusted, else
    its flops and bytes at the published peaks, whichever takes longer. ``optimal_seconds`` counts -1 s for each
    ``ConcatBitcast`` custom call the TPU compiler makes (a one-block Wan step with five came out at -4.9995 s),
    so it is used only for a program without custom calls other than Mosaic kernels. ``seconds``, the sum, is a
    lower bound on one call: not in it are collectives' time on the interconnect, the host, anything running
    below peak."""

    compiler_flops: float = 0.0
    compiler_bytes: float = 0.0
    compiler_transcendentals: float = 0.0
    compiler_optimal_seconds: float | None = None  # as the compiler reports it (None: not reported)
    custom_calls: dict[str, int] = field(default_factory=dict)  # other than Mosaic kernels, by target: count
    compiler_seconds: float = 0.0  # the compiler's part of the bound
    compiler_seconds_from: str = ""  # "optimal_seconds" or "flops and bytes at the published peaks"
    attention_kernels: int = 0
    attention_flops: float = 0.0  # added: the Mosaic attention kernels' work, from their shapes
    attention_bytes: float = 0.0
    attention_seconds: float = 0.0  # the added part of the bound
    other_kernels: int = 0  # Mosaic kernels that are not attention: their work is in no figure here
    loop_kernels: int = 0  # kernels inside a loop body: counted once, though they run once per iteration
    peak_flops: float = 0.0  # per device, bfloat16, published
    hbm_bytes_per_second: float = 0.0  # per device, published
    seconds: float = 0.0  # the lower bound on one call: compiler_seconds + attention_seconds

    @property
    def flops(self) -> float:
        return self.compiler_flops + self.attention_flops


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
    cost: ProgramCost | None = None  # one call's cost estimate (compiled programs only)


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


# --- the cost estimate -----------------------------------------------------------------------------------------
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8}
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\](?:\{[^}]*\})?")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\w+)\[([\d,]*)\]")


@dataclass(frozen=True)
class AttentionKernel:
    """One Mosaic attention kernel of a compiled program, by the shapes it takes on a device: queries
    ``[..., Lq, D]``, keys ``[..., Lk, D]``, values ``[..., Lk, Dv]`` (the leading axes: batch and heads)."""

    lead: int  # batch x heads on the device
    lq: int
    lk: int
    d: int
    dv: int
    itemsize: int

    @property
    def flops(self) -> int:
        return 2 * self.lead * self.lq * self.lk * (self.d + self.dv)

    @property
    def bytes(self) -> int:
        return self.itemsize * self.lead * (self.lq * self.d + self.lk * (self.d + self.dv) + self.lq * self.dv)


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 1 if dtype.startswith("f8") else 0)


def _operand_shapes(line: str, defined: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of a custom call's operands: from its operand layout constraints, else by the operands'
    names (their definitions in ``defined``)."""
    marker = "operand_layout_constraints={"
    start = line.find(marker)
    shapes = []
    if start >= 0:
        pos = start + len(marker)
        while (found := _SHAPE.match(line, pos)) is not None:
            shapes.append((found.group(1), tuple(int(n) for n in found.group(2).split(",") if n)))
            pos = found.end()
            if not line.startswith(", ", pos):
                break
            pos += 2
        return shapes
    operands = re.search(r"custom-call\(([^)]*)\)", re.sub(r"/\*.*?\*/", "", line))
    for operand in (operands.group(1).split(",") if operands else []):
        name = operand.strip().split(" ")[-1].lstrip("%")
        if name in defined:
            shapes.append(defined[name])
    return shapes


def _as_attention(shapes: list[tuple[str, tuple[int, ...]]]) -> AttentionKernel | None:
    """The kernel's queries, keys and values: its first three floating operands, if they are shaped as such."""
    floats = [(t, dims) for t, dims in shapes if _itemsize(t) and t.startswith(("bf", "f")) and len(dims) >= 2]
    if len(floats) < 3:
        return None
    (tq, q), (_, k), (_, v) = floats[:3]
    if not (q[:-2] == k[:-2] == v[:-2] and q[-1] == k[-1] and k[-2] == v[-2]):
        return None
    return AttentionKernel(int(np.prod(q[:-2], dtype=np.int64)), q[-2], k[-2], q[-1], v[-1], _itemsize(tq))


def mosaic_kernels(hlo: str) -> tuple[list[AttentionKernel], int, int]:
    """The attention kernels among a compiled program's Mosaic kernels, how many other Mosaic kernels it has, and
    how many kernels sit inside a loop body (each counted once, as ``count_ops`` counts them)."""
    defined, bodies, kernels = {}, set(), []
    computation, others, looped = "", 0, 0
    lines = hlo.splitlines()
    for line in lines:
        found = _DEFINITION.match(line)
        if found:
            defined[found.group(1)] = (found.group(2), tuple(int(n) for n in found.group(3).split(",") if n))
        bodies.update(re.findall(r"\bbody=%?([\w.\-]+)", line))
    for line in lines:
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
        if f'custom_call_target="{MOSAIC}"' not in line:
            continue
        looped += computation in bodies
        kernel = _as_attention(_operand_shapes(line, defined))
        if kernel is None:
            others += 1
        else:
            kernels.append(kernel)
    return kernels, others, looped


ROOFLINE = "flops and bytes at the published peaks"


def _roofline(flops: float, nbytes: float, topo: Topology) -> float:
    """The least time ``flops`` and ``nbytes`` of HBM traffic take on one device of ``topo`` at its peaks."""
    return max(flops / topo.peak_flops, nbytes / topo.hbm_bytes_per_second)


def program_cost(compiled, hlo: str, topo: Topology) -> ProgramCost | None:
    """``ProgramCost`` of a compiled program for ``topo``: the compiler's cost analysis and the attention kernels
    of ``hlo`` (its text); None when the compiler gives no cost analysis."""
    try:
        analysis = compiled.cost_analysis()
    except Exception as exc:  # noqa: BLE001 - a compiler without a cost model: the plan stands without it
        log.warning("no cost analysis for this program: %s", exc)
        return None
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis or not topo.peak_flops:  # no cost model, or a device without published peaks (a CPU)
        return None
    kernels, others, looped = mosaic_kernels(hlo)
    others_called = Counter(t for t in re.findall(r'custom_call_target="([^"]*)"', hlo) if t != MOSAIC)
    optimal = analysis.get("optimal_seconds")
    optimal = float(optimal) if optimal is not None else None
    cost = ProgramCost(
        compiler_flops=float(analysis.get("flops", 0.0)), compiler_bytes=float(analysis.get("bytes accessed", 0.0)),
        compiler_transcendentals=float(analysis.get("transcendentals", 0.0)), compiler_optimal_seconds=optimal,
        custom_calls=dict(sorted(others_called.items())), attention_kernels=len(kernels),
        attention_flops=float(sum(k.flops for k in kernels)), attention_bytes=float(sum(k.bytes for k in kernels)),
        other_kernels=others, loop_kernels=looped, peak_flops=topo.peak_flops,
        hbm_bytes_per_second=topo.hbm_bytes_per_second)
    if optimal is not None and np.isfinite(optimal) and optimal > 0 and not others_called:
        cost.compiler_seconds, cost.compiler_seconds_from = optimal, "optimal_seconds"
    else:
        cost.compiler_seconds = _roofline(cost.compiler_flops, cost.compiler_bytes, topo)
        cost.compiler_seconds_from = ROOFLINE
    cost.attention_seconds = _roofline(cost.attention_flops, cost.attention_bytes, topo)
    cost.seconds = cost.compiler_seconds + cost.attention_seconds
    return cost


@dataclass
class TimeBound:
    """A lower bound on a generation's sampling on the slice, from its step program's ``ProgramCost``: the step
    program runs ``calls_per_step`` times a step (once: a CFG batch, or several transformer calls, is inside it),
    every device in parallel, so a step takes at least its seconds on one device."""

    steps: int
    calls_per_step: int
    step_seconds: float
    compiler_seconds: float  # of step_seconds: the compiler's part
    compiler_seconds_from: str  # see ProgramCost
    attention_seconds: float  # of step_seconds: the attention kernels' work, added
    video_seconds: float  # the sampling loop alone: steps x calls x step_seconds
    peak_flops: float  # per device, as used
    hbm_bytes_per_second: float


def time_bound(step: StageReport | None, steps: int, calls_per_step: int = 1) -> TimeBound | None:
    """The ``TimeBound`` of ``steps`` sampling steps whose program ``step`` is (None when it has no cost)."""
    cost = step.cost if step is not None else None
    if cost is None:
        return None
    return TimeBound(steps, calls_per_step, cost.seconds, cost.compiler_seconds, cost.compiler_seconds_from,
                     cost.attention_seconds, steps * calls_per_step * cost.seconds, cost.peak_flops,
                     cost.hbm_bytes_per_second)


def format_costs(rows: list[tuple[str, StageReport]], unit: str, label_width: int = 12) -> list[str]:
    """Text lines of each compiled program's ``ProgramCost``: the compiler's part, the part added, the bound."""
    costed = [(label, r.cost) for label, r in rows if r.cost is not None]
    if not costed:
        return []
    label_width = max(label_width, *(len(label) + 1 for label, _ in costed))
    lines = [f"  one call's cost per {unit}: the TPU compiler's cost_analysis, + the Mosaic attention kernels' work "
             "(which it does not count) from their shapes:",
             f"  {'program':<{label_width}}{'compiler TFLOP':>15}{'GB':>8}{'s':>10}{'+ attention TFLOP':>19}"
             f"{'GB':>8}{'s':>10}{'kernels':>8}{'= bound s':>11}"]
    for label, c in costed:
        mark = " " if c.compiler_seconds_from == "optimal_seconds" else "*"
        lines.append(f"  {label:<{label_width}}{c.compiler_flops / 1e12:>15.3f}{c.compiler_bytes / 1e9:>8.2f}"
                     f"{c.compiler_seconds:>9.3g}{mark}{c.attention_flops / 1e12:>19.3f}"
                     f"{c.attention_bytes / 1e9:>8.2f}{c.attention_seconds:>10.3g}{c.attention_kernels:>8}"
                     f"{c.seconds:>11.3g}")
        if c.other_kernels or c.loop_kernels:
            lines.append(f"  {'':<{label_width}}{c.other_kernels} other Mosaic kernel(s), their work not counted; "
                         f"{c.loop_kernels} kernel(s) inside a loop, counted once")
    for label, c in costed:
        if c.compiler_seconds_from == "optimal_seconds":
            continue
        raw = c.compiler_optimal_seconds
        if raw is None:
            why = "the compiler gave no optimal_seconds"
        elif c.custom_calls:
            calls = ", ".join(f"{n} {target}" for target, n in c.custom_calls.items())
            why = (f"the compiler's optimal_seconds, {raw:.4g}, is not used: the program has custom calls its cost "
                   f"model does not cost ({calls}; it counts -1 s for each ConcatBitcast)")
        else:
            why = f"the compiler's optimal_seconds, {raw:.4g}, is no time"
        lines.append(f"  *{label}: {ROOFLINE}; {why}")
    return lines


def format_time_bound(bound: TimeBound | None, unit: str, why_none: str = "", step: str = "a step") -> str:
    """The lower bound on ``step`` and on a video's sampling, saying which part is the compiler's (without a
    bound: ``why_none``)."""
    if bound is None:
        return f"  time: {why_none}" if why_none else ""
    calls = f"{bound.calls_per_step} call{'s' if bound.calls_per_step > 1 else ''}"
    compiler = "its optimal_seconds" if bound.compiler_seconds_from == "optimal_seconds" else ROOFLINE
    return (f"  LOWER BOUND on time: {bound.step_seconds:.3g} s {step} = the compiler's part "
            f"{bound.compiler_seconds:.3g} ({compiler}) + the attention kernels' {bound.attention_seconds:.3g} "
            f"(added), at {bound.peak_flops / 1e12:.0f} TFLOP/s and {bound.hbm_bytes_per_second / 1e9:.0f} GB/s a "
            f"{unit} (published peaks);\n    {bound.steps} steps x {calls} = {bound.video_seconds:.3g} s for a "
            "video's sampling. Not in it: collectives on the interconnect, the host, anything below peak: a real "
            "run takes longer")


_COMPILED: dict[tuple, StageReport] = {}  # (topology, program text) -> report: identical programs compile once


def compile_program(program, topo: Topology, keep: list | None = None) -> StageReport:
    """Compile one ``StageProgram`` for its (TPU) mesh and read its memory and collectives. ``keep``: a list the
    compiled executable is appended to, with its program (``plan --save``; the program is then compiled even when an
    identical one was before)."""
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
        key, compiled = _in_background(lambda: _lower_and_compile(program, topo, lower, keep is None),
                                       program.describe, topo)
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
    hlo = compiled.as_text()
    for name, value in count_ops(hlo).items():
        setattr(report, name, value)
    report.cost = program_cost(compiled, hlo, topo)
    _COMPILED[key] = report
    if keep is not None:
        keep.append((program, compiled))
    return report


def _weights_alone(weights_bytes: int, topo: Topology) -> str:
    return (f"not compiled: its weights alone need {weights_bytes / GIB:.1f} GiB per chip, the chip has "
            f"{topo.hbm_bytes / GIB:.0f} GiB")


def _lower_and_compile(program, topo: Topology, lower, reuse: bool = True):
    """(key, executable) of ``program`` for ``topo``; the executable is None when an identical program (same text,
    same topology) was compiled before in this process (and ``reuse``)."""
    with program.scope():
        lowered = lower(program.fn, *program.example)
    key = (topo.name, hashlib.sha256(lowered.as_text().encode()).hexdigest())
    if reuse and key in _COMPILED:
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
