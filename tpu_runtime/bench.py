"""``python -m tpu_runtime bench``: time our pipeline against diffusers eager on the same weights, in one process.

Reports, per stage, load / compile / run seconds and XLA compile counts, the XLA memory analysis of each
compiled program, peak host memory, and end-to-end wall times (cold: with compiles; warm: a second prompt and
seed) as ratios to diffusers eager. The VAE decode is compared with diffusers' eager VAE decode on the same
latents and with itself as one unrolled program; CogVideoX also compares its two VAE GroupNorm lowerings.
Without ``--model`` it builds a tiny random-weight model, so the numbers measure overheads and compiles, not a
real model's speed.

``bench --load-file-mb N`` measures loading a ComfyUI single-file Wan transformer of about N MB of random fp16
weights instead: host seconds and peak host memory of our loader, each in a fresh process.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)

GENERATIONS = {"2b": "cogvideox", "5b": "cogvideox", "1.5": "cogvideox", "wan2.1": "wan", "wan2.2-a14b": "wan",
               "wan2.2-ti2v-5b": "wan"}
_WAN_KIND = {"wan2.1": "2.1", "wan2.2-a14b": "2.2-A14B", "wan2.2-ti2v-5b": "2.2-TI2V-5B"}


def _peak_host_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _eager_pipeline(model: Path, family: str, dtype: str):
    import torch
    import diffusers

    cls = diffusers.WanPipeline if family == "wan" else diffusers.CogVideoXPipeline
    return cls.from_pretrained(model, torch_dtype=torch.float32 if dtype in ("auto", "float32") else torch.bfloat16)


def _diffusers_eager(model: Path, family: str, req, repeats: int) -> tuple[dict, object]:
    import torch

    start = time.perf_counter()
    pipe = _eager_pipeline(model, family, req.dtype)
    pipe.set_progress_bar_config(disable=True)
    load = time.perf_counter() - start
    extra = {} if family == "wan" else {"max_sequence_length": pipe.transformer.config.max_text_seq_length}
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
    from .generate import GenerateRequest, generate, open_model
    from .runtime import compile_stats, get_runtime
    from .stage_files import load_latents
    from .tiny import build_tiny_cogvideox, build_tiny_wan

    work = Path(tempfile.mkdtemp(prefix="tpu_video_bench_"))
    tiny = model is None
    family_name = GENERATIONS[generation]
    if tiny:
        model_path = (build_tiny_wan(work / "model", _WAN_KIND[generation]) if family_name == "wan"
                      else build_tiny_cogvideox(work / "model", generation))
    else:
        model_path = Path(model)
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
    result["diffusers_eager"], pipe = _diffusers_eager(model_path, family_name, req, repeats)

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
    if family_name == "cogvideox":
        result["group_norm"] = _group_norms(family, latents)
    result["peak_host_mib"] = _peak_host_mib()

    eager_warm = statistics.median(result["diffusers_eager"]["runs_s"][1:] or result["diffusers_eager"]["runs_s"])
    eager_cold = result["diffusers_eager"]["load_s"] + result["diffusers_eager"]["runs_s"][0]
    result["ratios"] = {
        "warm_ours_over_diffusers": statistics.median(warm) / eager_warm,
        "cold_ours_over_diffusers": cold_wall / eager_cold,
    }
    return result


def _timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _group_norms(family, latents) -> dict:
    """CogVideoX: both VAE GroupNorm lowerings, compile and run."""
    from .cogvideox import GROUP_NORMS

    gn = {}
    for choice in GROUP_NORMS:
        family.decode(latents, group_norm=choice)  # compiles this variant, or reuses it from the runs above
        program = family.timings.programs["decode"]
        gn[choice] = {"compile_s": program.compile_seconds, "memory_analysis": dict(program.memory),
                      "run_s_median": _timed(lambda: family.decode(latents, group_norm=choice))}
    return gn


def _decode_vs_eager(family, pipe, latents) -> dict:
    """Our compiled VAE decode (batch by batch for CogVideoX, frame by frame for Wan) against diffusers' eager
    ``vae.decode`` on the same latents and weights, and against our decode as one unrolled program."""
    import torch

    vae = pipe.vae
    z = latents.latents.to(vae.dtype)
    if family.FAMILY == "cogvideox":
        z = z / vae.config.scaling_factor
    else:
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z.dtype)
        z = z * torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z.dtype) + mean

    def eager():
        with torch.no_grad():
            return vae.decode(z, return_dict=False)[0]

    compiled = family.timings.compile.get("decode", 0.0)  # the cold generation's decode program(s)
    ours_s = _timed(lambda: family.decode(latents))
    program = family.timings.programs["decode"]
    eager_s = _timed(eager)
    loop = family.decode_loop
    family.decode_loop = "unrolled"  # one program for all frames, timed here for comparison
    family.decode(latents)
    unrolled_compile_s = family.timings.compile["decode"] - compiled
    unrolled_s = _timed(lambda: family.decode(latents))
    family.decode_loop = loop
    return {"ours_run_s_median": ours_s, "diffusers_eager_s_median": eager_s, "ratio_ours_over_eager": ours_s / eager_s,
            "loop": loop, "compile_s": compiled, "memory_analysis": dict(program.memory),
            "unrolled_run_s_median": unrolled_s, "unrolled_compile_s": unrolled_compile_s}


# --- loading a single-file transformer ---------------------------------------------------------------------------
_LOAD_CHILD = r"""
import json, os, sys, threading, time
import torch
from tpu_runtime.wan_files import transformer_names
from tpu_runtime.weights import TensorSource, load_into_meta_module
from diffusers import WanTransformer3DModel

def rss():  # (anonymous, file-backed) resident bytes
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith("Rss"))
    return int(fields["RssAnon"].split()[0]) * 1024, int(fields["RssFile"].split()[0]) * 1024
before, peak, done = rss(), [0, 0], threading.Event()
def watch():
    while not done.is_set():
        now = rss()
        peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
        time.sleep(0.005)
watcher = threading.Thread(target=watch); watcher.start()
start = time.perf_counter()
config, names = transformer_names(sys.argv[1])
model = load_into_meta_module(lambda: WanTransformer3DModel(**config), TensorSource([sys.argv[1]]), names,
                              getattr(torch, sys.argv[2]), "bench")
seconds = time.perf_counter() - start
done.set(); watcher.join()
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"seconds": seconds, "anon_increase_mib": (peak[0] - before[0]) / 2**20,
                  "file_pages_increase_mib": (peak[1] - before[1]) / 2**20, "loaded_bytes": params}))
"""


def bench_single_file_load(size_mb: int, dtypes=("bfloat16", "float32")) -> dict:
    """Write a random Wan transformer of about ``size_mb`` MB (fp16, original key names), then load it with our
    loader in fresh processes, once per run dtype: host seconds and peak host memory."""
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from .wan_files import wan_transformer_to_original

    work = Path(tempfile.mkdtemp(prefix="tpu_video_load_"))
    dim, ffn = 1536, 8960  # Wan 2.1 1.3B's width; layers chosen for the size
    per_layer = (8 * dim * dim + 2 * dim * ffn) * 2
    layers = max(1, round(size_mb * 2**20 / per_layer))
    with torch.device("meta"):
        meta = WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=ffn, num_layers=layers,
                                     text_dim=4096, freq_dim=256)
    tensors = {"model.diffusion_model." + wan_transformer_to_original(k):
               (torch.randn(tuple(v.shape)) * 0.02).to(torch.float16) for k, v in meta.state_dict().items()}
    path = work / "wan_transformer_fp16.safetensors"
    save_file(tensors, str(path))
    del tensors
    out = {"file_mb": path.stat().st_size / 2**20, "layers": layers}
    for dtype in dtypes:
        proc = subprocess.run([sys.executable, "-c", _LOAD_CHILD, str(path), dtype], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        out[dtype] = json.loads(proc.stdout.strip().splitlines()[-1])
    path.unlink()
    return out


def _machine(runtime=None) -> dict:
    from .runtime import get_runtime

    runtime = runtime or get_runtime()
    return {"platform": platform.platform(), "processor": platform.machine(), "backend": runtime.backend,
            "devices": len(runtime.devices), "device_kind": runtime.devices[0].device_kind}


def bench_lora_merge(widths=(256, 512, 1024), ranks=(4, 32, 128), layers: int = 4, repeats: int = 3) -> dict:
    """Time merging a LoRA into tiny random Wan transformers of several widths (every attention and feed-forward
    linear of every block, the way the distillation LoRAs touch them) at several ranks: the first merge (file
    read, host copy of the loaded weights, merge programs compiled) and a change of strength (no compile)."""
    import numpy as np

    from .lora import LoraSpec
    from .runtime import compile_stats
    from .tiny import TinyWanSpec, build_tiny_lora, build_tiny_wan
    from .wan import WanFamily

    work = Path(tempfile.mkdtemp(prefix="tpu_video_lora_"))
    rows = []
    for width in widths:
        folder = build_tiny_wan(work / f"wan_{width}", "2.1", spec=TinyWanSpec(heads=width // 128, layers=layers,
                                                                                ffn=4 * width))
        family = WanFamily(folder, dtype="float32")
        family._component("transformer")
        state = family._states["transformer"]
        for rank in ranks:
            path = build_tiny_lora(folder / "transformer", work / f"lora_{width}_{rank}.safetensors", "comfy",
                                   rank=rank)
            family.apply_loras({"transformer": ()})
            family._loras.clear()  # a fresh start: no host copies yet
            before = compile_stats()
            start = time.perf_counter()
            family.apply_loras({"transformer": (LoraSpec(str(path), 1.0),)})
            first = time.perf_counter() - start
            compiles = compile_stats().since(before).xla_compiles
            changes = []
            for i in range(repeats):
                start = time.perf_counter()
                family.apply_loras({"transformer": (LoraSpec(str(path), 0.5 + 0.1 * i),)})
                changes.append(time.perf_counter() - start)
            touched = family._loras["transformer"].touched
            rows.append({"width": width, "rank": rank, "layers": layers, "weights_merged": len(touched),
                         "merged_params": int(sum(np.prod(state[n].shape) for n in touched)),
                         "lora_params": int(sum(t.numel() for t in _lora_tensors(path))),
                         "first_merge_s": first, "first_merge_compiles": compiles,
                         "strength_change_s_median": statistics.median(changes)})
        family.release()
    return {"machine": _machine(), "rows": rows}


def _lora_tensors(path: Path):
    from safetensors.torch import load_file

    return [t for k, t in load_file(str(path)).items() if not k.endswith(".alpha")]


def print_lora_table(r: dict) -> None:
    m = r["machine"]
    print(f"\nLoRA merge on tiny Wan transformers (all attention and feed-forward linears), "
          f"JAX {m['backend']} x{m['devices']}, float32")
    print(f"  {'width':>6} {'rank':>5} {'weights':>8} {'merged Mparams':>15} {'LoRA Mparams':>13} "
          f"{'first merge s':>14} {'compiles':>9} {'new strength s':>15}")
    for x in r["rows"]:
        print(f"  {x['width']:>6} {x['rank']:>5} {x['weights_merged']:>8} {x['merged_params'] / 1e6:>15.2f} "
              f"{x['lora_params'] / 1e6:>13.3f} {x['first_merge_s']:>14.3f} {x['first_merge_compiles']:>9} "
              f"{x['strength_change_s_median']:>15.3f}")


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
    print("\n  end to end          ours         diffusers eager   ratio (ours / diffusers)")
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
        print(f"\n  VAE decode (same latents, median of 3): ours {v['ours_run_s_median']:.3f} s, diffusers eager "
              f"{v['diffusers_eager_s_median']:.3f} s, ratio {v['ratio_ours_over_eager']:.2f}; compile "
              f"{v['compile_s']:.2f} s ({v['loop']}); all frames in one unrolled program: "
              f"{v['unrolled_run_s_median']:.3f} s, compile {v['unrolled_compile_s']:.2f} s")
    print(f"\n  peak host memory {r['peak_host_mib']:.0f} MiB")


def print_load_table(r: dict) -> None:
    print(f"\nsingle-file Wan transformer: {r['file_mb']:.0f} MiB fp16 ({r['layers']} layers of Wan 2.1 1.3B width), "
          "loaded by our loader in a fresh process")
    print(f"  {'run dtype':<10} {'host s':>7} {'weights MiB':>12} {'peak allocated MiB':>19} "
          f"{'peak mapped file MiB':>21}")
    for dtype in ("bfloat16", "float32"):
        if dtype in r:
            x = r[dtype]
            print(f"  {dtype:<10} {x['seconds']:>7.2f} {x['loaded_bytes'] / 2**20:>12.0f} "
                  f"{x['anon_increase_mib']:>19.0f} {x['file_pages_increase_mib']:>21.0f}")
    print("  (allocated: anonymous memory the load added; mapped file: pages of the memory-mapped file, clean page "
          "cache the kernel can drop)")


def add_args(p) -> None:
    p.add_argument("--model", help="a CogVideoX or Wan diffusers folder (default: a tiny random-weight model "
                   "built now)")
    p.add_argument("--generation", choices=list(GENERATIONS), default="2b", help="for the tiny model")
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--width", type=int, help="default 96 (64 for CogVideoX 1.5 and Wan)")
    p.add_argument("--frames", type=int, help="default 9 (17 for CogVideoX 1.5)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="warm runs after the cold one")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--load-file-mb", type=int, help="instead: time loading a single-file Wan transformer of this size")
    p.add_argument("--lora-merge", action="store_true", help="instead: time merging LoRAs of several ranks into tiny "
                   "Wan transformers of several widths")
    p.add_argument("--json", help="also write the results here")


def main(args) -> int:
    if args.load_file_mb:
        r = bench_single_file_load(args.load_file_mb)
        print_load_table(r)
    elif args.lora_merge:
        r = bench_lora_merge()
        print_lora_table(r)
    else:
        frames = args.frames or (17 if args.generation == "1.5" else 9)
        width = args.width or (96 if GENERATIONS[args.generation] == "cogvideox" and args.generation != "1.5" else 64)
        r = run_bench(args.model, args.generation, args.height, width, frames, args.steps, args.repeats, args.dtype)
        print_table(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
        print(f"\nwrote {args.json}")
    return 0
