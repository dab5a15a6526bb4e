"""``tpu-video`` (or ``python -m tpu_runtime``) ``generate|demo|bench|plan|cache|worker``: the staged pipeline from
the command line.

generate  text or image to video: runs encode → sample → decode (or one of them, from the files of the stage
          before) and writes generation_config.json, stage1_embeddings.safetensors, stage2_latents.safetensors,
          frames.safetensors and output_video.mp4 into --output-dir. --model takes a diffusers folder; some
          families also load from ComfyUI's single files (their options below).
demo      builds a tiny RANDOM-weight model on the spot and runs generate on it (no download; the video is noise).
bench     times every stage and counts compiles against diffusers eager on the same weights.
plan      compiles every stage for a TPU slice this machine does not have and reports per-chip memory, collectives,
          compile time and whether it fits.
cache     shows or clears what is kept on disk between processes (the XLA cache, the programs saved for warm
          starts).
worker    joins a multi-host slice and runs what its first process (ComfyUI or generate) asks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .generate import STAGES, GenerateRequest, generate, print_summary  # noqa: F401 - the CLI's public names
from .options import add_cache_args, add_family_args, add_file_args, file_args

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
    from ..families import registry

    families = registry.FAMILIES
    by_family = lambda fact: ", ".join(f"{s.display_name} {fact(s)}" for s in families)  # noqa: E731
    if not demo:
        p.add_argument("--model", help="a diffusers model folder (or hub id, with network)")
        p.add_argument("--prompt", help="what the video shows (needed for --stage all and encode)")
        add_file_args(p)
        p.add_argument("--image", help="image-to-video: the first frame (PNG/JPEG/WebP), resized to the video's "
                       "size; needed by image-to-video models, optional for the models that take either")
        p.add_argument("--last-image", help="first-and-last-frame models: the last frame")
        p.add_argument("--lora", dest="loras", action="append", default=[], metavar="FILE[:STRENGTH]",
                       help="a LoRA merged into the transformer (a two-expert model's first, high-noise expert), "
                       "strength 1 unless given; repeat for several")
        p.add_argument("--lora-2", dest="loras_2", action="append", default=[], metavar="FILE[:STRENGTH]",
                       help="the second LoRA slot: a two-expert model's low-noise expert, or a recipe's later "
                       "sampling (e.g. a distilled LoRA for a refine stage); repeat for several")
    p.add_argument("--negative-prompt", default="", help="what to steer away from (default: empty)")
    size = "the tiny model's (" + ", ".join(f"{n} {d.height}x{d.width}x{d.frames}" for n, (_, d) in
                                            registry.demos().items()) + ")" if demo else "the model's native size"
    p.add_argument("--height", type=int, help=f"pixels, a multiple of 16 or of what the model needs (a wrong one is "
                   f"refused naming the nearest); default: {size}")
    p.add_argument("--width", type=int, help=f"pixels, as --height; default: {size}")
    p.add_argument("--frames", type=int, help="; ".join(f"{s.display_name} {s.nodes.sampler.frames_tip}"
                                                      for s in families) + f"; default: {size}")
    p.add_argument("--steps", type=int, default=4 if demo else None,
                   help="denoising steps" + ("" if demo else f" (default: the model's: {by_family(lambda s: s.sampling.steps)})"))
    p.add_argument("--guidance", type=float, help="CFG scale; 1 or less turns CFG off (default: "
                   f"{by_family(lambda s: f'{s.sampling.guidance:g}')})")
    p.add_argument("--seed", type=int, default=0, help="same seed, same video as diffusers with this seed")
    schedulers = list(dict.fromkeys(n for s in families for n in s.sampling.schedulers))
    p.add_argument("--scheduler", choices=schedulers, help="; ".join(
        f"{s.display_name}: {'|'.join(s.sampling.schedulers)}" for s in families if s.sampling.schedulers)
        + "; default: the model's")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on TPU/GPU, float32 on CPU")
    p.add_argument("--fps", type=int, help="the mp4's frames per second; default: the model's (the rate it was "
                   "trained at, or the one its settings make the video for)")
    add_cache_args(p)
    p.add_argument("--stage", choices=STAGES, default="all",
                   help="sample starts from the stage-1 file in --output-dir, decode from the stage-2 file")
    add_family_args(p, stages=("sample", "decode") if demo else ("sample", "decode", "open"))
    p.add_argument("--cache-dir", help="persistent XLA compilation cache, and the programs saved for later "
                   "processes in its programs/ folder (default: $TPU_VIDEO_CACHE_DIR or "
                   "~/.cache/tpu_video_nodes/xla_cache)")
    p.add_argument("--programs", metavar="DIR", help="also load the compiled programs plan --save wrote in DIR (as "
                   "$TPU_VIDEO_PROGRAMS does): nothing is traced or compiled for the sizes it planned")
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
    from ..families import registry

    fields = GenerateRequest.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in fields or registry.setting_by_dest(k) is not None}
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
    from . import cache

    cache.add_args(parser_for(sub, "cache", "show or clear what is cached on disk between processes: the XLA "
                              "compilation cache and the programs saved for warm starts"))
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
    from ..errors import AcceleratorUnavailable, InputError, SliceError

    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "bench":
            if args.comfy_native:
                return _bench_native(args)
            if args.restart:
                return _bench_restart(args)
            from . import bench

            return bench.main(args)
        if args.command == "plan":
            if args.comfy_model:
                if args.save:
                    raise InputError("--save writes our families' programs (--model); ComfyUI's own models "
                                     "(--comfy-model) are saved on the slice by their first run (the runtime's saved "
                                     "programs, docs/startup.md): leave --save out")
                return _plan_native(args)
            if args.comfy_weights != "bf16":
                raise InputError(f"--comfy-weights {args.comfy_weights} plans ComfyUI's own model classes: give "
                                 "--comfy-model (our families' --model reads its weights' format from its files)")
            from . import plan

            return plan.run(args)
        if args.command == "worker":
            return _worker(args)
        if args.command == "cache":
            from . import cache

            return cache.main(args)
        req = _request(args)
        config = generate(req)
        print_summary(config, req.stage)
        print(f"\nwrote {req.output_dir}")
        return 0
    except (InputError, AcceleratorUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SliceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _plan_native(args: argparse.Namespace) -> int:
    """``plan --comfy-model``: each topology given, the bridged step (and our family's beside it)."""
    import json
    from dataclasses import asdict

    from ..engine.attention import AttentionConfig
    from ..engine.validation import check_number
    from .plan_native import check_args, format_native_report, plan_native
    from .topology import parse_topology

    for name, value in (("--height", args.height), ("--width", args.width), ("--frames", args.frames),
                        ("--layers", args.layers)):
        check_number(name, value, minimum=1, integer=True, optional=True)
    check_args(args)
    attention = AttentionConfig(impl=args.attention, block_q=args.block_q, block_kv=args.block_kv,
                                block_kv_compute=args.block_kv_compute, exp2=args.exp2)
    from .plan import STAGES

    # every stage the architecture has unless --stages names some (the families' "image" has no native stage)
    stages = None if args.stages == ",".join(STAGES) else tuple(s.strip() for s in args.stages.split(",") if s.strip())
    reports = []
    for topology in [parse_topology(t) for t in args.topology.split(",")]:
        report = plan_native(args.comfy_model, args.comfy, topology, height=args.height, width=args.width,
                             frames=args.frames, guidance=args.guidance, mesh=args.mesh, layers=args.layers,
                             attention=attention, compare=not args.no_compare, stages=stages,
                             weights=args.comfy_weights, steps=args.steps)
        print(format_native_report(report), flush=True)
        reports.append(asdict(report))
        if args.json:
            Path(args.json).write_text(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    return 0 if all(r["fits"] for r in reports) else 3


def _bench_native(args: argparse.Namespace) -> int:
    """``bench --comfy-native``: ComfyUI's own sampling natively and through the bridge."""
    import json

    from .bench_native import bench_native, print_native_table

    r = bench_native(args.comfy, args.comfy_file, height=args.height or 64, width=args.width or 64,
                     frames=args.frames or 9, steps=args.steps, repeats=args.repeats)
    print_native_table(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _bench_restart(args: argparse.Namespace) -> int:
    """``bench --restart``: cold and warm starts, each in a fresh process (``restart.py``)."""
    import json

    from ..errors import InputError
    from .restart import format_restart, run_restart

    if args.restart_rounds < 1:
        raise InputError(f"--restart-rounds {args.restart_rounds}: give 1 or more")
    r = run_restart(args.comfy, layers=args.restart_layers, generation=args.generation, rounds=args.restart_rounds)
    print(format_restart(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
        print(f"\nwrote {args.json}")
    return 0


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
    from ..engine.runtime import get_runtime

    get_runtime(cache_dir=getattr(args, "cache_dir", None))  # the backend first: a TPU that cannot start stops here
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
