"""``tpu-video`` (or ``python -m tpu_runtime``) ``generate|demo|bench|plan|worker``: the staged pipeline from the
command line.

generate  text or image to video: runs encode → sample → decode (or one of them, from the files of the stage
          before) and writes generation_config.json, stage1_embeddings.safetensors, stage2_latents.safetensors,
          frames.safetensors and output_video.mp4 into --output-dir. --model takes a diffusers folder (CogVideoX,
          Wan); Wan also loads from ComfyUI's single files (--transformer [--transformer-2] --text-encoder --vae).
demo      builds a tiny RANDOM-weight model on the spot and runs generate on it (no download; the video is noise).
bench     times every stage and counts compiles against diffusers eager on the same weights.
plan      compiles every stage for a TPU slice this machine does not have and reports per-chip memory, collectives,
          compile time and whether it fits.
worker    joins a multi-host slice and runs what its first process (ComfyUI or generate) asks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .generate import STAGES, GenerateRequest, generate, print_summary  # noqa: F401 - the CLI's public names
from .options import add_cache_args, add_file_args, file_args

log = logging.getLogger("tpu_runtime")


class _HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, where it has one and the help does not say it already."""

    def _get_help_string(self, action):
        help = action.help or ""
        if action.default not in (None, False, [], argparse.SUPPRESS) and "default" not in help and \
                action.option_strings:
            help += " (default: %(default)s)"
        return help


def parser_for(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand's parser: options are exact (no abbreviations: ``--cache`` is never taken for ``--cache-dir``)
    and their help shows their defaults."""
    return sub.add_parser(name, help=help, description=help, allow_abbrev=False, formatter_class=_HelpWithDefaults)


DEMO_PROMPT = "a panda playing a guitar"  # fits the tiny models' 16 text tokens


def _add_generate_args(p: argparse.ArgumentParser, demo: bool = False) -> None:
    if not demo:
        p.add_argument("--model", help="a diffusers model folder (or hub id, with network)")
        p.add_argument("--prompt", help="what the video shows (needed for --stage all and encode)")
        add_file_args(p)
        p.add_argument("--image", help="image-to-video: the first frame (PNG/JPEG/WebP), resized to the video's "
                       "size; needed by I2V models, optional for Wan TI2V-5B")
        p.add_argument("--last-image", help="Wan FLF2V: the last frame")
        p.add_argument("--lora", dest="loras", action="append", default=[], metavar="FILE[:STRENGTH]",
                       help="a LoRA merged into the transformer (Wan 2.2 A14B: the high-noise expert), strength 1 "
                       "unless given; repeat for several")
        p.add_argument("--lora-2", dest="loras_2", action="append", default=[], metavar="FILE[:STRENGTH]",
                       help="Wan 2.2 A14B: a LoRA merged into the low-noise expert; LTX-2 with --two-stage: a LoRA "
                       "for the refine stage only (e.g. the distilled LoRA); repeat for several")
    p.add_argument("--negative-prompt", default="", help="what to steer away from (default: empty)")
    size = "the tiny model's (64x96x9; 64x64x17 for 1.5)" if demo else "the model's native size"
    p.add_argument("--height", type=int, help=f"pixels, multiple of 16 (32 for Wan TI2V-5B); default: {size}")
    p.add_argument("--width", type=int, help=f"pixels, multiple of 16 (32 for Wan TI2V-5B); default: {size}")
    p.add_argument("--frames", type=int, help="CogVideoX 2b/5b 8N+1 (49), 1.5 16N+1 (81); Wan 4N+1 (81, "
                   f"TI2V-5B 121); default: {size}")
    p.add_argument("--steps", type=int, default=4 if demo else 50, help="denoising steps")
    p.add_argument("--guidance", type=float, help="CFG scale; 1 or less turns CFG off (default: 6 CogVideoX, "
                   "5 Wan)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same video as diffusers with this seed")
    p.add_argument("--scheduler", choices=["ddim", "dpm", "unipc", "euler", "euler_simple"],
                   help="CogVideoX: ddim|dpm; Wan: unipc|euler|euler_simple (flow matching; euler_simple: "
                   "ComfyUI's simple spacing, for the 4-step lightx2v LoRAs); default: the model's")
    p.add_argument("--dynamic-cfg", action="store_true", help="CogVideoX's cosine guidance schedule")
    p.add_argument("--shift", type=float, help="Wan: flow shift (default: the model's scheduler config)")
    p.add_argument("--guidance-2", type=float, help="Wan 2.2 A14B: guidance of the low-noise expert "
                   "(default: --guidance)")
    p.add_argument("--boundary", type=float, help="Wan 2.2 A14B: expert switch as a fraction of the 1000 "
                   "training timesteps (default: the model's, 0.875)")
    ltx2 = p.add_argument_group("LTX-2 (video with sound; each left out: the model's default, as diffusers')")
    ltx2.add_argument("--audio-guidance", type=float, help="CFG scale of the sound (default 7)")
    ltx2.add_argument("--stg-scale", type=float, help="spatio-temporal guidance, video and sound (default 1; 0 "
                      "turns it off)")
    ltx2.add_argument("--modality-scale", type=float, help="modality-isolation guidance (default 3; 1 turns it off)")
    ltx2.add_argument("--guidance-rescale", type=float, help="rescale of the guided prediction (default 0.7; 0 "
                      "turns it off)")
    ltx2.add_argument("--frame-rate", type=float, help="frames per second the video is made for: sets the sound's "
                      "length and the positions (default 24; also the mp4's unless --fps)")
    ltx2.add_argument("--sigmas", choices=["default", "distilled", "stage2"], help="sigma schedule: the model's "
                      "(default), the distilled model's 8 steps, the refine stage's 3")
    if not demo:
        ltx2.add_argument("--upsampler", help="the spatial latent upsampler's folder (default: the model's "
                          "latent_upsampler/)")
    ltx2.add_argument("--two-stage", action="store_true", help="LTX-2's recipe: sample at half the width and "
                      "height, upsample the latents x2, refine 3 steps (stage-2 sigmas, one pass a step; --lora-2 adds LoRAs to "
                      "this stage only)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on TPU/GPU, float32 on CPU")
    p.add_argument("--fps", type=int, help="default: the model's (8 CogVideoX, 16 CogVideoX1.5 and Wan, "
                   "24 TI2V-5B)")
    add_cache_args(p)
    p.add_argument("--stage", choices=STAGES, default="all",
                   help="sample starts from the stage-1 file in --output-dir, decode from the stage-2 file")
    p.add_argument("--vae-tiling", action="store_true", help="CogVideoX: decode in spatial tiles (large frames)")
    p.add_argument("--group-norm", choices=["stock", "jnp_var"], default="stock",
                   help="CogVideoX VAE GroupNorm lowering: torchax's own or one vectorised jnp.var reduction")
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
    p.add_argument("--fsdp", action="store_true", help="also split every weight matrix over dp (less memory per "
                   "chip; each layer's weights are gathered before use)")
    p.add_argument("--vae-sharding", choices=["auto", "width", "replicated"], default="auto",
                   help="width: split the VAE decode over the devices along the frame width (and the height with "
                   "the axes the width leaves); replicated: every device decodes the whole video; auto: width on "
                   "more than one device")
    if demo:
        p.add_argument("--output-dir", default="demo_output", help="where the stage files, the mp4 and the tiny "
                       "model go")
    else:
        p.add_argument("--output-dir", required=True, help="where the stage files, frames, mp4 and "
                       "generation_config.json go (a later --stage reads the earlier stages' files from here)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every stage's progress")


def _request(args: argparse.Namespace, **overrides) -> GenerateRequest:
    fields = GenerateRequest.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["files"] = file_args(args)
    values.update(overrides)
    return GenerateRequest(**values)


def build_parser() -> argparse.ArgumentParser:
    """Every command and its options (``--help`` shows each option's default)."""
    prog = "tpu-video" if Path(sys.argv[0]).name == "tpu-video" else "python -m tpu_runtime"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_args(parser_for(sub, "generate", "text or image to video with a model folder or ComfyUI's files"))
    demo = parser_for(sub, "demo", "build a tiny RANDOM-weight model and run generate on it (no download; the "
                      "video is noise)")
    _add_generate_args(demo, demo=True)
    from ..families import registry

    demo.add_argument("--generation", choices=list(registry.demos()), default="2b",
                      help="which architecture the tiny model imitates")
    demo.add_argument("--prompt", default=DEMO_PROMPT, help="what the (noise) video is asked to show")
    from . import bench

    bench.add_args(parser_for(sub, "bench", "time stages, count compiles, compare with diffusers eager"))
    from . import plan

    plan.add_args(parser_for(sub, "plan", "compile every stage for a TPU slice (no TPU needed) and report "
                             "per-chip memory and whether it fits"))
    worker = parser_for(sub, "worker", "on every host of a multi-host slice but the first: join it and run what "
                        "the first process (ComfyUI or generate, with TPU_VIDEO_MULTIHOST=1) asks")
    worker.add_argument("--coordinator", help="host:port of the first process (default: $TPU_VIDEO_COORDINATOR; on a "
                        "TPU VM JAX finds it)")
    worker.add_argument("--processes", type=int, help="processes in the slice, one per host (default: "
                        "$TPU_VIDEO_PROCESSES or JAX's TPU detection)")
    worker.add_argument("--process-id", type=int, help="this host's index, 1.. (default: $TPU_VIDEO_PROCESS_ID or "
                        "JAX's TPU detection)")
    worker.add_argument("--cache-dir", help="persistent XLA compilation cache (default as for generate)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if verbose or args.command == "demo" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("tpu_runtime").setLevel(logging.INFO)
    from ..errors import InputError, SliceError

    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "bench":
            from . import bench

            return bench.main(args)
        if args.command == "plan":
            from . import plan

            return plan.run(args)
        if args.command == "worker":
            return _worker(args)
        req = _request(args)
        config = generate(req)
        print_summary(config, req.stage)
        print(f"\nwrote {req.output_dir}")
        return 0
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SliceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _worker(args: argparse.Namespace) -> int:
    from ..engine.runtime import get_runtime
    from ..errors import InputError
    from ..multihost.worker import serve

    if args.process_id == 0:
        raise InputError("--process-id 0 is the first process: run ComfyUI or `generate` there with "
                         "TPU_VIDEO_MULTIHOST=1, and `worker` on the other hosts")
    os.environ["TPU_VIDEO_MULTIHOST"] = "1"
    os.environ["TPU_VIDEO_WORKER"] = "1"  # not the slice's first process: its id comes from --process-id or JAX
    for flag, name in (("coordinator", "TPU_VIDEO_COORDINATOR"), ("processes", "TPU_VIDEO_PROCESSES"),
                       ("process_id", "TPU_VIDEO_PROCESS_ID")):
        if getattr(args, flag) is not None:
            os.environ[name] = str(getattr(args, flag))
    runtime = get_runtime(cache_dir=args.cache_dir)
    if runtime.slice.is_driver:
        raise InputError("this host is the slice's first process (id 0): run ComfyUI or `generate` here with "
                         "TPU_VIDEO_MULTIHOST=1, and `worker` on the other hosts")
    from ..multihost.transport import quiet_shutdown

    code = serve(runtime, runtime.slice)
    runtime.slice.close()
    quiet_shutdown(leave=code == 0)
    return code


def _demo(args: argparse.Namespace) -> int:
    from ..families import registry

    spec, demo = registry.demos()[args.generation]
    out = Path(args.output_dir)
    variant = args.generation.lower().removeprefix(spec.name).strip("._-")
    model_dir = out / f"tiny_random_{spec.name}{'_' + variant if variant else ''}"
    banner = (f"NOTE: the demo model has RANDOM weights, built on the spot: the video is noise. It shows the "
              f"pipeline runs end to end on this machine; use a real {spec.display_name} model with `generate` for "
              "real video.")
    print(banner)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Writing model shards" bars of the tiny text encoder's save
    spec.build_demo(args.generation, model_dir)
    req = _request(args, model=str(model_dir), height=args.height or demo.height, width=args.width or demo.width,
                   frames=args.frames or demo.frames)
    config = generate(req)
    print_summary(config, req.stage)
    print(f"\n{banner}\nwrote {out / 'output_video.mp4'} and the stage files in {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
