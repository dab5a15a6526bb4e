"""``python -m tpu_runtime bench``: time our pipeline against diffusers eager on the same weights, in one process.

Reports, per stage, load / compile / run seconds and XLA compile counts, the XLA memory analysis of each
compiled program, peak host memory, and end-to-end wall times (cold: with compiles; warm: a second prompt and
seed) as ratios to diffusers eager. The VAE decode is compared with diffusers' eager VAE decode on the same
latents and with itself as one unrolled program; CogVideoX also compares its two VAE GroupNorm lowerings.
Without ``--model`` it builds a tiny random-weight model, so the numbers measure overheads and compiles, not a
real model's speed.

``bench --load-file-mb N`` measures loading a ComfyUI single-file Wan transformer of about N MB of random fp16
weights instead: host seconds and peak host memory of our loader, each in a fresh process; with
``--generation ltx2``, LTX-2's all-in-one checkpoint (bf16 and fp8) against its diffusers folder, the model opened
and its transformer placed.
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

log = logging.getLogger(__name__)



def _peak_host_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _diffusers_eager(model: Path, family, req, repeats: int) -> tuple[dict, object]:
    """diffusers' own pipeline of the model's folder (the class its model_index.json names), eager, in the same
    process: load once, then ``repeats`` generations."""
    import diffusers
    import torch

    start = time.perf_counter()
    name, extra = family.reference_pipeline()
    dtype = torch.float32 if req.dtype in ("auto", "float32") else torch.bfloat16
    pipe = getattr(diffusers, name).from_pretrained(model, torch_dtype=dtype)
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
    result["diffusers_eager"], pipe = _diffusers_eager(model_path, family, req, repeats)

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
    for option, choices in family.decode_variants().items():  # CogVideoX: its two GroupNorm lowerings
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
    from ..families.wan import magcache
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
        if published is None:
            cache = dataclasses.replace(cache, mag_ratios={"*": magcache.diffusers_list(magcache.WAN21_T2V_1_3B)})
            ratios_source = "Wan2.1-T2V-1.3B's published curve (stand-in: this model has none)"
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
            getattr(family._parts["transformer"], family.STEP_CACHE_BLOCKS.attribute)), "skipped": 0}
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
    """Our compiled VAE decode (batch by batch for CogVideoX, frame by frame for Wan) against diffusers' eager
    ``vae.decode`` on the same latents and weights, and against our decode as one unrolled program."""
    import torch

    vae = pipe.vae
    z = family.vae_latents(latents.latents.to(vae.dtype))

    def eager():
        with torch.no_grad():
            return vae.decode(z, return_dict=False)[0]

    compiled = family.timings.compile.get("decode", 0.0)  # the cold generation's decode program(s)
    ours_s = _timed(lambda: family.decode(latents))
    program = family.timings.programs["decode"]
    eager_s = _timed(eager)
    loop = getattr(family, "decode_loop", None)
    unrolled_s = unrolled_compile_s = None
    if loop is not None:  # a streamed decode (CogVideoX, Wan): also one program for all frames, for comparison
        family.decode_loop = "unrolled"
        family.decode(latents)
        unrolled_compile_s = family.timings.compile["decode"] - compiled
        unrolled_s = _timed(lambda: family.decode(latents))
        family.decode_loop = loop
    return {"ours_run_s_median": ours_s, "diffusers_eager_s_median": eager_s, "ratio_ours_over_eager": ours_s / eager_s,
            "loop": loop, "compile_s": compiled, "memory_analysis": dict(program.memory),
            "unrolled_run_s_median": unrolled_s, "unrolled_compile_s": unrolled_compile_s}


# --- loading weights ------------------------------------------------------------------------------------------------
_LOAD_CHILD = r"""
import json, os, sys, threading, time
import torch

how, path, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
if how == "diffusers-folder":  # as users without accelerate run it (our CLI never needs it)
    sys.modules["accelerate"] = sys.modules["peft"] = None  # not installed (peft needs accelerate)

def rss():  # (anonymous, file-backed) resident bytes
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith("Rss"))
    return int(fields["RssAnon"].split()[0]) * 1024, int(fields["RssFile"].split()[0]) * 1024
from tpu_runtime.engine.family import builder
from tpu_runtime.engine.weights import TensorSource, keep_fp32_modules, load_into_meta_module, safetensors_files
from tpu_runtime.families.wan.files import transformer_names
from diffusers import CogVideoXTransformer3DModel, WanTransformer3DModel
before, peak, done = rss(), [0, 0], threading.Event()
def watch():
    while not done.is_set():
        now = rss()
        peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
        time.sleep(0.005)
watcher = threading.Thread(target=watch); watcher.start()
start = time.perf_counter()
if how == "wan-file":
    config, names = transformer_names(path)
    model = load_into_meta_module(lambda: WanTransformer3DModel(**config), TensorSource([path]), names, dtype,
                                  "bench", keep_fp32=keep_fp32_modules(WanTransformer3DModel, dtype))
elif how == "cogvideox-folder":  # what CogVideoXFamily does for its transformer
    config = json.loads(open(os.path.join(path, "config.json")).read())
    source = TensorSource(safetensors_files(__import__("pathlib").Path(path)))
    model = load_into_meta_module(builder(CogVideoXTransformer3DModel, config), source,
                                  {k: k for k in source.keys()}, dtype, "bench",
                                  keep_fp32=keep_fp32_modules(CogVideoXTransformer3DModel, dtype))
elif how.startswith("ltx2-"):  # LTX-2 opened from its files or folder, the transformer placed on the devices
    from tpu_runtime.families.ltx2.model import LTX2Family
    if how == "ltx2-folder":
        family = LTX2Family(path, dtype=sys.argv[3])
    else:
        folder = __import__("pathlib").Path(path)
        family = LTX2Family(files={"checkpoint": folder / f"ltx2_tiny_{how[5:]}.safetensors",
                                   "text_encoder": folder / f"gemma_tiny_{how[5:]}.safetensors"}, dtype=sys.argv[3])
    family._component("transformer")
    class model:  # what was placed
        def parameters():
            return [torch.empty(tuple(v.shape), dtype=torch.uint8, device="meta").expand(v.dtype.itemsize, *v.shape)
                    for v in family._states["transformer"].values()]
else:  # what CogVideoXFamily did before: diffusers' from_pretrained
    model = CogVideoXTransformer3DModel.from_pretrained(path, dtype=dtype)
seconds = time.perf_counter() - start
done.set(); watcher.join()
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"seconds": seconds, "anon_increase_mib": (peak[0] - before[0]) / 2**20,
                  "file_pages_increase_mib": (peak[1] - before[1]) / 2**20, "loaded_bytes": params}))
"""


def _load_in_child(how: str, path: Path, dtype: str) -> dict:
    """Load ``path`` the way ``how`` names in a fresh process: host seconds, peak memory, and whether anything
    mentioned accelerate on stderr."""
    proc = subprocess.run([sys.executable, "-c", _LOAD_CHILD, how, str(path), dtype], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "mentions_accelerate": "accelerate" in proc.stderr}


def bench_single_file_load(size_mb: int, dtypes=("bfloat16", "float32")) -> dict:
    """Write a random Wan transformer of about ``size_mb`` MB (fp16, original key names), then load it with our
    loader in fresh processes, once per run dtype: host seconds and peak host memory."""
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from ..families.wan.files import wan_transformer_to_original

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
        out[dtype] = _load_in_child("wan-file", path, dtype)
    path.unlink()
    return out


def bench_ltx2_file_load(size_mb: int, dtypes=("bfloat16",)) -> dict:
    """A tiny LTX-2.0 folder whose transformer is replaced by a random one of about ``size_mb`` MB in bfloat16 (16
    heads of 64, layers chosen for the size), written as ComfyUI's all-in-one checkpoint in bf16 and in fp8 (the
    blocks' matrices float8 with their scales, as the released fp8 file), and kept as its folder (float32): each
    opened in a fresh process and its transformer placed; host seconds and peak host memory."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    from ..families.ltx2.bench import export_comfy_files
    from ..families.ltx2.tiny import build_tiny_ltx2, transformer_config

    work = Path(tempfile.mkdtemp(prefix="tpu_video_load_"))
    folder = build_tiny_ltx2(work / "ltx2", "2.0", upsampler=False, fp8=True)
    config = dict(transformer_config("2.0"), num_attention_heads=16, attention_head_dim=64, cross_attention_dim=1024,
                  audio_num_attention_heads=16, audio_attention_head_dim=32, audio_cross_attention_dim=512)
    video, audio = 1024, 512  # per block: both streams' attentions (4 + 4 + 2 cross-modal) and feed-forwards
    per_layer = (2 * 4 * video * video + 2 * 4 * audio * audio + 2 * 4 * video * audio + 8 * video * video
                 + 8 * audio * audio) * 2
    config["num_layers"] = max(1, round(size_mb * 2**20 / per_layer))
    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(**config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder / "transformer")
    del model
    files = {dtype: export_comfy_files(folder, work / "files", dtype) for dtype in ("bf16", "fp8")}
    out = {"layers": config["num_layers"], "folder_mb": sum(
        f.stat().st_size for f in (folder / "transformer").iterdir()) / 2**20,
        "checkpoint_mb": {k: v["checkpoint"].stat().st_size / 2**20 for k, v in files.items()}}
    out["fp8_dequantise"] = _fp8_dequantise_speed(files["fp8"]["checkpoint"])
    for dtype in dtypes:
        out[dtype] = {"bf16": _load_in_child("ltx2-bf16", work / "files", dtype),
                      "fp8": _load_in_child("ltx2-fp8", work / "files", dtype),
                      "folder": _load_in_child("ltx2-folder", folder, dtype)}
    return out


def _fp8_dequantise_speed(path: Path, repeats: int = 3) -> dict:
    """Seconds per fp8 weight of a checkpoint turned into bfloat16 x scale: the loader's table (``TensorSource.get``)
    against torch's elementwise ``(q.float() * scale).to(bfloat16)``, in this process, medians of ``repeats``."""
    import torch

    from ..engine.weights import TensorSource

    source = TensorSource([path])
    keys = [k for k in source.keys() if source.raw(k).dtype == torch.float8_e4m3fn]
    weights = sum(source.raw(k).numel() for k in keys)

    def table():
        for k in keys:
            source.get(k, torch.bfloat16)

    def elementwise():
        for k in keys:
            (source.raw(k).float() * source.raw(k[: -len("weight")] + "weight_scale").float()).to(torch.bfloat16)

    return {"weights": weights, "table_s": _timed(table, repeats), "torch_s": _timed(elementwise, repeats)}


def print_ltx2_load_table(r: dict) -> None:
    print(f"\nLTX-2.0 transformer of {r['layers']} blocks (16 heads of 64): all-in-one checkpoint bf16 "
          f"{r['checkpoint_mb']['bf16']:.0f} MiB, fp8 {r['checkpoint_mb']['fp8']:.0f} MiB, diffusers folder "
          f"{r['folder_mb']:.0f} MiB float32; each opened in a fresh process, the transformer placed")
    print(f"  {'run dtype':<10} {'source':<22} {'host s':>7} {'placed MiB':>11} {'peak allocated MiB':>19}")
    for dtype in ("bfloat16", "float32"):
        for way, label in (("bf16", "checkpoint (bf16)"), ("fp8", "checkpoint (fp8)"), ("folder", "folder (fp32)")):
            if dtype in r:
                x = r[dtype][way]
                print(f"  {dtype:<10} {label:<22} {x['seconds']:>7.2f} {x['loaded_bytes'] / 2**20:>11.0f} "
                      f"{x['anon_increase_mib']:>19.0f}")
    print("  (on a CPU backend the placed copy is host memory too)")
    d = r["fp8_dequantise"]
    print(f"  fp8 -> bfloat16 x scale, {d['weights'] / 1e6:.0f}M weights in this process: the loader's table "
          f"{d['table_s'] * 1e9 / d['weights']:.2f} ns a weight, torch elementwise "
          f"{d['torch_s'] * 1e9 / d['weights']:.2f} ns ({d['torch_s'] / d['table_s']:.1f}x)")


def bench_folder_load(size_mb: int, dtypes=("bfloat16", "float32")) -> dict:
    """Write a random CogVideoX transformer folder of about ``size_mb`` MB (float32 safetensors, diffusers
    layout), then load it in fresh processes, once per run dtype, two ways: the family's loader (built on
    ``meta``, each tensor assigned once) and diffusers' ``from_pretrained`` without accelerate (how CogVideoX
    loaded before the families shared one loading path)."""
    from diffusers import CogVideoXTransformer3DModel

    work = Path(tempfile.mkdtemp(prefix="tpu_video_load_"))
    heads, head_dim = 16, 64  # a narrow CogVideoX-5b: RoPE, 1024 wide; layers chosen for the size
    dim = heads * head_dim
    layers = max(1, round(size_mb * 2**20 / ((4 * dim * dim + 8 * dim * dim + 12 * 512 * dim) * 4)))
    model = CogVideoXTransformer3DModel(num_attention_heads=heads, attention_head_dim=head_dim, num_layers=layers,
                                        use_rotary_positional_embeddings=True, text_embed_dim=1024)
    folder = work / "transformer"
    model.save_pretrained(folder)
    del model
    out = {"folder_mb": sum(f.stat().st_size for f in folder.iterdir()) / 2**20, "layers": layers}
    for dtype in dtypes:
        out[dtype] = {"ours": _load_in_child("cogvideox-folder", folder, dtype),
                      "from_pretrained": _load_in_child("diffusers-folder", folder, dtype)}
    return out


def _machine(runtime=None) -> dict:
    from ..engine.runtime import get_runtime

    runtime = runtime or get_runtime()
    return {"platform": platform.platform(), "processor": platform.machine(), "backend": runtime.backend,
            "devices": len(runtime.devices), "device_kind": runtime.devices[0].device_kind}


def bench_lora_merge(widths=(256, 512, 1024), ranks=(4, 32, 128), layers: int = 4, repeats: int = 3) -> dict:
    """Time merging a LoRA into tiny random Wan transformers of several widths (every attention and feed-forward
    linear of every block, the way the distillation LoRAs touch them) at several ranks: the first merge (file
    read, host copy of the loaded weights, merge programs compiled) and a change of strength (no compile)."""
    import numpy as np

    from ..engine.lora import LoraSpec
    from ..engine.runtime import compile_stats
    from ..families.wan.model import WanFamily
    from ..families.wan.tiny import TinyWanSpec, build_tiny_lora, build_tiny_wan

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
        unrolled = (f" ({v['loop']}); all frames in one unrolled program: {v['unrolled_run_s_median']:.3f} s, "
                    f"compile {v['unrolled_compile_s']:.2f} s") if v["loop"] else " (one program)"
        print(f"\n  VAE decode (same latents, median of 3): ours {v['ours_run_s_median']:.3f} s, diffusers eager "
              f"{v['diffusers_eager_s_median']:.3f} s, ratio {v['ratio_ours_over_eager']:.2f}; compile "
              f"{v['compile_s']:.2f} s{unrolled}")
    print(f"\n  peak host memory {r['peak_host_mib']:.0f} MiB")


def print_folder_load_table(r: dict) -> None:
    print(f"\nCogVideoX transformer folder: {r['folder_mb']:.0f} MiB float32 ({r['layers']} layers, 1024 wide), "
          "each load in a fresh process")
    print(f"  {'run dtype':<10} {'loader':<28} {'host s':>7} {'peak allocated MiB':>19} {'mentions accelerate':>20}")
    for dtype in ("bfloat16", "float32"):
        for way, label in (("ours", "ours (meta, one copy)"), ("from_pretrained", "diffusers from_pretrained")):
            if dtype in r:
                x = r[dtype][way]
                print(f"  {dtype:<10} {label:<28} {x['seconds']:>7.2f} {x['anon_increase_mib']:>19.0f} "
                      f"{str(x['mentions_accelerate']):>20}")


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
    from ..families import registry

    p.add_argument("--generation", choices=list(registry.demos()), default="2b", help="for the tiny model")
    p.add_argument("--height", type=int, help="default: the tiny model's (64)")
    p.add_argument("--width", type=int, help="default: the tiny model's (96; 64 for CogVideoX 1.5)")
    p.add_argument("--frames", type=int, help="default: the tiny model's (9; 17 for CogVideoX 1.5)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps of each generation")
    p.add_argument("--repeats", type=int, default=2, help="warm runs after the cold one")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on TPU/GPU, float32 on CPU")
    p.add_argument("--load-file-mb", type=int, help="instead: time loading a single-file Wan transformer of this size "
                   "(--generation ltx2: LTX-2's checkpoint in bf16 and fp8 against its folder)")
    p.add_argument("--load-folder-mb", type=int, help="instead: time loading a CogVideoX transformer folder of this "
                   "size, ours against diffusers' from_pretrained")
    p.add_argument("--lora-merge", action="store_true", help="instead: time merging LoRAs of several ranks into tiny "
                   "Wan transformers of several widths")
    p.add_argument("--cache", choices=["magcache", "first-block"], help="instead: the sampler with and without "
                   "this step cache, in one process (use --steps 50)")
    p.add_argument("--cache-threshold", type=float, help="with --cache (default: diffusers')")
    p.add_argument("--mag-ratios", help="with --cache magcache (default: the model's published ones; a tiny model: "
                   "Wan 2.1 T2V 1.3B's)")
    p.add_argument("--comfy-native", action="store_true", help="instead: ComfyUI's own sampling of its own Wan model, "
                   "natively and through TPU Diffusion Model (needs --comfy)")
    p.add_argument("--comfy", metavar="COMFYUI_DIR", help="with --comfy-native: the ComfyUI folder")
    p.add_argument("--comfy-file", help="with --comfy-native: a Wan diffusion model file of ComfyUI's (default: a "
                   "tiny random-weight one built on the spot)")
    p.add_argument("--json", help="also write the results here")


def main(args) -> int:
    if args.load_file_mb and args.generation == "ltx2":
        r = bench_ltx2_file_load(args.load_file_mb)
        print_ltx2_load_table(r)
    elif args.load_file_mb:
        r = bench_single_file_load(args.load_file_mb)
        print_load_table(r)
    elif args.load_folder_mb:
        r = bench_folder_load(args.load_folder_mb)
        print_folder_load_table(r)
    elif args.lora_merge:
        r = bench_lora_merge()
        print_lora_table(r)
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
