"""``plan --comfy-model``: ComfyUI's own model class compiled for a TPU slice through the native bridge, as TPU
Diffusion Model runs it, and reported per chip as ``plan`` reports our families.

The model is ComfyUI's class at its released size, built on ``meta`` (``bridge/architectures.py``); its weights
are placed as shape structs by the bridge's rule tables (``bridge/rules.py``), the step is the very program the
bridge compiles (``BridgedModule.program_function``: ComfyUI's ``_forward`` traced through torchax with the
runtime's attention, splash on a TPU mesh), for the call a sampler makes with CFG (cond and uncond in one batch).
When our own family has the same model, its step is planned on the same mesh and printed beside it. Each program's
cost estimate (``ProgramCost``) gives a lower bound on a step and on a video's sampling (``steps`` calls of the
step, the CFG batch inside each; ComfyUI's KSampler default of 20 steps unless given). With the
``encode`` and ``decode`` stages, the text encoder and the VAE the model's graphs load (umT5-XXL and the Wan VAE for
Wan) are planned too, as TPU Text Encoder and TPU VAE run them, each on the mesh its node picks: the whole graph's
weights resident together, as ComfyUI holds them.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, field

from ..errors import InputError
from .plan_compile import (StageReport, TimeBound, _no_persistent_cache, compile_program, format_costs,
                           format_time_bound, shard_bytes, time_bound)
from .topology import GIB, Topology, parse_topology

log = logging.getLogger("tpu_runtime.tools.plan")


@dataclass
class NativePlanReport:
    model: str
    comfy_class: str
    rules: str
    parameters: int
    topology: str
    chips: int
    chip_hbm_bytes: int
    devices_per_chip: int
    height: int
    width: int
    frames: int
    cfg: bool
    layers: int | None
    mesh: str
    weights: str
    fits: bool
    resident_weights_bytes_per_chip: int
    peak_bytes_per_chip: int
    step: StageReport
    stages: dict = field(default_factory=dict)  # stage name -> {"describe", "mesh", "report": StageReport}
    family: dict = field(default_factory=dict)  # our family's step on the same mesh: model, mesh, StageReport
    seconds: float = 0.0
    host_peak_rss_bytes: int = 0
    steps: int = 0
    time_bound: TimeBound | None = None  # a lower bound on a step and a video's sampling through the bridge


NATIVE_STAGES = ("encode", "sample", "decode")
KSAMPLER_STEPS = 20  # ComfyUI's KSampler node's default steps: the bound's default


def _native_program(arch, module, topo: Topology, mesh_text: str | None, cfg: bool, height, width, frames, attention):
    """(StageProgram, mesh spec, rules) of the bridged step on the topology's mesh."""
    from ..bridge.planning import step_program

    batch = 2 if cfg and not arch.batch_one else 1
    describe = (f"ComfyUI {type(module).__name__} step at {width}x{height}x{frames} "
                f"({_batch_words(batch, cfg)})")
    planned = step_program(module, arch.example_call(batch, height, width, frames), topo.devices(),
                           mesh_text, attention, describe)
    from ..bridge.rules import rules_for

    return planned.stage_program(("native", arch.name)), planned.mesh, rules_for(module)


def _batch_words(batch: int, cfg: bool) -> str:
    if batch == 2:
        return "CFG batch of 2"
    return "batch 1, two calls a CFG step" if cfg else "batch 1"


def _component_programs(arch, stage: str, topo: Topology, height: int, width: int, frames: int, attention,
                        layers: int | None, weights: str = "bf16") -> list:
    """The text encoder's (``encode``, its blocks quantized as ``weights`` says) or the VAE decoder's (``decode``)
    programs, on the mesh its node's ``auto`` picks."""
    from ..bridge.architectures import COMPONENTS
    from ..bridge.planning import decode_programs, text_program

    if stage == "encode":
        c = COMPONENTS[arch.text_encoder]
        module = _with_weights(c.build(layers=layers), weights)
        return [text_program(module, c.tokens, topo.devices(), None, attention,
                             f"ComfyUI {c.label} ({type(module).__name__}), one prompt of {c.tokens} tokens")]
    c = COMPONENTS[arch.vae]
    t, s = c.compression
    vae = c.build()
    if hasattr(vae, "tile_size") and hasattr(vae, "tokens_chunk_size"):  # tiles and chunks the video itself
        from ..bridge.planning import tile_decode_program

        tile = min(vae.tile_size, height, width) // s
        chunk = vae.tokens_chunk_size + vae.token_overlap
        shape = (1, vae.decoder.x_embedder.in_features, chunk, tile, tile)
        return [tile_decode_program(vae, shape, topo.devices(), None, attention,
                                    f"ComfyUI {c.label}, one {tile * s}-pixel tile of {chunk} latent frames (its "
                                    f"own tiles and chunks, at {width}x{height}x{frames})")]
    latent = (1, c.config["z_dim"], 1, height // s, width // s)
    return decode_programs(vae, latent, topo.devices(), None, attention,
                           f"ComfyUI {c.label} decode at {width}x{height}x{frames}")


def _with_weights(module, weights: str):
    """``module`` (bf16, on meta) as a released file of format ``weights`` holds it: its blocks' linear weights
    quantized (``bridge/quantized.py``), placed packed with their scales."""
    if weights != "bf16":
        from ..bridge.quantized import quantize_blocks

        quantize_blocks(module, weights)
    return module


def plan_native(name: str, comfy_dir: str | None, topology: str | Topology, *, height: int | None = None,
                width: int | None = None, frames: int | None = None, guidance: float | None = None,
                mesh: str | None = None, layers: int | None = None, attention=None,
                compare: bool = True, stages: tuple[str, ...] | None = ("sample",),
                weights: str = "bf16", steps: int | None = None) -> NativePlanReport:
    """Compile ComfyUI's ``name`` step for ``topology`` (and our family's on the same mesh when ``compare``); with
    ``stages`` ``encode`` / ``decode``, its text encoder and VAE as well (``--mesh`` is the diffusion model's; the
    text encoder and the VAE take their nodes' ``auto``; ``layers`` also cuts the text encoder's depth; ``None``:
    every stage the architecture has). ``weights``: bf16, or a quantized format (fp8, int8, nvfp4, mxfp8) for the
    diffusion model's and the text encoder's blocks, as ComfyUI holds such a file; ``steps`` (default
    ``KSAMPLER_STEPS``) for the time bound."""
    from ..bridge.quantized import PLAN_FORMATS

    if weights != "bf16" and weights not in PLAN_FORMATS:
        raise InputError(f"--comfy-weights {weights}: one of bf16, {', '.join(PLAN_FORMATS)}")
    from ..bridge.architectures import architecture, parameter_count, use_comfyui
    from ..engine.runtime import get_runtime
    from ..engine.validation import check_number

    start = time.perf_counter()
    check_number("--steps", steps, minimum=1, integer=True, optional=True)
    arch = architecture(name)
    if stages is None:
        stages = tuple(s for s, c in (("encode", arch.text_encoder), ("sample", arch), ("decode", arch.vae)) if c)
    unknown = [s for s in stages if s not in NATIVE_STAGES]
    if unknown or not stages:
        raise InputError(f"--stages {','.join(stages) or 'none'}: plan --comfy-model takes "
                         f"{', '.join(NATIVE_STAGES)}")
    missing = [s for s, c in (("encode", arch.text_encoder), ("decode", arch.vae)) if s in stages and c is None]
    if missing:
        raise InputError(f"--stages {','.join(missing)}: the text encoder and VAE of {arch.name} are not planned yet "
                         f"(Wan's are: umT5-XXL and the Wan VAEs); use --stages sample")
    topo = topology if isinstance(topology, Topology) else parse_topology(topology)
    nh, nw, nf = arch.size
    height, width, frames = height or nh, width or nw, frames or nf
    arch.check_size(height, width, frames)
    cfg = guidance is None or guidance > 1.0
    use_comfyui(comfy_dir)
    get_runtime(accelerator=False)  # compiles for the topology, runs nothing
    planned: dict[str, dict] = {}
    weights_by_component: dict[str, int] = {}
    module = _with_weights(arch.build(layers=layers), weights)
    # built (and its mesh checked) before anything compiles: a wrong --mesh is refused at once
    program, spec, rules = _native_program(arch, module, topo, mesh, cfg, height, width, frames, attention)
    components = [p for stage in NATIVE_STAGES if stage in stages and stage != "sample"
                  for p in _component_programs(arch, stage, topo, height, width, frames, attention, layers, weights)]
    with _no_persistent_cache():
        for p in components:
            planned[p.name] = {"describe": p.describe, "mesh": str(p.mesh),
                               "report": compile_program(p.stage_program(("native", arch.name, p.name)), topo)}
            weights_by_component[p.component] = shard_bytes(p.weights)
        step = compile_program(program, topo) if "sample" in stages else None
    if step is not None:
        planned["sample"] = {"describe": program.describe, "mesh": str(spec), "report": step}
        weights_by_component["diffusion_model"] = shard_bytes(program.example[0])
    resident = sum(weights_by_component.values())
    beside = max((max(0, p["report"].total_bytes_per_chip - p["report"].weights_bytes_per_chip)
                  for p in planned.values()), default=0)
    compiled = all(p["report"].compiled for p in planned.values())
    report = NativePlanReport(
        model=arch.name, comfy_class=arch.cls, rules=rules.describe(), parameters=parameter_count(module),
        topology=topo.name, chips=topo.chips, chip_hbm_bytes=topo.hbm_bytes, devices_per_chip=topo.devices_per_chip,
        height=height, width=width, frames=frames, cfg=cfg, layers=layers, mesh=str(spec), weights=weights,
        fits=compiled and resident + beside <= topo.hbm_bytes, resident_weights_bytes_per_chip=resident,
        peak_bytes_per_chip=resident + beside, step=step or StageReport(compiled=False, describe="not planned"),
        stages=planned, steps=steps or KSAMPLER_STEPS)
    report.time_bound = time_bound(step, report.steps, 2 if cfg and arch.batch_one else 1)
    if compare and arch.family and step is not None:
        from .plan import ModelSource, plan

        family = plan(ModelSource(arch.family), topo, height=height, width=width, frames=frames,
                      guidance=guidance, mesh=str(spec), stages=("sample",), layers=layers, attention=attention)
        report.family = {"model": arch.family, "mesh": family.mesh, "step": family.stages["sample"],
                         "resident_weights_bytes_per_chip": family.resident_weights_bytes_per_chip,
                         "peak_bytes_per_chip": family.peak_bytes_per_chip}
    report.seconds = round(time.perf_counter() - start, 1)
    report.host_peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def format_native_report(r: NativePlanReport) -> str:
    unit = "device" if r.devices_per_chip > 1 else "chip"
    depth = f", {r.layers} layer(s) (reduced depth)" if r.layers else ""
    depth += f", {r.weights} weights" if r.weights != "bf16" else ""
    lines = [
        f"plan: ComfyUI's {r.comfy_class.split(':')[1]} ({r.model}, {r.parameters / 1e9:.2f} B parameters{depth}) "
        f"through TPU Diffusion Model at {r.width}x{r.height}x{r.frames} ({'CFG' if r.cfg else 'no CFG'})",
        f"  on {r.topology}: {r.chips} chip(s), {_gib(r.chip_hbm_bytes)} GiB HBM per {unit}; mesh {r.mesh}; "
        f"{r.rules}",
        f"  {'step':<22}{'compiled':>9}{'weights':>9}{'temp':>8}{'total':>8} (GiB/{unit})"
        f"{'all-red':>9}{'all-gat':>9}{'red-sc':>8}{'all2all':>9}{'permute':>9}{'mosaic':>8}{'compile s':>11}",
    ]

    def row(label: str, s: StageReport) -> str:
        return (f"  {label:<22}{'yes' if s.compiled else 'NO':>9}{_gib(s.weights_bytes_per_chip):>9}"
                f"{_gib(s.temp_bytes_per_chip):>8}{_gib(s.total_bytes_per_chip):>8}           "
                f"{s.all_reduces:>9}{s.all_gathers:>9}{s.reduce_scatters:>8}{s.all_to_alls:>9}"
                f"{s.collective_permutes:>9}{s.mosaic_kernels:>8}{s.compile_seconds:>11.1f}")

    for name, stage in r.stages.items():
        label = "ComfyUI (bridge)" if name == "sample" else name
        lines.append(row(label, stage["report"]))
        if stage["report"].error:
            lines.append(f"           {stage['report'].error}")
    if r.family:
        f = r.family
        lines.append(row(f"our family ({f['model']})", f["step"]))
        if r.step.compiled and f["step"].compiled and f["step"].total_bytes_per_chip:
            ratio = r.step.total_bytes_per_chip / f["step"].total_bytes_per_chip
            lines.append(f"  bridge / family per-{unit} memory: {ratio:.3f}")
    rows = [("ComfyUI (bridge)" if n == "sample" else n, s["report"]) for n, s in r.stages.items()]
    if r.family:
        rows.append((f"our family ({r.family['model']})", r.family["step"]))
    lines += format_costs(rows, unit, label_width=22)
    bound = format_time_bound(r.time_bound, unit, "no bound: the step was not planned or did not compile",
                              step="a step through the bridge")
    if bound:
        lines.append(bound)
    if len(r.stages) > 1:
        lines.append("  stages: " + "; ".join(f"{n}: {s['describe']}, mesh {s['mesh']}" for n, s in r.stages.items()))
    verdict = "FITS" if r.fits else "DOES NOT FIT"
    lines.append(f"  verdict: {verdict}: peak {_gib(r.peak_bytes_per_chip)} of {_gib(r.chip_hbm_bytes)} GiB per {unit} "
                 f"(weights {_gib(r.resident_weights_bytes_per_chip)} GiB resident + the largest stage's activations)")
    lines.append(f"  planned in {r.seconds:.0f} s on this machine (peak host memory "
                 f"{r.host_peak_rss_bytes / GIB:.1f} GiB); measured run times need the real slice")
    return "\n".join(lines)


def check_args(args) -> None:
    if args.model:
        raise InputError("--comfy-model and --model: plan one at a time (--model is our families', --comfy-model "
                         "ComfyUI's own class)")
