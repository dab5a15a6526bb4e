"""Know before renting: compile every stage of a generation for a TPU slice this machine does not have, and
report per-chip memory, collectives, compile time and whether it fits.

JAX compiles ahead of time for a TPU topology it cannot run on: ``jax.experimental.topologies`` describes the
slice's chips with the TPU compiler that ``jax[tpu]`` installs, a mesh over them takes the place of the real
devices, and the model family is opened *abstract* (``target_devices``): its components are built on ``meta``
and placed as shape structs with the shardings the runtime would give the weights. ``plan`` then compiles the very
stage programs the runtime runs (``plan_programs``: text encode, the sampler step, VAE decode), through the same
torchax tracing, attention override (splash/exp2 Mosaic kernels, since the mesh is a TPU mesh) and rule tables.

What it reports per stage comes from the compiler: ``memory_analysis()`` (arguments, outputs, temporaries per
chip), the compiled HLO (collectives, Mosaic kernels) and ``cost_analysis()`` (flops, bytes, the compiler's
optimal seconds of one call; the splash kernels, which it does not count, added from their shapes), which gives a
lower bound on the seconds of a step and of a video's sampling (``TimeBound``). Weights per chip are computed from
the parameter shapes and their shardings. Measured run times need real hardware.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engine.sharding import MeshSpec, _divisors, default_mesh, parse_mesh
from ..engine.stages import SampleSettings
from ..errors import InputError
from .plan_compile import (  # noqa: F401 (compile_program and the rest are plan's API too)
    MOSAIC,
    PROGRESS_EVERY,
    _PROGRESS,
    StageReport,
    TimeBound,
    _in_background,
    _no_persistent_cache,
    _weights_alone,
    compile_program,
    count_ops,
    format_costs,
    format_time_bound,
    shard_bytes,
    time_bound,
)
from .topology import _SLICE_SIZES, _TENSORCORE_NAMED, EXAMPLES, GIB, Topology, parse_topology  # noqa: F401

log = logging.getLogger(__name__)

STAGES = ("encode", "image", "sample", "decode")  # image: image-to-video models only; a family may add its own


# --- reports ---------------------------------------------------------------------------------------------------
@dataclass
class MeshReport:
    mesh: str
    fits: bool
    resident_weights_bytes_per_chip: int
    peak_bytes_per_chip: int
    stages: dict[str, StageReport] = field(default_factory=dict)
    why: str = ""  # what made it "does not fit", when it does not
    step_cache_bytes_per_chip: int = 0  # what a step cache keeps between steps (every transformer's)
    # every stage of a generation (planned or not): its components' weights per chip, {stage: {component: bytes}}
    stage_weights: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class PlanReport:
    model: str
    topology: str
    chips: int
    hosts: int
    chip_hbm_bytes: int
    height: int
    width: int
    frames: int
    cfg: bool
    dtype: str
    attention: str
    fsdp: bool
    vae_sharding: str
    layers: int | None
    mesh: str
    fits: bool
    peak_bytes_per_chip: int
    stages: dict[str, StageReport]
    devices_per_chip: int = 1  # v7x: 2 (its TensorCores are two JAX devices); every *_per_chip is then per device
    resident_weights_bytes_per_chip: int = 0
    why: str = ""
    step_cache: str = "none"
    step_cache_bytes_per_chip: int = 0
    sampling: dict = field(default_factory=dict)  # the release's own sampling settings it was planned with
    stage_weights: dict[str, dict[str, int]] = field(default_factory=dict)  # see MeshReport
    candidates: list[dict] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    seconds: float = 0.0
    host_peak_rss_bytes: int = 0
    steps: int = 0  # the sampling steps planned (the settings'), for the time bound
    time_bound: TimeBound | None = None  # a lower bound on a step and a video's sampling (None: see time_note)
    time_note: str = ""
    saved: list[str] = field(default_factory=list)  # plan --save: the program files written for the chosen mesh

    def to_json(self) -> dict:
        return asdict(self)


# --- opening the model abstractly ------------------------------------------------------------------------------
@dataclass
class ModelSource:
    """What to plan: a known architecture's name, a diffusers folder, or single files (role -> path)."""

    model: str | None = None
    files: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.model or Path(next(iter(self.files.values()))).name


def open_abstract(source: ModelSource, devices, workdir: Path, *, mesh=None, dtype: str = "bfloat16",
                  attention=None, fsdp: bool = False, vae_sharding: str = "auto", layers: int | None = None):
    """The model family of ``source`` opened for ``devices`` without reading any weight (``layers``: the
    transformer at that depth)."""
    from ..families import registry

    options = dict(dtype=dtype, mesh=mesh, attention=attention, fsdp=fsdp, vae_sharding=vae_sharding,
                   target_devices=devices, layers=layers)
    if source.model is None:
        return registry.open_model(files=source.files, **options)
    path = Path(source.model).expanduser()
    if not path.exists():
        if source.model.lower() not in registry.architectures():
            raise InputError(f"--model {source.model!r} is neither a folder nor a known model: use a diffusers "
                             f"folder or one of {', '.join(registry.known_models())}")
        path = registry.write_architecture(source.model, workdir)
    return registry.open_model(str(path), **options)


def release_sampling(source: ModelSource) -> dict:
    """The sampling settings of a known model named by ``source`` (a distilled release's; empty for a folder)."""
    from ..families import registry

    if source.model is None or Path(source.model).expanduser().exists():
        return {}
    return registry.architecture_sampling(source.model)


def candidate_meshes(chips: int, heads: int, cfg: bool, fsdp: bool = False) -> list[MeshSpec]:
    """The default mesh first, then all-tp and (with CFG) the other dp/tp splits the heads allow; with ``fsdp``
    only meshes with dp (FSDP splits the weights over it)."""
    meshes = [default_mesh(chips, heads, cfg)]
    for dp in ([2] if fsdp else [2, 1]) if cfg and chips % 2 == 0 else [1]:
        rest = chips // dp
        for tp in sorted((d for d in _divisors(rest) if heads % d == 0), reverse=True)[:2]:
            spec = MeshSpec(dp=dp, sp=rest // tp, tp=tp)
            if spec not in meshes:
                meshes.append(spec)
    return meshes


# --- the plan --------------------------------------------------------------------------------------------------
def plan(source: ModelSource, topology: str | Topology, *, height: int | None = None, width: int | None = None,
         frames: int | None = None, guidance: float | None = None, steps: int | None = None, mesh=None,
         dtype: str = "bfloat16", attention=None, fsdp: bool = False, vae_sharding: str = "auto",
         stages=STAGES, layers: int | None = None, max_candidates: int = 3, every_stage: bool = False,
         cache: str = "none", save: str | None = None) -> PlanReport:
    """Compile ``stages`` of one generation for ``topology`` and report per-chip memory and what fits (the
    stages every family has, and the family's own).

    With no ``mesh``, up to ``max_candidates`` meshes are compiled and the fitting one with the least per-chip
    memory is chosen. Bad input raises ``InputError`` before anything compiles. Once a mesh's answer is "does not
    fit", its other stages are not compiled unless ``every_stage``. ``cache`` ("magcache", "first-block"): the
    sampler's programs are a step-cached run's, and what its cache keeps between steps counts with the weights.
    A known model released with its own sampling settings (a distilled one: one pass a step) is planned with them;
    ``guidance`` and ``steps`` given here replace theirs. ``save``: a folder the chosen mesh's compiled programs are
    saved in, as a server on that slice loads them (``TPU_VIDEO_PROGRAMS``; see ``engine/program_store.py``).
    """
    from ..engine.stages import METHODS

    from ..engine.runtime import get_runtime

    start = time.perf_counter()
    topo = topology if isinstance(topology, Topology) else parse_topology(topology)
    if not stages:
        raise InputError(f"stages none: choose from {', '.join(STAGES)}")
    if cache not in METHODS:
        raise InputError(f"cache {cache!r}: choose from {', '.join(METHODS)}")
    devices = topo.devices()
    get_runtime(accelerator=False)  # torchax and the attention override; compiles for the topology, runs nothing
    with tempfile.TemporaryDirectory() as work:
        def opened(on_mesh):
            return open_abstract(source, devices, Path(work), mesh=on_mesh, dtype=dtype, attention=attention,
                                 fsdp=fsdp, vae_sharding=vae_sharding, layers=layers)

        base = opened(mesh)
        known = STAGES + base.SPEC.stages
        unknown = sorted(set(stages) - set(known))
        if unknown:
            raise InputError(f"stages {unknown}: choose from {', '.join(known)}")
        settings = planned_settings(base, source, height, width, frames, guidance, steps)
        cfg = base.uses_cfg(settings)
        if parse_mesh(mesh) is None and not cfg and base.mesh_spec != default_mesh(len(devices), base.heads, cfg):
            base = opened(default_mesh(len(devices), base.heads, cfg))
        base.plan_programs(settings)  # every input checked (sizes, mesh vs CFG) before anything compiles
        if parse_mesh(mesh) is not None:
            meshes = [base.mesh_spec]
        else:
            meshes = candidate_meshes(len(devices), base.heads, cfg, fsdp)[:max_candidates]
        results, savers = [], {}
        with _no_persistent_cache():
            for spec in meshes:
                family = base if spec == base.mesh_spec else opened(spec)
                saver = ProgramSaver(family, Path(save), topo) if save else None
                results.append(_plan_mesh(family, settings, stages, topo, every_stage, cache, saver))
                savers[results[-1].mesh] = saver
        fitting = [r for r in results if r.fits]
        chosen = min(fitting or results, key=lambda r: r.peak_bytes_per_chip)
        saved = [s.finish(keep=mesh == chosen.mesh) for mesh, s in savers.items() if s is not None]
        report = PlanReport(
            model=source.label, topology=topo.name, chips=topo.chips, hosts=topo.hosts, chip_hbm_bytes=topo.hbm_bytes,
            devices_per_chip=topo.devices_per_chip,
            height=settings.height, width=settings.width, frames=settings.num_frames, cfg=cfg, dtype=base.dtype_name,
            sampling={k: getattr(settings, k) for k in release_sampling(source)},
            attention=base.attention.impl + (" (exp2)" if base.attention.exp2 else ""), fsdp=fsdp,
            vae_sharding=base.vae_sharding, layers=layers, mesh=chosen.mesh, fits=chosen.fits,
            peak_bytes_per_chip=chosen.peak_bytes_per_chip, stages=chosen.stages,
            resident_weights_bytes_per_chip=chosen.resident_weights_bytes_per_chip, why=chosen.why,
            step_cache=cache, step_cache_bytes_per_chip=chosen.step_cache_bytes_per_chip,
            stage_weights=chosen.stage_weights, candidates=[{"mesh": r.mesh, "fits": r.fits, "peak_bytes_per_chip": r.peak_bytes_per_chip}
                        for r in results],
        )
        report.steps = settings.steps
        report.saved = [path for paths in saved for path in paths]
        report.time_bound, report.time_note = sampling_bound(chosen.stages, settings.steps, cache)
        if not report.fits:
            report.suggestions = suggestions(source, base, chosen, topo, layers, stages, cfg)
    report.seconds = round(time.perf_counter() - start, 1)
    report.host_peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


def sampling_bound(stages: dict[str, StageReport], steps: int, cache: str) -> tuple[TimeBound | None, str]:
    """The lower bound on a video's sampling from the step program's cost (one call a step: its CFG batch inside),
    or why there is none."""
    if cache != "none":
        return None, (f"no bound for a video's sampling with the step cache {cache}: the steps it skips decide it "
                      "(each program's bound is above)")
    step = stages.get("sample")
    if step is None:
        return None, "no bound: the sampler step was not planned (--stages)"
    if step.cost is None:
        return None, "no bound: the sampler step " + ("was not compiled" if not step.compiled else "has no cost "
                                                      "analysis from this compiler")
    return time_bound(step, steps), ""


def planned_settings(family, source: ModelSource, height=None, width=None, frames=None, guidance=None,
                     steps=None) -> SampleSettings:
    """The settings a plan compiles for: the sizes given, else the model's native ones; ``guidance`` and
    ``steps`` given, else the release's own (a distilled model's), else the family's defaults; every other setting
    the release's or the model's default."""
    nh, nw, nf = family.native_size()
    sampling = release_sampling(source)
    if guidance is not None:
        sampling["guidance"] = float(guidance)
    if steps is not None:
        sampling["steps"] = steps
    sampling.setdefault("guidance", family.DEFAULT_GUIDANCE)
    sampling.setdefault("steps", family.DEFAULT_STEPS)
    return SampleSettings(height or nh, width or nw, frames or nf, **sampling)


def _with_step_cache(family, programs: list, method: str, cfg: bool) -> tuple[list, int, dict]:
    """``programs`` with the sampler's replaced by a step-cached run's (MagCache: full and skipping steps;
    FirstBlockCache: the first block, the rest, skipping), the bytes per chip its cache keeps between steps (one
    set per transformer: Wan 2.2's experts keep theirs), and each cached program's share of that in its inputs."""
    import jax

    from ..engine.stepcache import step_cache_programs

    out, held, inputs = [], 0, {}
    for program in programs:
        if program.stage != "sample":
            out.append(program)
            continue
        cached = step_cache_programs(family, method, program, cfg)
        kept = ("residual",) if method == "magcache" else ("first_residual", "rest_residual")
        carry = {k: v for k, v in cached["mag_skip" if method == "magcache" else "fbc_rest"].example[-1].items()
                 if k in kept}
        one = shard_bytes(dict(enumerate(jax.tree_util.tree_leaves(carry))))
        held = one * len(program.components)
        for p in cached.values():
            out.append(p)
            inputs[p.name] = min(one, shard_bytes(dict(enumerate(jax.tree_util.tree_leaves(p.example[-1])))))
    return out, held, inputs


class ProgramSaver:
    """``plan --save``: each program compiled for one candidate mesh, saved at once (a TPU executable can be hundreds
    of megabytes: none is held) into a staging folder; ``finish`` moves the chosen mesh's into the folder and drops
    the others'."""

    def __init__(self, family, folder: Path, topo: Topology):
        self.family, self.folder, self.topo = family, folder, topo
        self.staging = folder / f".plan-{os.getpid()}-{id(self)}"
        self.paths: list[Path] = []

    def __call__(self, program, executable) -> None:
        from ..engine.program_key import complete
        from ..engine.program_store import ProgramStore
        from ..engine.runtime import export_stablehlo

        key = self.family.saved_key(program)
        if key is None:
            log.warning("%s is not saved: its key holds an object another process cannot recognise",
                        program.describe)
            return

        def export():
            with program.scope():
                return export_stablehlo(program.fn, program.example)

        path = ProgramStore(None).save(complete(key, program.example), f"{program.describe} ({self.topo.name})",
                                       executable, export=export, folder=self.staging)
        if path is not None:
            self.paths.append(path)

    def finish(self, keep: bool) -> list[str]:
        """Move the staged programs into the folder (``keep``) or drop them; the files kept."""
        import shutil

        kept = []
        for path in self.paths:
            if keep:
                target = self.folder / path.name
                os.replace(path, target)
                kept.append(str(target))
        shutil.rmtree(self.staging, ignore_errors=True)
        return kept


def _plan_mesh(family, settings: SampleSettings, stages, topo: Topology, every_stage: bool = False,
               cache: str = "none", saver: ProgramSaver | None = None) -> MeshReport:
    """Compile the stages' programs on ``family``'s mesh. Once the answer is "does not fit" (the resident weights
    alone exceed a chip, or a stage did not compile, or does not fit beside them) the rest are not compiled:
    their compiles cannot change the verdict and may take many minutes. ``every_stage`` compiles them anyway.
    With a step ``cache``, its residuals stay on the chips between steps like the weights (counted with them)."""
    every = family.plan_programs(settings)
    held, cache_inputs = 0, {}
    if cache != "none":
        every, held, cache_inputs = _with_step_cache(family, every, cache, family.uses_cfg(settings))
    programs = [p for stage in stages for p in every if p.stage == stage]
    components = sorted({c for p in every for c in p.components})
    # a program names every component it takes turns with (a two-expert model's second expert)
    weights = {c: shard_bytes(family.state(c)) for c in components}
    report = MeshReport(str(family.mesh_spec), False, sum(weights.values()) + held, 0, step_cache_bytes_per_chip=held,
                        stage_weights=stage_weights(family, every))
    _PROGRESS["stages"] = report.stages
    verdict = None
    if report.resident_weights_bytes_per_chip > topo.hbm_bytes:
        verdict = (f"the weights resident on every chip alone need {report.resident_weights_bytes_per_chip / GIB:.1f}"
                   f" GiB, the chip has {topo.hbm_bytes / GIB:.0f} GiB")
        if held:
            verdict += f" (with the step cache's {held / GIB:.2f} GiB)"
    for program in programs:  # a stage may have several (a streamed decode's first and later chunks)
        if verdict and not every_stage:
            own = shard_bytes(program.example[0])
            report.stages[program.name] = StageReport(
                compiled=False, skipped=True, describe=program.describe, weights_bytes_per_chip=own,
                error=_weights_alone(own, topo) if own > topo.hbm_bytes else None)
            continue
        log.info("compiling %s for %s, mesh %s", program.describe, topo, family.mesh_spec)
        # The program receives one component's weights (Wan 2.2's experts take turns with the same program).
        kept = [] if saver is not None else None
        stage = report.stages[program.name] = compile_program(program, topo, kept)
        for saved_program, executable in kept or ():
            saver(saved_program, executable)
        needs = report.resident_weights_bytes_per_chip + _beside(stage, cache_inputs.get(program.name, 0))
        if not stage.compiled:
            verdict = verdict or f"{program.name} did not compile"
        elif needs > topo.hbm_bytes:
            verdict = verdict or f"{program.name} needs {needs / GIB:.1f} GiB beside the resident weights"
    # Every component stays on the devices between stages; each stage adds its inputs, outputs and temporaries.
    extra = [_beside(r, cache_inputs.get(name, 0)) for name, r in report.stages.items()]
    report.peak_bytes_per_chip = report.resident_weights_bytes_per_chip + max(extra, default=0)
    report.fits = all(r.compiled for r in report.stages.values()) and report.peak_bytes_per_chip <= topo.hbm_bytes
    report.why = verdict or ""
    return report


def stage_weights(family, programs) -> dict[str, dict[str, int]]:
    """Every program's components' weights per chip, ``{program name: {component: bytes}}``, from the shapes and
    shardings alone (nothing compiled)."""
    out = {}
    for program in programs:
        out[program.name] = {c: shard_bytes(family.state(c)) for c in program.components}
    return out


def _beside(stage: StageReport, resident_inputs: int = 0) -> int:
    """What a stage needs beside what stays on the chips (the weights, and a step cache's residuals, which a
    cached program also takes as an input)."""
    return max(0, stage.total_bytes_per_chip - stage.weights_bytes_per_chip - resident_inputs)


def suggestions(source: ModelSource, family, report: MeshReport, topo: Topology, layers, stages,
                cfg: bool = True) -> list[str]:
    """What would fit instead, estimated from the weights' shardings and the activations just compiled (``cfg``:
    the plan samples with the CFG batch, which a larger slice's mesh puts on dp; without it dp stays 1)."""
    from ..engine.runtime import get_runtime

    runtime = get_runtime()
    hbm = topo.hbm_bytes
    names = sorted({c for p in family.plan_programs(_settings_of(family)) for c in p.components})
    activations = max((_activation_bytes(r) for r in report.stages.values()), default=0)
    out = []
    if any(r.error and "ScopedVmem" in r.error for r in report.stages.values()):
        # A kernel's blocks, not the chip's HBM: narrower splash blocks are the fix, not more chips.
        a = family.attention
        out.append(f"smaller splash blocks: --block-q {max(128, a.block_q // 2 // 128 * 128)} --block-kv "
                   f"{max(a.block_kv_compute, a.block_kv // 2 // a.block_kv_compute * a.block_kv_compute)} (an "
                   "attention kernel ran out of the chip core's scoped VMEM)")
    decodes = [r for name, r in report.stages.items() if name.startswith("decode")]
    others = [r for name, r in report.stages.items() if not name.startswith("decode")]

    def extra(stages) -> int:
        return max((_activation_bytes(r) for r in stages), default=0)

    # The decode is short of memory alone, or beside the resident weights when it is the largest stage (the
    # Wan VAE at 720x1280 beside A14B's two experts).
    decode_alone = any(_out_of_hbm(r) or r.total_bytes_per_chip > hbm for r in decodes)
    decode_short = decode_alone or (
        extra(decodes) > extra(others) and report.resident_weights_bytes_per_chip + extra(decodes) > hbm)
    if decode_short and family.vae_sharding == "replicated" and family.mesh_spec.devices > 1:
        out.append("--vae-sharding width: splits the decode's activations over every chip")
        if all(r.compiled and r.total_bytes_per_chip <= hbm for r in others) \
                and report.resident_weights_bytes_per_chip + extra(others) <= hbm:
            return out  # only the decode is short of memory, and the split is the first thing to try
    # The decode already split (or one chip) and still short: fewer resident weights (FSDP) or more chips to
    # split it over (a larger slice, the decode's activations scaled by the chip count) are what is left.

    def weights_for(mesh_spec: MeshSpec, fsdp: bool, devices) -> int:
        mesh = runtime.make_mesh(mesh_spec, devices)
        return sum(shard_bytes(runtime.abstract_state(family.component(n), mesh, family.rules_for(n),
                                                      fsdp and n not in family.FSDP_SKIPS))
                   for n in names)

    # FSDP leaves the VAE whole: it cannot help a decode that does not fit a chip by itself.
    if family.mesh_spec.dp > 1 and not family.fsdp and not decode_alone:
        with_fsdp = weights_for(family.mesh_spec, True, family.devices) + activations
        if with_fsdp <= hbm:
            out.append(f"--fsdp on this slice: about {with_fsdp / GIB:.1f} GiB per chip (weights split over dp too; "
                       "gathered before use)")
    # Without a compiled stage (the weights alone were too large to try) the activations are unknown: leave a
    # quarter of the chip for them. (Wan 14B on v5e-1: v5e-8's weights, 13.3 GiB, looked like a fit; compiled, its
    # step's activations took it to 17.3 GiB.)
    measured = any(r.compiled or _needed_bytes(r) for r in report.stages.values())
    margin = 0.9 if measured else 0.75
    for chips in _SLICE_SIZES.get(topo.kind, ()):
        if chips <= topo.chips:
            continue
        bigger = parse_topology(f"{topo.kind}-{chips * (2 if topo.kind in _TENSORCORE_NAMED else 1)}")
        try:
            devices = bigger.devices()
        except InputError:
            continue
        spec = default_mesh(bigger.device_count, family.heads, cfg)
        estimate = weights_for(spec, family.fsdp, devices) + activations * topo.device_count // bigger.device_count
        if estimate <= margin * hbm:
            out.append(f"a larger slice: {bigger.name} with mesh {spec}, about {estimate / GIB:.1f} GiB per chip "
                       f"({'estimate' if measured else 'weights alone'}; confirm with plan --topology {bigger.name})")
            break
    if family.dtype_name == "float32":
        out.append("--dtype bfloat16 halves the weights")
    if not out:
        out.append("nothing on this slice kind fits by the estimate: use a chip with more HBM (v5p has 95 GiB)")
    return out


def _out_of_hbm(stage: StageReport) -> bool:
    return bool(stage.error) and "RESOURCE_EXHAUSTED" in stage.error


_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}


def _needed_bytes(stage: StageReport) -> int:
    """What a program the compiler refused for want of HBM said it needs per chip (its temporaries, or what it
    had used when it stopped: a lower bound); 0 when the error says neither."""
    if not _out_of_hbm(stage):
        return 0
    found = re.search(r"required for HLO temporaries \(([\d.]+)([KMG])\)", stage.error) or \
        re.search(r"Used ([\d.]+)([KMG]) of [\d.]+[KMG] hbm", stage.error)
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else 0


def _activation_bytes(stage: StageReport) -> int:
    """A stage's own bytes beyond its weights: compiled, from the compiler's analysis; refused for want of HBM,
    what the compiler said it needed."""
    if stage.compiled:
        return max(0, stage.total_bytes_per_chip - stage.weights_bytes_per_chip)
    return _needed_bytes(stage)


def _settings_of(family) -> SampleSettings:
    h, w, f = family.native_size()
    return SampleSettings(h, w, f, steps=family.DEFAULT_STEPS, guidance=family.DEFAULT_GUIDANCE)


# --- printing --------------------------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def format_report(r: PlanReport) -> str:
    depth = f", {r.layers} transformer layer(s) (reduced depth)" if r.layers else ""
    # A v7x chip's two TensorCores are two JAX devices, each with half the chip's HBM: memory is per device.
    unit = "device" if r.devices_per_chip > 1 else "chip"
    hardware = f"{r.chips} chip(s), {r.hosts} host(s), {_gib(r.chip_hbm_bytes)} GiB HBM per chip"
    if r.devices_per_chip > 1:
        hardware = (f"{r.chips} chip(s) = {r.chips * r.devices_per_chip} devices ({r.devices_per_chip} TensorCores "
                    f"a chip), {r.hosts} host(s), {_gib(r.chip_hbm_bytes * r.devices_per_chip)} GiB HBM per chip "
                    f"= {_gib(r.chip_hbm_bytes)} GiB per device")
    lines = [
        f"plan: {r.model} at {r.width}x{r.height}x{r.frames} ({'CFG' if r.cfg else 'no CFG'}, {r.dtype}, "
        f"{r.attention} attention{depth})",
        f"  on {r.topology}: {hardware}; mesh {r.mesh}{', FSDP' if r.fsdp else ''}, VAE {r.vae_sharding}",
    ]
    if r.sampling:
        values = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.sampling.items())
        lines.append(f"  sampling (the release's settings; --guidance, --steps replace them): {values}")
    lines += [
        f"  {'stage':<12}{'compiled':>9}{'weights':>9}{'temp':>8}{'total':>8} (GiB/{unit})"
        f"{'all-red':>9}{'all-gat':>9}{'mosaic':>8}{'compile s':>11}",
    ]
    for name, s in r.stages.items():
        state = "yes" if s.compiled else "skipped" if s.skipped else "NO"
        lines.append(f"  {name:<12}{state:>9}{_gib(s.weights_bytes_per_chip):>9}"
                     f"{_gib(s.temp_bytes_per_chip):>8}{_gib(s.total_bytes_per_chip):>8}           "
                     f"{s.all_reduces:>9}{s.all_gathers:>9}{s.mosaic_kernels:>8}{s.compile_seconds:>11.1f}")
        if s.error:
            lines.append(f"           {s.error}")
    if r.stage_weights:
        parts = []
        for name, components in r.stage_weights.items():
            detail = f" ({', '.join(f'{c} {_gib(b)}' for c, b in components.items())})" if len(components) > 1 else ""
            parts.append(f"{name} {_gib(sum(components.values()))}{detail}")
        lines.append(f"  weights per {unit} by stage, GiB (every stage's, planned or not; all stay resident): "
                     f"{'; '.join(parts)}")
    if len(r.candidates) > 1:
        tried = "; ".join(f"{c['mesh']}: {_gib(c['peak_bytes_per_chip'])} GiB"
                          f"{'' if c['fits'] else ' (does not fit)'}" for c in r.candidates)
        lines.append(f"  meshes tried: {tried}")
    if r.step_cache != "none":
        lines.append(f"  step cache {r.step_cache}: its residuals stay on the chips between steps, "
                     f"{_gib(r.step_cache_bytes_per_chip)} GiB per {unit} (every transformer's), counted with the "
                     "weights")
    lines += format_costs(list(r.stages.items()), unit)
    bound = format_time_bound(r.time_bound, unit, r.time_note)
    if bound:
        lines.append(bound)
    verdict = "FITS" if r.fits else "DOES NOT FIT"
    failed = [name for name, s in r.stages.items() if not s.compiled and not s.skipped]
    skipped = [name for name, s in r.stages.items() if s.skipped]
    per_chip = ""
    if r.devices_per_chip > 1:
        per_chip = f"; {_gib(r.peak_bytes_per_chip * r.devices_per_chip)} GiB per chip"
    if skipped:
        lines.append(f"  verdict: {verdict}: {r.why}; so {', '.join(skipped)} {'was' if len(skipped) == 1 else 'were'}"
                     " not compiled (plan --every-stage compiles every stage anyway)")
    elif failed:
        lines.append(f"  verdict: {verdict}: {', '.join(failed)} did not compile (above); all weights resident "
                     f"{_gib(r.resident_weights_bytes_per_chip)} of {_gib(r.chip_hbm_bytes)} GiB per {unit}")
    else:
        resident = "all weights resident"
        if r.step_cache_bytes_per_chip:
            resident = "all weights and the step cache resident"
        lines.append(f"  verdict: {verdict}: peak {_gib(r.peak_bytes_per_chip)} of {_gib(r.chip_hbm_bytes)} GiB per "
                     f"{unit} ({resident}, {_gib(r.resident_weights_bytes_per_chip)} GiB, + the largest "
                     f"stage's activations{per_chip})")
    for s in r.suggestions:
        lines.append(f"  try: {s}")
    if r.saved:
        folder = Path(r.saved[0]).parent
        lines.append(f"  saved {len(r.saved)} compiled program(s) for mesh {r.mesh} in {folder}: a server on "
                     f"{r.topology} given TPU_VIDEO_PROGRAMS={folder} (or --programs) loads them and compiles nothing "
                     "for these sizes")
    lines.append(f"  planned in {r.seconds:.0f} s on this machine (peak host memory "
                 f"{r.host_peak_rss_bytes / GIB:.1f} GiB); measured run times need the real slice")
    return "\n".join(lines)


def add_args(parser) -> None:
    from ..families import registry
    from .options import add_file_args

    parser.add_argument("--model", help="a diffusers folder or a known model (a comma list plans each): "
                        + ", ".join(registry.known_models()))
    add_file_args(parser)
    parser.add_argument("--topology", required=True, help="TPU slice(s), comma list: " + ", ".join(EXAMPLES)
                        + ", ... (v5p and v7x by TensorCores: v7x-8 is 4 chips), or a chip layout such as v6e:2x4; "
                        "cpu or cpu-N: this machine's CPU devices (with --save: programs for a CPU server)")
    parser.add_argument("--height", type=int, help="default: the model's native size")
    parser.add_argument("--width", type=int, help="default: the model's native size")
    parser.add_argument("--frames", type=int, help="default: the model's native length")
    parser.add_argument("--guidance", type=float, help="CFG scale; 1 or less plans without CFG (batch 1); "
                        "default: the model's")
    parser.add_argument("--steps", type=int, help="sampling steps (the scheduler's plan); default: the release's "
                        "(a distilled model's 8), else the family's ("
                        + ", ".join(f"{s.display_name} {s.sampling.steps}" for s in registry.FAMILIES)
                        + "); with --comfy-model ComfyUI's KSampler default, 20. The time bound is for these steps")
    parser.add_argument("--mesh", help="dp=N,sp=N,tp=N; default: try candidate meshes and pick the smallest fit")
    parser.add_argument("--candidates", type=int, default=3, help="how many meshes to try without --mesh (1: the "
                        "default mesh only)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the weights' dtype")
    parser.add_argument("--attention", default="auto", choices=["auto", "splash", "blockwise", "reference"],
                        help="auto: splash (the TPU kernel)")
    parser.add_argument("--block-q", type=int, default=3328, help="splash query block")
    parser.add_argument("--block-kv", type=int, default=2816, help="splash key/value block")
    parser.add_argument("--block-kv-compute", type=int, default=256, help="splash key/value compute block")
    parser.add_argument("--exp2", action="store_true", help="splash in base-2 form (exp2 kernel)")
    parser.add_argument("--fsdp", action="store_true", help="also split every weight matrix over dp")
    parser.add_argument("--vae-sharding", default="auto", choices=["auto", "width", "replicated"],
                        help="the decode's layout (auto: width on more than one chip)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma list of encode,image,sample,decode "
                        "(image: image-to-video models) and a family's own stages")
    parser.add_argument("--every-stage", action="store_true", help="compile every stage even once the verdict is "
                        "\"does not fit\" (by default the rest are skipped: their compiles cannot change it)")
    parser.add_argument("--cache", choices=["none", "magcache", "first-block"], default="none",
                        help="plan a step-cached run: its skipping programs, and the residuals it keeps on the chips "
                        "between steps counted with the weights")
    parser.add_argument("--layers", type=int, help="compile the transformer with this many layers (a quick check; "
                        "reported as reduced depth)")
    parser.add_argument("--json", help="also write the report as JSON to this file")
    parser.add_argument("--save", metavar="DIR", help="save the chosen mesh's compiled programs in DIR, as a server "
                        "on the slice loads them (TPU_VIDEO_PROGRAMS=DIR, or generate --programs DIR): it then "
                        "traces and compiles nothing for these sizes. The server must run the same jax, jaxlib, "
                        "libtpu, torch and this package")
    parser.add_argument("--comfy-model", help="plan ComfyUI's own model class as TPU Diffusion Model runs it "
                        "(the native bridge) instead of --model, with the text encoder and VAE its graphs load (Wan: "
                        "umT5-XXL and the Wan VAE, as TPU Text Encoder and TPU VAE run them; --stages encode,sample,"
                        "decode picks): "
                        + ", ".join(_native_names()))
    parser.add_argument("--comfy", metavar="COMFYUI_DIR", help="the ComfyUI folder whose model classes "
                        "--comfy-model compiles")
    parser.add_argument("--no-compare", action="store_true", help="with --comfy-model: do not plan our own "
                        "family's step of the same model beside it")
    parser.add_argument("--comfy-weights", choices=["bf16", "fp8", "int8", "nvfp4", "mxfp8"], default="bf16",
                        help="with --comfy-model: the diffusion model's and the text encoder's weights as a released "
                        "file of this format holds them (quantized files: their blocks' linear layers packed, "
                        "dequantized inside the program)")


def _native_names() -> list[str]:
    from ..bridge.architectures import ARCHITECTURES

    return list(ARCHITECTURES)


class PlanStopped(BaseException):
    """SIGINT or SIGTERM arrived while planning (a BaseException, like KeyboardInterrupt: no handler of compile
    errors may take it for one)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run(args) -> int:
    """Plan every model × topology given (comma lists); identical programs compile once per topology. SIGINT and
    SIGTERM stop it cleanly: the plans finished are printed already, the one in progress is reported as far as
    it got, and the process exits at once (128 + the signal) without waiting for the compiler."""
    import signal

    from ..engine.attention import AttentionConfig
    from ..engine.validation import check_number
    from .options import file_args

    for name, value in (("--height", args.height), ("--width", args.width), ("--frames", args.frames)):
        check_number(name, value, minimum=1, integer=True, optional=True)
    check_number("--steps", args.steps, minimum=1, integer=True, optional=True)
    check_number("--candidates", args.candidates, minimum=1, integer=True)
    check_number("--guidance", args.guidance, minimum=0.0, optional=True)
    check_number("--layers", args.layers, minimum=1, integer=True, optional=True)
    attention = AttentionConfig(impl=args.attention, block_q=args.block_q, block_kv=args.block_kv,
                                block_kv_compute=args.block_kv_compute, exp2=args.exp2)
    models = [m.strip() for m in args.model.split(",")] if args.model else [None]
    topologies = [parse_topology(t) for t in args.topology.split(",")]  # all checked before anything compiles

    def stop(signum, frame):
        raise PlanStopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    reports = []
    try:
        for topology in topologies:
            for model in models:
                source = ModelSource(model, file_args(args))
                report = plan(source, topology, height=args.height, width=args.width, frames=args.frames,
                              guidance=args.guidance, steps=args.steps, mesh=args.mesh, dtype=args.dtype,
                              attention=attention, fsdp=args.fsdp, vae_sharding=args.vae_sharding,
                              stages=tuple(s.strip() for s in args.stages.split(",") if s.strip()),
                              layers=args.layers, max_candidates=args.candidates, every_stage=args.every_stage,
                              cache=args.cache, save=args.save)
                print(format_report(report), flush=True)
                reports.append(report.to_json())
                if args.json:  # rewritten after every plan: a long table run keeps what it has so far
                    data = reports[0] if len(models) * len(topologies) == 1 else reports
                    Path(args.json).write_text(json.dumps(data, indent=2))
    except PlanStopped as stopped:
        name = signal.Signals(stopped.signum).name
        done = {n: ("compiled" if s.compiled else "not compiled") for n, s in (_PROGRESS["stages"] or {}).items()}
        print(f"\nplan stopped by {name}: {len(reports)} plan(s) finished (above)"
              + (f"; the one in progress had {', '.join(f'{n} {v}' for n, v in done.items())}" if done else "")
              + (f"; it was compiling {_PROGRESS['compiling']}" if _PROGRESS["compiling"] else ""), flush=True)
        sys.stderr.flush()
        os._exit(128 + stopped.signum)  # the compiler's thread may be mid-compile: do not wait for it
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0 if all(r["fits"] for r in reports) else 3
