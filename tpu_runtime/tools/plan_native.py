"""``plan --comfy-model``: ComfyUI's own model class compiled for a TPU slice through the native bridge, as TPU
Diffusion Model runs it, and reported per chip as ``plan`` reports our families.

The model is ComfyUI's class at its released size, built on ``meta`` (``bridge/architectures.py``); its weights
are placed as shape structs by the bridge's rule tables (``bridge/rules.py``), the step is the very program the
bridge compiles (``BridgedModule.program_function``: ComfyUI's ``_forward`` traced through torchax with the
runtime's attention, splash on a TPU mesh), for the call a sampler makes with CFG (cond and uncond in one batch).
When our own family has the same model, its step is planned on the same mesh and printed beside it.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from dataclasses import dataclass, field

from ..engine.sharding import parse_mesh
from ..errors import InputError
from .plan_compile import StageReport, _no_persistent_cache, compile_program, shard_bytes
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
    fits: bool
    resident_weights_bytes_per_chip: int
    peak_bytes_per_chip: int
    step: StageReport
    family: dict = field(default_factory=dict)  # our family's step on the same mesh: model, mesh, StageReport
    seconds: float = 0.0
    host_peak_rss_bytes: int = 0


def _native_program(arch, module, topo: Topology, mesh_text: str | None, cfg: bool, height, width, frames, attention):
    """(StageProgram, mesh spec, rules) of the bridged step on the topology's mesh."""
    import jax

    from ..bridge.calls import split_call
    from ..bridge.comfy import comfy_attention
    from ..bridge.program import BridgedModule
    from ..bridge.rules import placement_specs, rules_for
    from ..engine.attention import AttentionConfig
    from ..engine.dtypes import jax_dtype
    from ..engine.runtime import get_runtime
    from ..engine.stages import StageProgram

    runtime = get_runtime()
    rules = rules_for(module)
    devices = topo.devices()
    spec = parse_mesh(mesh_text) or rules.auto_mesh(module, len(devices))
    rules.check_mesh(module, spec, len(devices))
    mesh = runtime.make_mesh(spec, devices)
    bridged = BridgedModule(module=module, method=type(module)._forward, rules=rules,
                            attention=attention or AttentionConfig(), label=type(module).__name__)
    named = bridged._named()
    specs = placement_specs({n: tuple(t.shape) for n, t in named}, rules, dict(mesh.shape))
    structs: dict[int, object] = {}
    state = {}
    for name, tensor in named:
        if id(tensor) not in structs:
            structs[id(tensor)] = jax.ShapeDtypeStruct(tuple(tensor.shape), jax_dtype(tensor.dtype),
                                                       sharding=runtime.sharding(mesh, specs[name]))
        state[name] = structs[id(tensor)]
    batch = 2 if cfg else 1
    args, kwargs = arch.example_call(batch, height, width, frames)
    positional, keyword, options = bridged._arguments(args, kwargs)
    options = {"optimized_attention_override": comfy_attention, **(options or {})}
    call = split_call((positional, keyword))
    dp = mesh.shape["dp"]
    leaves = [jax.ShapeDtypeStruct(tuple(t.shape), jax_dtype(t.dtype), sharding=runtime.sharding(
        mesh, ("dp",) if dp > 1 and t.ndim >= 1 and t.shape[0] % dp == 0 else ())) for t in call.leaves]
    fn, _, _ = bridged.program_function(call, options, mesh)
    t, s = arch.compression
    describe = (f"ComfyUI {type(module).__name__} step at {width}x{height}x{frames} "
                f"({'CFG batch of 2' if cfg else 'batch 1'})")
    program = StageProgram(stage="sample", fn=fn, example=(state, leaves), key=("native", arch.name),
                           describe=describe, scope=contextlib.nullcontext, components=("diffusion_model",))
    return program, spec, rules


def plan_native(name: str, comfy_dir: str | None, topology: str | Topology, *, height: int | None = None,
                width: int | None = None, frames: int | None = None, guidance: float | None = None,
                mesh: str | None = None, layers: int | None = None, attention=None,
                compare: bool = True) -> NativePlanReport:
    """Compile ComfyUI's ``name`` step for ``topology`` (and our family's on the same mesh when ``compare``)."""
    from ..bridge.architectures import architecture, parameter_count, use_comfyui
    from ..engine.runtime import get_runtime

    start = time.perf_counter()
    arch = architecture(name)
    topo = topology if isinstance(topology, Topology) else parse_topology(topology)
    nh, nw, nf = arch.size
    height, width, frames = height or nh, width or nw, frames or nf
    arch.check_size(height, width, frames)
    cfg = guidance is None or guidance > 1.0
    use_comfyui(comfy_dir)
    get_runtime()
    module = arch.build(layers=layers)
    program, spec, rules = _native_program(arch, module, topo, mesh, cfg, height, width, frames, attention)
    with _no_persistent_cache():
        step = compile_program(program, topo)
    weights = shard_bytes(program.example[0])
    beside = max(0, step.total_bytes_per_chip - step.weights_bytes_per_chip)
    report = NativePlanReport(
        model=arch.name, comfy_class=arch.cls, rules=rules.describe(), parameters=parameter_count(module),
        topology=topo.name, chips=topo.chips, chip_hbm_bytes=topo.hbm_bytes, devices_per_chip=topo.devices_per_chip,
        height=height, width=width, frames=frames, cfg=cfg, layers=layers, mesh=str(spec),
        fits=step.compiled and weights + beside <= topo.hbm_bytes, resident_weights_bytes_per_chip=weights,
        peak_bytes_per_chip=weights + beside, step=step)
    if compare and arch.family:
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

    lines.append(row("ComfyUI (bridge)", r.step))
    if r.step.error:
        lines.append(f"           {r.step.error}")
    if r.family:
        f = r.family
        lines.append(row(f"our family ({f['model']})", f["step"]))
        if r.step.compiled and f["step"].compiled and f["step"].total_bytes_per_chip:
            ratio = r.step.total_bytes_per_chip / f["step"].total_bytes_per_chip
            lines.append(f"  bridge / family per-{unit} memory: {ratio:.3f}")
    verdict = "FITS" if r.fits else "DOES NOT FIT"
    lines.append(f"  verdict: {verdict}: peak {_gib(r.peak_bytes_per_chip)} of {_gib(r.chip_hbm_bytes)} GiB per {unit} "
                 f"(weights {_gib(r.resident_weights_bytes_per_chip)} GiB resident + the step's activations)")
    lines.append(f"  planned in {r.seconds:.0f} s on this machine (peak host memory "
                 f"{r.host_peak_rss_bytes / GIB:.1f} GiB); run times need the real slice")
    return "\n".join(lines)


def check_args(args) -> None:
    if args.model:
        raise InputError("--comfy-model and --model: plan one at a time (--model is our families', --comfy-model "
                         "ComfyUI's own class)")
