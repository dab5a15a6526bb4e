"""``python -m tpu_runtime bench``: time our pipeline against diffusers eager on the same weights, in one process.

Reports, per stage, load / compile / run seconds and XLA compile counts, the XLA memory analysis of each
compiled program, peak host memory, and end-to-end wall times (cold: with compiles; warm: a second prompt and
seed) as ratios to diffusers eager. The VAE decode is compared with diffusers' eager VAE decode on the same
latents, and each decode option with several lowerings (the family's declaration says which: a streamed or an
unrolled decode, a GroupNorm lowering) is run both ways. Without ``--model`` it builds a tiny random-weight model,
so the numbers measure overheads and compiles, not a real model's speed.

The loading and LoRA-merging benchmarks (``--load-file-mb``, ``--load-folder-mb``, ``--lora-merge``) are the
families' own (``FamilySpec.bench``): each load runs in a fresh process (``load_child.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

log = logging.getLogger(__name__)



def _peak_host_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _diffusers_eager(model: Path, family, req, repeats: int, backend: str) -> tuple[dict, object]:
    """diffusers' own pipeline of the model's folder (the class its model_index.json names), eager, in the same
    process: load once, then ``repeats`` generations. On a GPU machine (JAX's backend ``gpu`` and torch's CUDA) it
    runs on CUDA, in the dtype ours computes in (``auto``: bfloat16 off the CPU), so the two run on the same chip."""
    import diffusers
    import torch

    start = time.perf_counter()
    name, extra = family.reference_pipeline()
    accelerated = backend != "cpu"
    dtype = torch.bfloat16 if req.dtype == "bfloat16" or (req.dtype == "auto" and accelerated) else torch.float32
    pipe = getattr(diffusers, name).from_pretrained(model, torch_dtype=dtype)
    if backend == "gpu" and torch.cuda.is_available():
        pipe.to("cuda")
    pipe.set_progress_bar_config(disable=True)
    load = time.perf_counter() - start
    runs = []
    for i in range(repeats):
        start = time.perf_counter()
        pipe(req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
             num_frames=req.frames, num_inference_steps=req.steps, guidance_scale=req.guidance,
             generator=torch.Generator("cpu").manual_seed(req.seed + i), output_type="np", **extra)
        runs.append(time.perf_counter() - start)
    return {"load_s": load, "runs_s": runs}, pipe


def run_bench(model: str | None, generation: str, height: int, width: int, frames: int, steps: int,
              repeats: int = 2, dtype: str = "auto") -> dict:
    from ..engine.runtime import compile_stats, get_runtime
    from ..families import registry
    from .generate import GenerateRequest, generate, open_model
    from .stage_files import load_latents

    work = Path(tempfile.mkdtemp(prefix="tpu_video_bench_"))
    tiny = model is None
    model_path = registry.demos()[generation][0].build_demo(generation, work / "model") if tiny else Path(model)
    # A fresh compilation cache: "cold" means compiled here, not read from an earlier run's cache.
    runtime = get_runtime(cache_dir=work / "xla_cache")
    req = GenerateRequest(model=str(model_path), output_dir=str(work / "run0"), prompt="a panda playing a guitar",
                          negative_prompt="blurry", height=height, width=width, frames=frames, steps=steps,
                          dtype=dtype, seed=0)
    family = open_model(req, runtime)
    family_name = family.FAMILY
    req.guidance = family.DEFAULT_GUIDANCE
    result = {
        "machine": _machine(runtime),
        "model": f"tiny random-weight {family.FAMILY_NAME}-{family.generation}" if tiny else str(model_path),
        "family": family_name,
        "request": {"height": height, "width": width, "frames": frames, "steps": steps, "dtype": dtype},
    }

    # diffusers eager first: its numbers do not depend on anything we compiled.
    result["diffusers_eager"], pipe = _diffusers_eager(model_path, family, req, repeats, runtime.backend)
    result["diffusers_eager"]["device"] = str(pipe.device)

    # Ours, cold (load + compile + run), then warm runs with new seeds and prompts.
    family_start = time.perf_counter()
    before = compile_stats()
    cold = generate(req, family=family)
    cold_wall = time.perf_counter() - family_start
    warm = []
    for i in range(1, repeats + 1):
        req_i = GenerateRequest(**{**req.__dict__, "output_dir": str(work / f"run{i}"), "seed": i,
                                   "prompt": f"a cat walks on the grass, take {i}"})
        start = time.perf_counter()
        generate(req_i, family=family)
        warm.append(time.perf_counter() - start)
    stats = compile_stats().since(before)
    t = family.timings
    result["ours"] = {
        "cold_wall_s": cold_wall, "warm_runs_s": warm,
        "load_s": t.load, "compile_s": dict(t.compile), "xla_compiles_by_stage": cold["timings"]["all"]["xla_compiles"],
        "run_s_per_generation": {k: v / (repeats + 1) for k, v in t.run.items()},
        "xla_compiles_total": stats.xla_compiles, "persistent_cache_hits": stats.persistent_cache_hits,
        "memory_analysis": {stage: p.memory for stage, p in t.programs.items()},
    }
    latents = load_latents(work / "run0")
    result["vae_decode"] = _decode_vs_eager(family, pipe, latents)  # first: its compile time is the cold run's
    for option, choices in family.decode_variants().items():  # each lowering the family offers, compiled and run
        result[option] = _decode_variants(family, latents, option, choices)
    result["peak_host_mib"] = _peak_host_mib()

    eager_warm = statistics.median(result["diffusers_eager"]["runs_s"][1:] or result["diffusers_eager"]["runs_s"])
    eager_cold = result["diffusers_eager"]["load_s"] + result["diffusers_eager"]["runs_s"][0]
    result["ratios"] = {
        "warm_ours_over_diffusers": statistics.median(warm) / eager_warm,
        "cold_ours_over_diffusers": cold_wall / eager_cold,
    }
    return result


def bench_step_cache(model: str | None, generation: str, height: int, width: int, frames: int, steps: int,
                     method: str, threshold: float | None = None, mag_ratios: str | None = None,
                     max_skip: int | None = None, retention: float | None = None, repeats: int = 2,
                     dtype: str = "auto") -> dict:
    """One process, one model, one prompt: the sampler's time and the transformer blocks it runs, without and with
    the step cache, each program compiled before the timed runs. MagCache's ratios: ``mag_ratios``, else the
    model's published ones, else (a tiny random model has none) Wan 2.1 T2V 1.3B's published curve, so the skip
    pattern is a released model's."""
    from ..engine.runtime import compile_stats, get_runtime
    from ..engine.stages import SampleSettings
    from ..families import registry
    from .generate import GenerateRequest, open_model
    from .options import step_cache

    work = Path(tempfile.mkdtemp(prefix="tpu_video_bench_"))
    tiny = model is None
    model_path = registry.demos()[generation][0].build_demo(generation, work / "model") if tiny else Path(model)
    runtime = get_runtime(cache_dir=work / "xla_cache")
    family = open_model(GenerateRequest(model=str(model_path), output_dir=str(work), dtype=dtype), runtime)
    embeddings = family.encode("a panda playing a guitar", "blurry")
    cache = step_cache(method, threshold, max_skip, retention, mag_ratios)
    base = SampleSettings(height, width, frames, steps=steps, guidance=family.DEFAULT_GUIDANCE, seed=0)
    ratios_source = "given" if mag_ratios else ""
    if method == "magcache" and not mag_ratios:
        published = family.published_mag_ratios(base, image=False)
        if published is None:  # a released model's curve, so the skip pattern is a real one
            ratios_source, ratios = family_bench("mag-ratios", family.FAMILY)()
            cache = dataclasses.replace(cache, mag_ratios=ratios)
        else:
            ratios_source = published[0]
    result = {"machine": _machine(runtime), "family": family.FAMILY,
              "model": f"tiny random-weight {family.FAMILY_NAME}-{family.generation}" if tiny else str(model_path),
              "request": {"height": height, "width": width, "frames": frames, "steps": steps, "dtype": dtype,
                          "method": method, "threshold": cache.resolved_threshold(), "ratios": ratios_source}}
    for name, c in (("uncached", None), ("cached", cache)):
        settings = dataclasses.replace(base, cache=c)
        before = compile_stats()
        family.sample(embeddings, settings)  # compiles, then runs once
        compiles = compile_stats().since(before).xla_compiles
        runs = []
        for i in range(repeats):
            start = time.perf_counter()
            family.sample(embeddings, dataclasses.replace(settings, seed=i + 1))
            runs.append(time.perf_counter() - start)
        report = family.step_cache_report or {"transformer_block_runs": steps * len(
            getattr(family.component("transformer"), family.STEP_CACHE_BLOCKS.attribute)), "skipped": 0}
        result[name] = {"sampler_s": runs, "median_s": statistics.median(runs), "compiles": compiles,
                        "block_runs": report["transformer_block_runs"], "skipped_steps": report["skipped"],
                        "skipped": report.get("skipped_steps", [])}
    result["ratios"] = {"time_uncached_over_cached": result["uncached"]["median_s"] / result["cached"]["median_s"],
                        "blocks_uncached_over_cached": result["uncached"]["block_runs"] /
                        max(1, result["cached"]["block_runs"])}
    return result


def print_step_cache_table(r: dict) -> None:
    q = r["request"]
    print(f"\nStep cache bench: {r['model']}, {q['frames']}x{q['height']}x{q['width']}, {q['steps']} steps, "
          f"{r['machine']['backend']} ({r['machine']['device_kind']}), {q['method']} threshold {q['threshold']:g}"
          + (f", ratios: {q['ratios']}" if q["ratios"] else ""))
    print(f"  {'run':<10} {'sampler s':>10} {'block runs':>11} {'skipped':>8} {'compiles':>9}")
    for name in ("uncached", "cached"):
        x = r[name]
        print(f"  {name:<10} {x['median_s']:>10.3f} {x['block_runs']:>11} {x['skipped_steps']:>8} {x['compiles']:>9}")
    print(f"  uncached / cached: sampler time {r['ratios']['time_uncached_over_cached']:.2f}x, transformer blocks "
          f"{r['ratios']['blocks_uncached_over_cached']:.2f}x (median of the warm runs)")


def _timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _decode_variants(family, latents, option: str, choices) -> dict:
    """Each choice of one of the family's decode options (CogVideoX's VAE GroupNorm lowerings), compile and run."""
    out = {}
    for choice in choices:
        family.decode(latents, **{option: choice})  # compiles this variant, or reuses it from the runs above
        program = family.timings.programs["decode"]
        out[choice] = {"compile_s": program.compile_seconds, "memory_analysis": dict(program.memory),
                       "run_s_median": _timed(lambda: family.decode(latents, **{option: choice}))}
    return out


def _decode_vs_eager(family, pipe, latents) -> dict:
    """Our compiled VAE decode (streamed where the family streams it) against diffusers' eager ``vae.decode`` on the
    same latents and weights, and, where the family offers one, against our decode as one unrolled program."""
    import torch

    vae = pipe.vae
    z = family.vae_latents(latents.latents.to(vae.dtype)).to(vae.device)

    def eager():
        with torch.no_grad():
            return vae.decode(z, return_dict=False)[0].cpu()  # on CUDA: the time until the frames are there

    compiled = family.timings.compile.get("decode", 0.0)  # the cold generation's decode program(s)
    ours_s = _timed(lambda: family.decode(latents))
    program = family.timings.programs["decode"]
    eager_s = _timed(eager)
    loop = getattr(family, "decode_loop", None)
    unrolled_s = unrolled_compile_s = None
    if "unrolled" in family.decode_variants().get("loop", ()):  # a streamed decode: also one program for all frames
        family.decode(latents, loop="unrolled")
        unrolled_compile_s = family.timings.compile["decode"] - compiled
        unrolled_s = _timed(lambda: family.decode(latents, loop="unrolled"))
    return {"ours_run_s_median": ours_s, "diffusers_eager_s_median": eager_s, "ratio_ours_over_eager": ours_s / eager_s,
            "loop": loop, "compile_s": compiled, "memory_analysis": dict(program.memory),
            "unrolled_run_s_median": unrolled_s, "unrolled_compile_s": unrolled_compile_s}


def load_in_child(ref: str, path: Path, dtype: str, no_accelerate: bool = False) -> dict:
    """Load ``path`` with the loader ``ref`` names ("module:function") in a fresh process (``load_child.py``):
    host seconds, peak memory, and whether anything mentioned accelerate on stderr."""
    command = [sys.executable, "-m", "tpu_runtime.tools.load_child", ref, str(path), dtype]
    proc = subprocess.run(command + (["--no-accelerate"] if no_accelerate else []), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "mentions_accelerate": "accelerate" in proc.stderr}


def family_bench(name: str, family: str):
    """The benchmark ``name`` of ``family`` (a family's name, or a demo's): its own, else the first family's that
    has one (the registry's order)."""
    from ..errors import InputError
    from ..families import registry

    specs = [s for s in registry.FAMILIES if s.name == family] or \
        [spec for n, (spec, _) in registry.demos().items() if n == family]
    for spec in specs + registry.FAMILIES:
        if name in spec.bench:
            return spec.load(spec.bench[name])
    raise InputError(f"no model family has a {name} benchmark")


def _machine(runtime=None) -> dict:
    from ..engine.runtime import get_runtime

    runtime = runtime or get_runtime()
    return {"platform": platform.platform(), "processor": platform.machine(), "backend": runtime.backend,
            "devices": len(runtime.devices), "device_kind": runtime.devices[0].device_kind}


# --- output ------------------------------------------------------------------------------------------------------
def print_table(r: dict) -> None:
    m = r["machine"]
    print(f"\nbench: {r['model']} at {r['request']}")
    print(f"machine: {m['platform']} ({m['processor']}), JAX backend {m['backend']} x{m['devices']} ({m['device_kind']})")
    o = r["ours"]
    print(f"\n  {'stage':<8} {'compile s':>10} {'run s/gen':>10} {'XLA compiles':>13} {'temp MiB':>9} {'args MiB':>9}")
    for stage in ("encode", "sample", "decode"):
        mem = o["memory_analysis"].get(stage, {})
        print(f"  {stage:<8} {o['compile_s'].get(stage, 0):>10.2f} {o['run_s_per_generation'].get(stage, 0):>10.3f} "
              f"{o['xla_compiles_by_stage'].get(stage, 0):>13} {mem.get('temp_size_in_bytes', 0) / 2**20:>9.2f} "
              f"{mem.get('argument_size_in_bytes', 0) / 2**20:>9.2f}")
    d = r["diffusers_eager"]
    print(f"\n  end to end          ours         diffusers eager ({d.get('device', 'cpu')})   ratio (ours / diffusers)")
    print(f"  cold (load+compile) {o['cold_wall_s']:>8.2f} s   {d['load_s'] + d['runs_s'][0]:>8.2f} s        "
          f"{r['ratios']['cold_ours_over_diffusers']:.2f}")
    print(f"  warm (median)       {statistics.median(o['warm_runs_s']):>8.2f} s   "
          f"{statistics.median(d['runs_s'][1:] or d['runs_s']):>8.2f} s        {r['ratios']['warm_ours_over_diffusers']:.2f}")
    print(f"  XLA programs compiled in total: {o['xla_compiles_total']} "
          f"(persistent-cache hits {o['persistent_cache_hits']})")
    if "group_norm" in r:
        print("\n  VAE GroupNorm     compile s   run s (median)   temp MiB")
        for name, g in r["group_norm"].items():
            print(f"  {name:<16} {g['compile_s']:>10.2f} {g['run_s_median']:>15.3f} "
                  f"{g['memory_analysis'].get('temp_size_in_bytes', 0) / 2**20:>10.2f}")
    if "vae_decode" in r:
        v = r["vae_decode"]
        unrolled = (f" ({v['loop']}); all frames in one unrolled program: {v['unrolled_run_s_median']:.3f} s, "
                    f"compile {v['unrolled_compile_s']:.2f} s") if v["loop"] else " (one program)"
        print(f"\n  VAE decode (same latents, median of 3): ours {v['ours_run_s_median']:.3f} s, diffusers eager "
              f"{v['diffusers_eager_s_median']:.3f} s, ratio {v['ratio_ours_over_eager']:.2f}; compile "
              f"{v['compile_s']:.2f} s{unrolled}")
    print(f"\n  peak host memory {r['peak_host_mib']:.0f} MiB")


def add_args(p) -> None:
    from ..families import registry

    p.add_argument("--model", help="a diffusers folder (default: a tiny random-weight model built now)")

    p.add_argument("--generation", choices=list(registry.demos()), default="2b", help="for the tiny model")
    p.add_argument("--height", type=int, help="default: the tiny model's (64)")
    p.add_argument("--width", type=int, help="default: the tiny model's")
    p.add_argument("--frames", type=int, help="default: the tiny model's")
    p.add_argument("--steps", type=int, default=4, help="denoising steps of each generation")
    p.add_argument("--repeats", type=int, default=2, help="warm runs after the cold one")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on TPU/GPU, float32 on CPU")
    owners = lambda name: ", ".join(s.display_name for s in registry.FAMILIES if name in s.bench)  # noqa: E731
    p.add_argument("--load-file-mb", type=int, help="instead: time loading ComfyUI's single file(s) of a model of "
                   f"about this size, the --generation's family's (else the first's; {owners('load-file')})")
    p.add_argument("--load-folder-mb", type=int, help="instead: time loading a transformer folder of this size, ours "
                   f"against diffusers' from_pretrained ({owners('load-folder')})")
    p.add_argument("--lora-merge", action="store_true", help="instead: time merging LoRAs of several ranks into tiny "
                   f"transformers of several widths ({owners('lora-merge')})")
    p.add_argument("--cache", choices=["magcache", "first-block"], help="instead: the sampler with and without "
                   "this step cache, in one process (use --steps 50)")
    p.add_argument("--cache-threshold", type=float, help="with --cache (default: diffusers')")
    p.add_argument("--mag-ratios", help="with --cache magcache (default: the model's published ones; a model without "
                   "any: a released model's published curve)")
    p.add_argument("--comfy-native", action="store_true", help="instead: ComfyUI's own sampling of its own model, "
                   "natively and through TPU Diffusion Model (needs --comfy)")
    p.add_argument("--comfy", metavar="COMFYUI_DIR", help="with --comfy-native or --restart: the ComfyUI folder")
    p.add_argument("--comfy-file", help="with --comfy-native: a diffusion model file of ComfyUI's (default: a "
                   "tiny random-weight one built on the spot)")
    p.add_argument("--restart", action="store_true", help="instead: the seconds before the first step in a fresh "
                   "process, cold, warm with the XLA cache alone and warm with the saved programs, for ComfyUI's own "
                   "models through the bridge (with --comfy; see bench_native.py) and the --generation's tiny model")
    p.add_argument("--restart-layers", type=int, default=20, help="with --restart: the bridged models' blocks")
    p.add_argument("--restart-rounds", type=int, default=1, help="with --restart: rounds of cold and warm runs, each on "
                   "a new cache folder; the table gives each mode's median seconds and ratio (the ratio within a "
                   "round), the JSON every round")
    p.add_argument("--json", help="also write the results here")


def main(args) -> int:
    tools = SimpleNamespace(load_in_child=load_in_child, timed=_timed)  # what a family's loading benchmark uses
    if args.load_file_mb:
        r, table = family_bench("load-file", args.generation)(args.load_file_mb, tools)
        print(table)
    elif args.load_folder_mb:
        r, table = family_bench("load-folder", args.generation)(args.load_folder_mb, tools)
        print(table)
    elif args.lora_merge:
        r, table = family_bench("lora-merge", args.generation)()
        r["machine"] = _machine()
        print(table)
    elif args.cache:
        from ..families import registry

        demo = registry.demos()[args.generation][1]
        r = bench_step_cache(args.model, args.generation, args.height or demo.height, args.width or demo.width,
                             args.frames or demo.frames, args.steps, args.cache, args.cache_threshold,
                             args.mag_ratios, repeats=args.repeats, dtype=args.dtype)
        print_step_cache_table(r)
    else:
        from ..families import registry

        demo = registry.demos()[args.generation][1]
        r = run_bench(args.model, args.generation, args.height or demo.height, args.width or demo.width,
                      args.frames or demo.frames, args.steps, args.repeats, args.dtype)
        print_table(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
        print(f"\nwrote {args.json}")
    return 0
