"""``python -m tpu_runtime bench``: time our pipeline against diffusers eager on the same weights, in one process.

Reports, per stage, load / compile / run seconds and XLA compile counts, the XLA memory analysis of each
compiled program, peak host memory, the GroupNorm lowering comparison for the VAE decode, and end-to-end wall
times (cold: with compiles; warm: a second prompt and seed) as ratios to diffusers eager. Without ``--model`` it
builds a tiny random-weight model, so the numbers measure overheads and compiles, not a real model's speed.
"""

from __future__ import annotations

import json
import logging
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _peak_host_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _diffusers_eager(model: Path, req, repeats: int) -> dict:
    import torch
    from diffusers import CogVideoXPipeline

    start = time.perf_counter()
    pipe = CogVideoXPipeline.from_pretrained(model, dtype=torch.float32 if req.dtype in ("auto", "float32") else torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    load = time.perf_counter() - start
    runs = []
    for i in range(repeats):
        start = time.perf_counter()
        pipe(req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
             num_frames=req.frames, num_inference_steps=req.steps, guidance_scale=req.guidance,
             generator=torch.Generator("cpu").manual_seed(req.seed + i), output_type="np",
             max_sequence_length=pipe.transformer.config.max_text_seq_length)
        runs.append(time.perf_counter() - start)
    return {"load_s": load, "runs_s": runs}


def run_bench(model: str | None, generation: str, height: int, width: int, frames: int, steps: int,
              repeats: int = 2, dtype: str = "auto") -> dict:
    from .generate import GenerateRequest, generate
    from .cogvideox import GROUP_NORMS, CogVideoXFamily
    from .runtime import compile_stats, get_runtime
    from .stage_files import load_latents
    from .tiny import build_tiny_cogvideox

    work = Path(tempfile.mkdtemp(prefix="tpu_video_bench_"))
    tiny = model is None
    model_path = build_tiny_cogvideox(work / "model", generation) if tiny else Path(model)
    runtime = get_runtime()
    req = GenerateRequest(model=str(model_path), output_dir=str(work / "run0"), prompt="a panda playing a guitar",
                          negative_prompt="blurry", height=height, width=width, frames=frames, steps=steps,
                          dtype=dtype, seed=0)

    result = {
        "machine": {"platform": platform.platform(), "processor": platform.machine(), "backend": runtime.backend,
                    "devices": len(runtime.devices), "device_kind": runtime.devices[0].device_kind},
        "model": "tiny random-weight CogVideoX-" + generation if tiny else str(model_path),
        "request": {"height": height, "width": width, "frames": frames, "steps": steps, "dtype": dtype},
    }

    # diffusers eager first: its numbers do not depend on anything we compiled.
    result["diffusers_eager"] = _diffusers_eager(model_path, req, repeats)

    # Ours, cold (load + compile + run), then warm runs with new seeds and prompts.
    family_start = time.perf_counter()
    family = CogVideoXFamily(model_path, dtype=dtype, runtime=runtime)
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

    # GroupNorm lowering comparison on the VAE decode.
    latents = load_latents(work / "run0")
    gn = {}
    for choice in GROUP_NORMS:
        family.decode(latents, group_norm=choice)  # compiles this variant, or reuses it from the runs above
        program = family.timings.programs["decode"]
        compile_s, memory = program.compile_seconds, dict(program.memory)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            family.decode(latents, group_norm=choice)
            times.append(time.perf_counter() - start)
        gn[choice] = {"compile_s": compile_s, "run_s_median": statistics.median(times), "memory_analysis": memory}
    result["group_norm"] = gn
    result["peak_host_mib"] = _peak_host_mib()

    eager_warm = statistics.median(result["diffusers_eager"]["runs_s"][1:] or result["diffusers_eager"]["runs_s"])
    eager_cold = result["diffusers_eager"]["load_s"] + result["diffusers_eager"]["runs_s"][0]
    result["ratios"] = {
        "warm_ours_over_diffusers": statistics.median(warm) / eager_warm,
        "cold_ours_over_diffusers": cold_wall / eager_cold,
    }
    return result


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
    print("\n  end to end          ours         diffusers eager   ratio (ours / diffusers)")
    print(f"  cold (load+compile) {o['cold_wall_s']:>8.2f} s   {d['load_s'] + d['runs_s'][0]:>8.2f} s        "
          f"{r['ratios']['cold_ours_over_diffusers']:.2f}")
    print(f"  warm (median)       {statistics.median(o['warm_runs_s']):>8.2f} s   "
          f"{statistics.median(d['runs_s'][1:] or d['runs_s']):>8.2f} s        {r['ratios']['warm_ours_over_diffusers']:.2f}")
    print(f"  XLA programs compiled in total: {o['xla_compiles_total']} (persistent-cache hits {o['persistent_cache_hits']})")
    print("\n  VAE GroupNorm     compile s   run s (median)   temp MiB")
    for name, g in r["group_norm"].items():
        print(f"  {name:<16} {g['compile_s']:>10.2f} {g['run_s_median']:>15.3f} "
              f"{g['memory_analysis'].get('temp_size_in_bytes', 0) / 2**20:>10.2f}")
    print(f"\n  peak host memory {r['peak_host_mib']:.0f} MiB")


def add_args(p) -> None:
    p.add_argument("--model", help="diffusers CogVideoX folder (default: a tiny random-weight model built now)")
    p.add_argument("--generation", choices=["2b", "5b", "1.5"], default="2b", help="for the tiny model")
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--frames", type=int, help="default 9 (17 for 1.5)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="warm runs after the cold one")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--json", help="also write the results here")


def main(args) -> int:
    frames = args.frames or (17 if args.generation == "1.5" else 9)
    r = run_bench(args.model, args.generation, args.height, args.width, frames, args.steps, args.repeats, args.dtype)
    print_table(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
        print(f"\nwrote {args.json}")
    return 0
