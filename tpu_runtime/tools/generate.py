"""One generation request, run stage by stage for any family: what ``python -m tpu_runtime generate`` does, and
what ``bench`` and the tests call.

``open_model`` asks the family registry for what the user pointed at (a diffusers folder, or ComfyUI's single
files) and returns the loaded family; ``generate`` runs encode → sample → decode (or one stage, from the files of
the stage before; or a recipe the family declares, e.g. sample → upsample → sample) and writes the stage files,
the frames, the mp4 and ``generation_config.json``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import multihost  # noqa: F401 - installs the slice joiner: a generation runs on a slice where asked

log = logging.getLogger("tpu_runtime")

STAGES = ("all", "encode", "sample", "decode")


@dataclass
class GenerateRequest:
    """One generation. A family's own settings (its declaration's) go in ``options`` (sampler), ``decode_options``
    and ``open_options`` (the family's constructor) by name, or as keywords named as their command-line options
    (``shift=6.0``, ``vae_tiling=True``); ``recipe``: one of the family's recipes by name (or ``two_stage=True``)."""

    model: str | None
    output_dir: str
    prompt: str | None = None
    negative_prompt: str = ""
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    steps: int | None = None  # None: the family's default
    guidance: float | None = None  # None: the family's default
    seed: int = 0
    scheduler: str | None = None
    dtype: str = "auto"
    fps: int | None = None  # None: what the settings say, else the model's
    stage: str = "all"
    cache_dir: str | None = None
    programs: str | None = None  # a folder of saved programs to load (plan --save's), besides the cache's own
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
    loras_2: list[str] = field(default_factory=list)  # FILE[:STRENGTH], the second LoRA slot
    image: str | None = None  # image-to-video: the first frame
    last_image: str | None = None  # first-and-last-frame models: the last frame
    cache: str = "none"  # step caching: none | magcache | first-block (engine/stepcache.py)
    cache_threshold: float | None = None  # None: diffusers' default for the method
    cache_max_skip: int | None = None  # None: 3
    cache_retention: float | None = None  # None: 0.2
    mag_ratios: str | None = None  # comma-separated, or a JSON file; None: the model's published ones
    cache_calibrate: bool = False  # MagCache without skipping: writes mag_ratios.json
    recipe: str | None = None
    options: dict = field(default_factory=dict)
    decode_options: dict = field(default_factory=dict)
    open_options: dict = field(default_factory=dict)

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


def _with_family_keywords(init):
    """``GenerateRequest``'s ``__init__``: its fields, and a family's settings and recipes as keywords named as
    their command-line options (each into its bucket of ``options`` by the setting's stage)."""
    import functools

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        from ..families import registry

        fields = {f.name for f in dataclasses.fields(GenerateRequest)}
        buckets = {"sample": dict(kwargs.pop("options", None) or {}),
                   "decode": dict(kwargs.pop("decode_options", None) or {}),
                   "open": dict(kwargs.pop("open_options", None) or {})}
        for key in [k for k in kwargs if k not in fields]:
            value = kwargs.pop(key)
            setting = registry.setting_by_dest(key)
            if setting is not None:
                buckets[setting.stage][setting.name] = value
            elif key in registry.recipes():
                kwargs["recipe"] = key if value else kwargs.get("recipe")
            else:
                raise TypeError(f"GenerateRequest has no field or setting {key!r}")
        init(self, *args, options=buckets["sample"], decode_options=buckets["decode"], open_options=buckets["open"],
             **kwargs)

    return wrapper


GenerateRequest.__init__ = _with_family_keywords(GenerateRequest.__init__)


def open_model(req: GenerateRequest, runtime=None):
    """The family for ``req.model`` (a diffusers folder) or for ``req``'s single files, as the registry picks it."""
    from ..families import registry

    extra = {k: v for k, v in req.open_options.items() if v not in (None, "")}
    return registry.open_model(req.model, req.files, dtype=req.dtype, runtime=runtime, mesh=req.mesh,
                               attention=req.attention_config(), fsdp=req.fsdp, vae_sharding=req.vae_sharding, **extra)


def check_request_numbers(req: GenerateRequest) -> None:
    """The request's numbers, each against its rule, before anything loads or runs. Leaving an option out (None)
    means the model's default; zero and negative values are mistakes, refused with the rule."""
    from ..engine.validation import check_number
    from ..families import registry

    for name, value in (("height", req.height), ("width", req.width), ("frames", req.frames), ("fps", req.fps)):
        check_number(f"--{name}", value, minimum=1, integer=True, optional=True)
    check_number("--steps", req.steps, minimum=1, integer=True, optional=True)
    check_number("--seed", req.seed, minimum=0, integer=True)
    check_number("--guidance", req.guidance, minimum=0.0, optional=True)
    for stage, given in (("sample", req.options), ("decode", req.decode_options)):
        for setting, _ in registry.settings_of(stage).values():
            if setting.cli:
                setting.check(given.get(setting.name), setting.option)


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


def sampling(req: GenerateRequest, family, size: tuple[int, int, int]):
    """The request's sampling settings for ``family`` at ``size``, the family's defaults where the request leaves
    one out, and the recipe's (None: one sampling), every one checked (LoRA files read) before anything runs."""
    from ..engine.stages import SampleSettings
    from ..errors import InputError
    from ..families import registry

    height, width, frames = size
    loras, loras_2 = req.lora_specs()
    settings = SampleSettings(height, width, frames, family.DEFAULT_STEPS if req.steps is None else req.steps,
                              family.DEFAULT_GUIDANCE if req.guidance is None else req.guidance, req.seed,
                              req.scheduler, loras=loras, loras_2=loras_2, cache=req.step_cache(),
                              options={k: v for k, v in req.options.items() if v is not None})
    recipe = None
    if req.recipe is not None:
        recipe, owners = registry.recipes()[req.recipe]
        if family.SPEC not in owners:
            raise InputError(f"{recipe.option} is {registry.owners(owners)}'s recipe; {family.label} is a "
                             f"{family.FAMILY_NAME} model: leave it out")
        if req.stage not in ("all", "sample"):
            raise InputError(f"{recipe.option} applies to sampling: use it with --stage all or --stage sample, not "
                             f"{req.stage}")
    if settings.cache is not None and req.stage not in ("all", "sample"):
        raise InputError(f"--cache applies to sampling: use it with --stage all or --stage sample, not {req.stage}")
    runs = (settings,) if recipe is None else tuple(family.SPEC.load(recipe.settings)(family, settings))
    if req.stage in ("all", "sample"):
        for s in runs:
            family.check_settings(s)  # before the encode stage spends any time
        for s in runs:
            family.apply_loras(family.lora_targets(s), merge=False)  # every LoRA file read and checked too
    elif loras or loras_2:
        raise InputError(f"--lora applies to sampling: use it with --stage all or --stage sample, not {req.stage}")
    return settings, recipe, runs


def generate(req: GenerateRequest, family=None) -> dict:
    """Run the requested stage(s); return the generation config written to the output folder."""
    from ..engine.runtime import compile_stats, get_runtime
    from ..errors import InputError
    from . import stage_files as sf

    if req.stage not in STAGES:
        raise InputError(f"--stage must be one of {STAGES}, got {req.stage!r}")
    out = Path(req.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    wall_start = time.perf_counter()
    runtime = get_runtime(cache_dir=req.cache_dir)
    if req.programs:
        runtime.saved_programs.add_read_only(req.programs, "--programs")
    stats_before = compile_stats()
    family = family or open_model(req, runtime)

    check_request_numbers(req)  # a value given is a value used: zero or negative is refused, never replaced
    size = _stage_size(req, family, out)
    family.validate(*size)
    settings, recipe, runs = sampling(req, family, size)
    fps = req.fps if req.fps is not None else family.fps_of(settings)
    if fps is None and req.stage == "decode":  # the rate the earlier stages recorded (a setting's, e.g. a frame rate)
        fps = sf.recorded(out, "fps")
    fps = fps or family.default_fps()
    images = _images(req, family)
    height, width, frames = size
    config = {
        **family.describe(), "dtype": family.dtype_name, "backend": runtime.backend,
        "devices": len(runtime.devices), "mesh": str(family.mesh_spec), "attention": family.attention.impl,
        "height": height, "width": width, "frames": frames, "fps": fps,
    }
    embeddings = image = latents = None
    if req.stage in ("all", "encode"):
        embeddings, image = _encode(req, family, out, images, runs[0], config)
    if req.stage in ("all", "sample"):
        latents = _sample(req, family, out, embeddings, image, settings, recipe, runs, config)
    if req.stage in ("all", "decode"):
        _decode(req, family, out, latents, fps, config)
    return sf.update_config(out, **config, timings={req.stage: _timings(family, stats_before, wall_start)})


def _images(req: GenerateRequest, family):
    """The first (and last) image the encode stage reads, checked against what the model takes."""
    from ..errors import InputError
    from . import stage_files as sf

    if req.stage in ("all", "encode"):
        family.check_images(bool(req.image), bool(req.last_image))
        from ..engine.images import load_image

        return (load_image(req.image, "--image") if req.image else None,
                load_image(req.last_image, "--last-image") if req.last_image else None)
    if req.image or req.last_image:
        raise InputError(f"--image is read by the encode stage: use it with --stage all or --stage encode, not "
                         f"{req.stage} (sample takes the encoded image from {sf.IMAGE_FILE})")
    return None


def _encode(req: GenerateRequest, family, out: Path, images, first, config: dict):
    """Stage 1 (and the image encode, at the size the first sampling runs at): embeddings and the image."""
    from ..errors import InputError
    from . import stage_files as sf

    if not req.prompt:
        raise InputError("--prompt is required for --stage all and --stage encode")
    embeddings = family.encode(req.prompt, req.negative_prompt)
    sf.save_embeddings(out, embeddings, size=(config["height"], config["width"], config["frames"]))
    config.update(prompt=req.prompt, negative_prompt=req.negative_prompt)
    image = None
    if images[0] is not None:
        image = family.encode_image(*images, height=first.height, width=first.width, num_frames=config["frames"])
        sf.save_image(out, image)
    else:
        sf.drop_image(out)
    if req.image:
        config.update(image=str(req.image), **({"last_image": str(req.last_image)} if req.last_image else {}))
    return embeddings, image


def _sample(req: GenerateRequest, family, out: Path, embeddings, image, settings, recipe, runs, config: dict):
    """Stage 2: one sampling, or the recipe's stage calls in order (each sampling after the first refines the
    latents so far); the settings recorded."""
    from . import stage_files as sf

    if req.stage == "sample":
        embeddings = sf.load_embeddings(out)
        image = sf.load_image(out) if family.image_input != "none" and (
            family.image_input == "required" or sf.has_image(out)) else None
    latents = None
    samplings = iter(runs)
    for stage in recipe.stages if recipe is not None else ("sample",):
        if stage == "sample":
            refine = {} if latents is None else {"latents": latents}
            latents = family.sample(embeddings, next(samplings), on_step=_log_step,
                                    image=image if latents is None else None, **refine)
        else:
            latents = getattr(family, stage)(latents)
    sf.save_latents(out, latents)
    config.update(steps=settings.steps, guidance=settings.guidance, seed=req.seed,
                  scheduler=req.scheduler or "model default", **settings.options)
    if recipe is not None:
        config[recipe.name] = {"stages": list(recipe.stages), "samplings": [
            {"height": s.height, "width": s.width, "steps": s.steps, "guidance": s.guidance,
             **{k: v for k, v in s.options.items() if settings.options.get(k) != v}} for s in runs]}
    for name, specs in (("loras", settings.loras), ("loras_2", settings.loras_2)):
        if specs:
            config[name] = [{"path": str(spec.path), "strength": spec.strength} for spec in specs]
    config["step_cache"] = family.step_cache_report or {"method": "none"}
    if settings.cache is not None and settings.cache.calibrate:
        config["step_cache"]["mag_ratios_file"] = str(write_mag_ratios(out, family.step_cache_calibrated))
    return latents


def _decode(req: GenerateRequest, family, out: Path, latents, fps: int, config: dict) -> None:
    """Stage 3: frames (and the sound track of a model with one, as a WAV beside the mp4 and in it)."""
    from . import stage_files as sf
    from .video import write_mp4, write_wav

    if req.stage == "decode":
        latents = sf.load_latents(out)
    options = {k: v for k, v in req.decode_options.items() if v is not None}
    frames_tensor = family.decode(latents, **options)
    audio = waveform = None
    if latents.audio is not None:
        waveform = family.decode_audio(latents)
        audio = write_wav(waveform, out / sf.AUDIO_FILE, family.sample_rate)
        config.update(sample_rate=family.sample_rate)
    else:
        (out / sf.AUDIO_FILE).unlink(missing_ok=True)  # an earlier run's sound is not this video's
    sf.save_frames(out, frames_tensor, audio=waveform)
    write_mp4(frames_tensor, out / sf.VIDEO_FILE, fps=fps, audio=audio)
    config.update({s.dest: options.get(s.name, s.default) for s in family.SPEC.settings_of("decode") if s.cli})


def _timings(family, stats_before, wall_start: float) -> dict:
    from ..engine.runtime import compile_stats

    t = family.timings
    stats = compile_stats().since(stats_before)
    return {
        "load_s": round(t.load, 3),
        "compile_s": {k: round(v, 3) for k, v in t.compile.items()},
        "run_s": {k: round(v, 3) for k, v in t.run.items()},
        "xla_compiles": dict(t.compiles),
        "lora_merge_s": round(t.lora, 3),
        "persistent_cache_hits": dict(t.cache_hits),
        "programs_loaded": dict(t.loaded),
        "xla_compiles_total": stats.xla_compiles,
        "persistent_cache_hits_total": stats.persistent_cache_hits,
        "programs_loaded_total": stats.programs_loaded,
        "traces_total": stats.traces,
        "wall_s": round(time.perf_counter() - wall_start, 3),
    }


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
    print(f"  {'stage':<8} {'compile s':>10} {'run s':>10} {'XLA compiles':>13} {'cache hits':>11} {'loaded':>7}",
          file=file)
    print(f"  {'load':<8} {'':>10} {t['load_s']:>10.2f}", file=file)
    for name in ("encode", "image", "sample", "decode"):
        if name in t["run_s"]:
            print(f"  {name:<8} {t['compile_s'].get(name, 0):>10.2f} {t['run_s'][name]:>10.2f} "
                  f"{t['xla_compiles'].get(name, 0):>13} {t['persistent_cache_hits'].get(name, 0):>11} "
                  f"{t.get('programs_loaded', {}).get(name, 0):>7}", file=file)
    print(f"  total wall {t['wall_s']:.2f} s; all XLA programs: {t['xla_compiles_total']} compiled, "
          f"{t['persistent_cache_hits_total']} from the persistent cache; {t.get('programs_loaded_total', 0)} saved "
          "program(s) loaded (not traced)", file=file)
