"""One generation request, run stage by stage for any family: what ``python -m tpu_runtime generate`` does, and
what ``bench`` and the tests call.

``open_model`` asks the family registry for what the user pointed at (a diffusers folder, or ComfyUI's single
files) and returns the loaded family; ``generate`` runs encode → sample → decode (or one stage, from the files of
the stage before) and writes the stage files, the frames, the mp4 and ``generation_config.json``.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("tpu_runtime")

STAGES = ("all", "encode", "sample", "decode")


@dataclass
class GenerateRequest:
    model: str | None
    output_dir: str
    prompt: str | None = None
    negative_prompt: str = ""
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    steps: int = 50
    guidance: float | None = None  # None: the family's usual (6 for CogVideoX, 5 for Wan)
    seed: int = 0
    scheduler: str | None = None
    dynamic_cfg: bool = False
    shift: float | None = None
    guidance_2: float | None = None
    boundary: float | None = None
    dtype: str = "auto"
    fps: int | None = None  # None: the model's (8 for CogVideoX, 16 for Wan, 24 for TI2V-5B)
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
    vae_sharding: str = "auto"
    files: dict[str, str] = field(default_factory=dict)  # single files by role (registry.file_roles), not --model
    loras: list[str] = field(default_factory=list)  # FILE[:STRENGTH], merged into the transformer
    loras_2: list[str] = field(default_factory=list)  # FILE[:STRENGTH], Wan 2.2 A14B's low-noise expert
    image: str | None = None  # image-to-video: the first frame
    last_image: str | None = None  # Wan FLF2V: the last frame
    clip_vision: str | None = None  # single-file Wan 2.1 I2V / FLF2V: models/clip_vision/clip_vision_h
    cache: str = "none"  # step caching: none | magcache | first-block (engine/stepcache.py)
    cache_threshold: float | None = None  # None: diffusers' default for the method
    cache_max_skip: int | None = None  # None: 3
    cache_retention: float | None = None  # None: 0.2
    mag_ratios: str | None = None  # comma-separated, or a JSON file; None: the model's published ones
    cache_calibrate: bool = False  # MagCache without skipping: writes mag_ratios.json
    # LTX-2 (None: the model's default; engine.stages.SampleSettings has the meaning of each)
    audio_guidance: float | None = None
    stg_scale: float | None = None
    modality_scale: float | None = None
    guidance_rescale: float | None = None
    frame_rate: float | None = None
    sigmas: str | None = None
    upsampler: str | None = None  # the spatial latent upsampler's folder (default: the model's latent_upsampler/)
    two_stage: bool = False  # LTX-2's recipe: sample at half size, upsample the latents x2, refine 3 steps

    LTX2_SETTINGS = ("audio_guidance", "stg_scale", "modality_scale", "guidance_rescale", "frame_rate", "sigmas")

    def lora_specs(self) -> tuple[tuple, tuple]:
        from ..engine.lora import parse_lora

        return tuple(parse_lora(x) for x in self.loras), tuple(parse_lora(x) for x in self.loras_2)

    def step_cache(self):
        from .options import step_cache

        return step_cache(self.cache, self.cache_threshold, self.cache_max_skip, self.cache_retention,
                          self.mag_ratios, self.cache_calibrate)

    def attention_config(self):
        from ..engine.attention import AttentionConfig

        return AttentionConfig(impl=self.attention, block_q=self.block_q, block_kv=self.block_kv,
                               block_kv_compute=self.block_kv_compute, exp2=self.exp2)


def open_model(req: GenerateRequest, runtime=None):
    """The family for ``req.model`` (a diffusers folder) or for ``req``'s single files, as the registry picks it."""
    from ..families import registry

    extra = {"upsampler": req.upsampler} if req.upsampler else {}
    return registry.open_model(req.model, req.files, dtype=req.dtype, runtime=runtime, mesh=req.mesh,
                               attention=req.attention_config(), fsdp=req.fsdp, vae_sharding=req.vae_sharding, **extra)


def check_request_numbers(req: GenerateRequest) -> None:
    """The request's numbers, each against its rule, before anything loads or runs. Leaving an option out (None)
    means the model's default; zero and negative values are mistakes, refused with the rule."""
    from ..engine.validation import check_number

    for name, value in (("height", req.height), ("width", req.width), ("frames", req.frames), ("fps", req.fps)):
        check_number(f"--{name}", value, minimum=1, integer=True, optional=True)
    check_number("--steps", req.steps, minimum=1, integer=True)
    check_number("--seed", req.seed, minimum=0, integer=True)
    check_number("--guidance", req.guidance, minimum=0.0, optional=True)
    check_number("--guidance-2", req.guidance_2, minimum=0.0, optional=True)
    check_number("--shift", req.shift, above=0.0, optional=True)
    check_number("--boundary", req.boundary, above=0.0, below=1.0, optional=True)
    check_number("--frame-rate", req.frame_rate, above=0.0, optional=True)


def _stage_size(req: GenerateRequest, family, out: Path) -> tuple[int, int, int]:
    """The video's size: what the request gives, else what the stage files it starts from were made at (a later
    stage never guesses: the embeddings record the size they were encoded for, the latents theirs), else the
    model's native size. An option that contradicts its stage file is refused, naming both values."""
    from ..errors import StageFileError
    from . import stage_files as sf

    made, source = None, ""
    if req.stage == "decode":
        latents = sf.load_latents(out)
        family.check_made_here(latents)
        made, source = (latents.height, latents.width, latents.num_frames), "the latents were sampled at"
        redo = "re-run --stage sample"
    elif req.stage == "sample":
        made, source = sf.encoded_size(out), "stage 1 was encoded for"
        redo = "re-run --stage encode at that size"
    asked = (req.height, req.width, req.frames)
    if made is not None:
        for name, a, m in zip(("height", "width", "frames"), asked, made):
            if a is not None and a != m:
                raise StageFileError(f"--{name} {a} differs from the {m} {source} (in {out}): drop --{name}, or "
                                     f"{redo}")
        return made
    native = family.native_size()
    return tuple(n if a is None else a for a, n in zip(asked, native))


def generate(req: GenerateRequest, family=None) -> dict:
    """Run the requested stage(s); return the generation config written to the output folder."""
    from ..engine.runtime import compile_stats, get_runtime
    from ..engine.stages import SampleSettings
    from ..errors import InputError
    from . import stage_files as sf
    from .video import write_mp4, write_wav

    if req.stage not in STAGES:
        raise InputError(f"--stage must be one of {STAGES}, got {req.stage!r}")
    out = Path(req.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    wall_start = time.perf_counter()
    runtime = get_runtime(cache_dir=req.cache_dir)
    stats_before = compile_stats()
    family = family or open_model(req, runtime)

    check_request_numbers(req)  # a value given is a value used: zero or negative is refused, never replaced
    height, width, frames = _stage_size(req, family, out)
    family.validate(height, width, frames)
    fps = req.fps if req.fps is not None else round(req.frame_rate) if req.frame_rate else None
    if fps is None and req.stage == "decode":  # the rate the earlier stages recorded (LTX-2's --frame-rate)
        fps = sf.recorded(out, "fps")
    fps = fps or family.default_fps()
    guidance = req.guidance if req.guidance is not None else family.DEFAULT_GUIDANCE
    loras, loras_2 = req.lora_specs()
    cache = req.step_cache()
    settings = SampleSettings(height, width, frames, req.steps, guidance, req.seed, req.scheduler, req.dynamic_cfg,
                              req.shift, req.guidance_2, req.boundary, loras=loras, loras_2=loras_2, cache=cache,
                              **{name: getattr(req, name) for name in req.LTX2_SETTINGS})
    stages = two_stage_settings(family, settings) if req.two_stage else None
    if req.two_stage and req.stage not in ("all", "sample"):
        raise InputError(f"--two-stage applies to sampling: use it with --stage all or --stage sample, not {req.stage}")
    if cache is not None and req.stage not in ("all", "sample"):
        raise InputError(f"--cache applies to sampling: use it with --stage all or --stage sample, not {req.stage}")
    if req.stage in ("all", "sample"):
        for s in stages or (settings,):
            family.check_settings(s)  # before the encode stage spends any time
        for s in stages or (settings,):
            family.apply_loras(family.lora_targets(s), merge=False)  # every LoRA file read and checked too
    elif loras or loras_2:
        raise InputError(f"--lora applies to sampling: use it with --stage all or --stage sample, not {req.stage}")
    images = None
    if req.stage in ("all", "encode"):
        family.check_images(bool(req.image), bool(req.last_image))
        from ..engine.images import load_image

        images = (load_image(req.image, "--image") if req.image else None,
                  load_image(req.last_image, "--last-image") if req.last_image else None)
    elif req.image or req.last_image:
        raise InputError(f"--image is read by the encode stage: use it with --stage all or --stage encode, not "
                         f"{req.stage} (sample takes the encoded image from {sf.IMAGE_FILE})")

    config = {
        **family.describe(), "dtype": family.dtype_name, "backend": runtime.backend,
        "devices": len(runtime.devices), "mesh": str(family.mesh_spec), "attention": family.attention.impl,
        "height": height, "width": width, "frames": frames, "fps": fps,
    }
    if req.stage in ("all", "encode"):
        if not req.prompt:
            raise InputError("--prompt is required for --stage all and --stage encode")
        embeddings = family.encode(req.prompt, req.negative_prompt)
        sf.save_embeddings(out, embeddings, size=(height, width, frames))
        config.update(prompt=req.prompt, negative_prompt=req.negative_prompt)
        image = None
        if images[0] is not None:  # at the size the (first) sampling runs at
            first = stages[0] if stages else settings
            image = family.encode_image(*images, height=first.height, width=first.width, num_frames=frames)
            sf.save_image(out, image)
        else:
            sf.drop_image(out)
        if req.image:
            config.update(image=str(req.image), **({"last_image": str(req.last_image)} if req.last_image else {}))
    if req.stage in ("all", "sample"):
        if req.stage == "sample":
            embeddings = sf.load_embeddings(out)
            image = sf.load_image(out) if family.image_input != "none" and (
                family.image_input == "required" or sf.has_image(out)) else None
        if stages:
            latents = family.sample(embeddings, stages[0], on_step=_log_step, image=image)
            latents = family.sample(embeddings, stages[1], on_step=_log_step, latents=family.upsample(latents))
            config.update(two_stage={"first": [stages[0].height, stages[0].width], "refine_steps": stages[1].steps,
                                     "refine_sigmas": stages[1].sigmas})
        else:
            latents = family.sample(embeddings, settings, on_step=_log_step, image=image)
        sf.save_latents(out, latents)
        config.update(steps=req.steps, guidance=guidance, seed=req.seed, scheduler=req.scheduler or "model default",
                      **{k: v for k, v in (("dynamic_cfg", req.dynamic_cfg), ("shift", req.shift),
                                           ("guidance_2", req.guidance_2), ("boundary", req.boundary)) if v},
                      **{name: getattr(req, name) for name in req.LTX2_SETTINGS if getattr(req, name) is not None})
        for name, specs in (("loras", loras), ("loras_2", loras_2)):
            if specs:
                config[name] = [{"path": str(spec.path), "strength": spec.strength} for spec in specs]
        config["step_cache"] = family.step_cache_report or {"method": "none"}
        if cache is not None and cache.calibrate:
            config["step_cache"]["mag_ratios_file"] = str(write_mag_ratios(out, family.step_cache_calibrated))
    if req.stage in ("all", "decode"):
        if req.stage == "decode":
            latents = sf.load_latents(out)
        frames_tensor = family.decode(latents, tiling=req.vae_tiling, group_norm=req.group_norm)
        audio = waveform = None
        if latents.audio is not None:  # a sound track (LTX-2): a WAV beside the mp4, and in it
            waveform = family.decode_audio(latents)
            audio = write_wav(waveform, out / sf.AUDIO_FILE, family.sample_rate)
            config.update(sample_rate=family.sample_rate)
        else:
            (out / sf.AUDIO_FILE).unlink(missing_ok=True)  # an earlier run's sound is not this video's
        sf.save_frames(out, frames_tensor, audio=waveform)
        write_mp4(frames_tensor, out / sf.VIDEO_FILE, fps=fps, audio=audio)
        config.update(vae_tiling=req.vae_tiling, group_norm=req.group_norm)

    t = family.timings
    stats = compile_stats().since(stats_before)
    timings = {
        "load_s": round(t.load, 3),
        "compile_s": {k: round(v, 3) for k, v in t.compile.items()},
        "run_s": {k: round(v, 3) for k, v in t.run.items()},
        "xla_compiles": dict(t.compiles),
        "lora_merge_s": round(t.lora, 3),
        "persistent_cache_hits": dict(t.cache_hits),
        "xla_compiles_total": stats.xla_compiles,
        "persistent_cache_hits_total": stats.persistent_cache_hits,
        "wall_s": round(time.perf_counter() - wall_start, 3),
    }
    return sf.update_config(out, **config, timings={req.stage: timings})


def two_stage_settings(family, settings):
    """LTX-2's two-stage recipe for ``settings`` (the final size): the first sampling at half the width and height,
    then, after the spatial latent upsampler, 3 refine steps over the stage-2 distilled sigmas with one transformer
    pass a step (guidance 1, no STG or isolation: the distilled stage-2 settings), the same seed. The LoRAs of
    ``loras_2`` (``--lora-2``: LTX-2's distilled LoRA in its own recipe) join the refine stage only."""
    import dataclasses

    from ..errors import InputError

    if not hasattr(family, "upsample"):
        raise InputError(f"--two-stage is LTX-2's recipe; {family.label} is a {family.FAMILY_NAME} model: leave it out")
    if getattr(family, "upsampler_path", None) is None:
        raise InputError(f"--two-stage needs the spatial latent upsampler: {family.label} has none; give its folder "
                         "with --upsampler (with single files: --latent-upscaler FILE)")
    m = 2 * getattr(family, "size_multiple", family.vae_scale_spatial)
    if settings.height % m or settings.width % m:
        from ..engine.validation import neighbours

        nearest = "; ".join(f"{name} {' or '.join(map(str, neighbours(v, m, m)))}"
                            for name, v in (("height", settings.height), ("width", settings.width)) if v % m)
        raise InputError(f"--two-stage samples at half the size first: height and width must be multiples of {m} "
                         f"(got {settings.width}x{settings.height}, width x height; nearest: {nearest})")
    if settings.cache is not None:
        raise InputError("--cache with --two-stage: step caching is not offered for LTX-2; leave --cache out")
    first = dataclasses.replace(settings, height=settings.height // 2, width=settings.width // 2, loras_2=())
    refine = dataclasses.replace(settings, steps=3, sigmas="stage2", guidance=1.0, audio_guidance=1.0, stg_scale=0.0,
                                 modality_scale=1.0, loras=settings.loras + settings.loras_2, loras_2=())
    return first, refine


def write_mag_ratios(out: Path, calibrated: dict[str, list[float]]) -> Path:
    """mag_ratios.json: the ratios a calibrating run measured, as --mag-ratios reads them back: a list (one
    transformer), or one list per transformer ("transformer", "transformer_2")."""
    import json

    path = out / "mag_ratios.json"
    value = calibrated["transformer"] if list(calibrated) == ["transformer"] else calibrated
    path.write_text(json.dumps(value, indent=1) + "\n")
    log.info("MagCache ratios written to %s: use them with --mag-ratios %s", path, path)
    return path


def _log_step(i: int, total: int) -> None:
    log.info("step %d/%d", i, total)


def print_summary(config: dict, stage: str, file=sys.stdout) -> None:
    t = config["timings"][stage]
    print(f"\nTiming summary ({config['backend']}, {config['devices']} device(s), {config['dtype']}):", file=file)
    print(f"  {'stage':<8} {'compile s':>10} {'run s':>10} {'XLA compiles':>13} {'cache hits':>11}", file=file)
    print(f"  {'load':<8} {'':>10} {t['load_s']:>10.2f}", file=file)
    for name in ("encode", "image", "sample", "decode"):
        if name in t["run_s"]:
            print(f"  {name:<8} {t['compile_s'].get(name, 0):>10.2f} {t['run_s'][name]:>10.2f} "
                  f"{t['xla_compiles'].get(name, 0):>13} {t['persistent_cache_hits'].get(name, 0):>11}", file=file)
    print(f"  total wall {t['wall_s']:.2f} s; all XLA programs: {t['xla_compiles_total']} compiled, "
          f"{t['persistent_cache_hits_total']} from the persistent cache", file=file)
