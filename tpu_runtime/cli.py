"""``python -m tpu_runtime generate|demo|bench``: the staged pipeline from the command line.

generate  runs encode → sample → decode (or one of them, from the files of the stage before) and writes
          generation_config.json, stage1_embeddings.safetensors, stage2_latents.safetensors, frames.safetensors
          and output_video.mp4 into --output-dir.
demo      builds a tiny random-weight CogVideoX model on the spot and runs generate on it.
bench     times every stage and counts compiles against diffusers eager on the same weights (see bench.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tpu_runtime")

STAGES = ("all", "encode", "sample", "decode")


@dataclass
class GenerateRequest:
    model: str
    output_dir: str
    prompt: str | None = None
    negative_prompt: str = ""
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    steps: int = 50
    guidance: float = 6.0
    seed: int = 0
    scheduler: str | None = None
    dynamic_cfg: bool = False
    dtype: str = "auto"
    fps: int = 8
    stage: str = "all"
    vae_tiling: bool = False
    group_norm: str = "stock"
    cache_dir: str | None = None
    mesh: str | None = None
    attention: str = "auto"
    block_q: int = 3328
    block_kv: int = 2816
    block_kv_compute: int = 256
    exp2: bool = False
    fsdp: bool = False
    vae_sharding: str = "replicated"

    def attention_config(self):
        from .attention import AttentionConfig

        return AttentionConfig(impl=self.attention, block_q=self.block_q, block_kv=self.block_kv,
                               block_kv_compute=self.block_kv_compute, exp2=self.exp2)


def native_size(family) -> tuple[int, int, int]:
    """(height, width, frames) the model was trained at, from its transformer config."""
    c = family.transformer_config
    s = family.vae_scale_spatial
    return c["sample_height"] * s, c["sample_width"] * s, c["sample_frames"]


def generate(req: GenerateRequest, family=None) -> dict:
    """Run the requested stage(s); return the generation config written to the output folder."""
    from . import stage_files as sf
    from .cogvideox import CogVideoXFamily, SampleSettings
    from .errors import InputError, StageFileError
    from .runtime import compile_stats, get_runtime
    from .video import write_mp4

    if req.stage not in STAGES:
        raise InputError(f"--stage must be one of {STAGES}, got {req.stage!r}")
    out = Path(req.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    wall_start = time.perf_counter()
    runtime = get_runtime(cache_dir=req.cache_dir)
    stats_before = compile_stats()
    family = family or CogVideoXFamily(req.model, dtype=req.dtype, runtime=runtime, mesh=req.mesh,
                                       attention=req.attention_config(), fsdp=req.fsdp,
                                       vae_sharding=req.vae_sharding)

    native_h, native_w, native_f = native_size(family)
    height, width, frames = req.height or native_h, req.width or native_w, req.frames or native_f
    if req.stage == "decode":
        latents = sf.load_latents(out)
        family.check_made_here(latents)
        for name, asked, saved in (("height", req.height, latents.height), ("width", req.width, latents.width),
                                   ("frames", req.frames, latents.num_frames)):
            if asked is not None and asked != saved:
                raise StageFileError(
                    f"--{name} {asked} differs from the {saved} the latents in {out} were sampled at: drop --{name} "
                    "or re-run --stage sample"
                )
        height, width, frames = latents.height, latents.width, latents.num_frames
    family.validate(height, width, frames)
    if req.fps < 1:
        raise InputError(f"--fps {req.fps} must be at least 1")

    config = {
        "model": str(family.path), "model_signature": family.signature, "generation": family.generation,
        "dtype": family.dtype_name, "backend": runtime.backend, "devices": len(runtime.devices),
        "mesh": str(family.mesh_spec), "attention": family.attention.impl, "height": height, "width": width, "frames": frames, "fps": req.fps,
    }
    if req.stage in ("all", "encode"):
        if not req.prompt:
            raise InputError("--prompt is required for --stage all and --stage encode")
        embeddings = family.encode(req.prompt, req.negative_prompt)
        sf.save_embeddings(out, embeddings)
        config.update(prompt=req.prompt, negative_prompt=req.negative_prompt)
    if req.stage in ("all", "sample"):
        if req.stage == "sample":
            embeddings = sf.load_embeddings(out)
        settings = SampleSettings(height, width, frames, req.steps, req.guidance, req.seed, req.scheduler, req.dynamic_cfg)
        latents = family.sample(embeddings, settings, on_step=_log_step)
        sf.save_latents(out, latents)
        config.update(steps=req.steps, guidance=req.guidance, seed=req.seed, dynamic_cfg=req.dynamic_cfg,
                      scheduler=req.scheduler or "model default")
    if req.stage in ("all", "decode"):
        frames_tensor = family.decode(latents, tiling=req.vae_tiling, group_norm=req.group_norm)
        sf.save_frames(out, frames_tensor)
        write_mp4(frames_tensor, out / sf.VIDEO_FILE, fps=req.fps)
        config.update(vae_tiling=req.vae_tiling, group_norm=req.group_norm)

    t = family.timings
    stats = compile_stats().since(stats_before)
    timings = {
        "load_s": round(t.load, 3),
        "compile_s": {k: round(v, 3) for k, v in t.compile.items()},
        "run_s": {k: round(v, 3) for k, v in t.run.items()},
        "xla_compiles": dict(t.compiles),
        "persistent_cache_hits": dict(t.cache_hits),
        "xla_compiles_total": stats.xla_compiles,
        "persistent_cache_hits_total": stats.persistent_cache_hits,
        "wall_s": round(time.perf_counter() - wall_start, 3),
    }
    return sf.update_config(out, **config, timings={req.stage: timings})


def _log_step(i: int, total: int) -> None:
    log.info("step %d/%d", i, total)


def print_summary(config: dict, stage: str, file=sys.stdout) -> None:
    t = config["timings"][stage]
    print(f"\nTiming summary ({config['backend']}, {config['devices']} device(s), {config['dtype']}):", file=file)
    print(f"  {'stage':<8} {'compile s':>10} {'run s':>10} {'XLA compiles':>13} {'cache hits':>11}", file=file)
    print(f"  {'load':<8} {'':>10} {t['load_s']:>10.2f}", file=file)
    for name in ("encode", "sample", "decode"):
        if name in t["run_s"]:
            print(f"  {name:<8} {t['compile_s'].get(name, 0):>10.2f} {t['run_s'][name]:>10.2f} "
                  f"{t['xla_compiles'].get(name, 0):>13} {t['persistent_cache_hits'].get(name, 0):>11}", file=file)
    print(f"  total wall {t['wall_s']:.2f} s; all XLA programs: {t['xla_compiles_total']} compiled, "
          f"{t['persistent_cache_hits_total']} from the persistent cache", file=file)


def _add_generate_args(p: argparse.ArgumentParser, demo: bool = False) -> None:
    if not demo:
        p.add_argument("--model", required=True, help="diffusers CogVideoX folder (or hub id, with network)")
        p.add_argument("--prompt", help="what the video shows (needed for --stage all and encode)")
    p.add_argument("--negative-prompt", default="", help="what to steer away from (default: empty)")
    p.add_argument("--height", type=int, help="pixels, multiple of 16 (default: the model's native)")
    p.add_argument("--width", type=int, help="pixels, multiple of 16 (default: the model's native)")
    p.add_argument("--frames", type=int, help="8N+1 for 2b/5b (49 native), 16N+1 for 1.5 (81 native)")
    p.add_argument("--steps", type=int, default=4 if demo else 50)
    p.add_argument("--guidance", type=float, default=6.0, help="CFG scale; 1 or less turns CFG off")
    p.add_argument("--seed", type=int, default=0, help="same seed, same video as diffusers with this seed")
    p.add_argument("--scheduler", choices=["ddim", "dpm"], help="default: the model folder's scheduler")
    p.add_argument("--dynamic-cfg", action="store_true", help="CogVideoX's cosine guidance schedule")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on TPU/GPU, float32 on CPU")
    p.add_argument("--fps", type=int, default=8)
    p.add_argument("--stage", choices=STAGES, default="all",
                   help="sample starts from the stage-1 file in --output-dir, decode from the stage-2 file")
    p.add_argument("--vae-tiling", action="store_true", help="decode in spatial tiles (large frames)")
    p.add_argument("--group-norm", choices=["stock", "jnp_var"], default="stock",
                   help="VAE GroupNorm lowering: torchax's own or one vectorised jnp.var reduction")
    p.add_argument("--cache-dir", help="persistent XLA compilation cache (default: $TPU_VIDEO_CACHE_DIR or "
                   "~/.cache/tpu_video_nodes/xla_cache)")
    p.add_argument("--mesh", help="device mesh as dp=N,sp=N,tp=N (product = device count; default: CFG batch "
                   "on dp, heads on tp, e.g. dp=2,sp=1,tp=4 on 8 chips)")
    p.add_argument("--attention", choices=["auto", "splash", "cudnn", "blockwise", "reference"], default="auto",
                   help="auto: splash on TPU, cuDNN on GPU, blockwise elsewhere; splash off TPU runs in Pallas "
                   "interpret mode (slow, for checking)")
    p.add_argument("--block-q", type=int, default=3328, help="splash query block")
    p.add_argument("--block-kv", type=int, default=2816, help="splash key/value block")
    p.add_argument("--block-kv-compute", type=int, default=256, help="splash key/value compute block")
    p.add_argument("--exp2", action="store_true", help="splash in base-2 form (exp2 kernel)")
    p.add_argument("--fsdp", action="store_true", help="also split weights without a tensor-parallel rule over dp")
    p.add_argument("--vae-sharding", choices=["replicated", "width"], default="replicated",
                   help="width: split the VAE decode over devices along the frame width")
    p.add_argument("--output-dir", required=True)
    p.add_argument("-v", "--verbose", action="store_true")


def _request(args: argparse.Namespace, **overrides) -> GenerateRequest:
    fields = GenerateRequest.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields}
    values.update(overrides)
    return GenerateRequest(**values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_args(sub.add_parser("generate", help="text to video with a CogVideoX model folder"))
    demo = sub.add_parser("demo", help="build a tiny RANDOM-weight model and run generate on it (no download)")
    _add_generate_args(demo, demo=True)
    demo.add_argument("--generation", choices=["2b", "5b", "1.5"], default="2b")
    demo.add_argument("--prompt", default="a panda playing a guitar in a bamboo forest at sunset")
    from . import bench

    bench.add_args(sub.add_parser("bench", help="time stages, count compiles, compare with diffusers eager"))
    args = parser.parse_args(argv)

    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if verbose or args.command == "demo" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("tpu_runtime").setLevel(logging.INFO)
    from .errors import InputError

    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "bench":
            return bench.main(args)
        req = _request(args)
        config = generate(req)
        print_summary(config, req.stage)
        print(f"\nwrote {req.output_dir}")
        return 0
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace) -> int:
    from .tiny import build_tiny_cogvideox

    out = Path(args.output_dir)
    model_dir = out / f"tiny_random_cogvideox_{args.generation}"
    banner = ("NOTE: the demo model has RANDOM weights, built on the spot: the video is noise. It shows the "
              "pipeline runs end to end on this machine; use a real CogVideoX folder with `generate` for real video.")
    print(banner)
    build_tiny_cogvideox(model_dir, args.generation)
    frames = args.frames or (17 if args.generation == "1.5" else 9)
    width = args.width or (64 if args.generation == "1.5" else 96)  # 1.5 has positions up to its 64x64 here
    req = _request(args, model=str(model_dir), height=args.height or 64, width=width, frames=frames)
    config = generate(req)
    print_summary(config, req.stage)
    print(f"\n{banner}\nwrote {out / 'output_video.mp4'} and the stage files in {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
