"""diffusers' own pipelines (CogVideoX, Wan, their image-to-video ones), float32 on CPU: the numerical oracle for our
frames."""

import contextlib
import functools
import io
import json
import re

import numpy as np
import torch


@functools.lru_cache(maxsize=8)
def load_pipeline(folder: str):
    from diffusers import CogVideoXPipeline

    return CogVideoXPipeline.from_pretrained(folder, dtype=torch.float32)


def diffusers_frames(folder, prompt, negative, height, width, frames, steps, guidance, seed,
                     scheduler=None, dynamic_cfg=False, tiling=False, output_type="np") -> np.ndarray:
    """Frames ``[F, H, W, 3]`` float32 in 0..1 exactly as diffusers makes them (``output_type="latent"``: the
    denoised latents instead, as the pipeline holds them)."""
    import diffusers

    pipe = load_pipeline(str(folder))
    original = pipe.scheduler
    if scheduler is not None:
        cls = {"ddim": diffusers.CogVideoXDDIMScheduler, "dpm": diffusers.CogVideoXDPMScheduler}[scheduler]
        pipe.scheduler = cls.from_config(original.config)
    if tiling:
        pipe.vae.enable_tiling()
    try:
        out = pipe(
            prompt, negative_prompt=negative, height=height, width=width, num_frames=frames,
            num_inference_steps=steps, guidance_scale=guidance, use_dynamic_cfg=dynamic_cfg,
            generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type,
            max_sequence_length=pipe.transformer.config.max_text_seq_length,
        )
    finally:
        pipe.scheduler = original
        pipe.vae.disable_tiling()
    return out.frames[0]


@functools.lru_cache(maxsize=8)
def load_wan_pipeline(folder: str):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(folder, torch_dtype=torch.float32)


def wan_frames(folder, prompt, negative, height, width, frames, steps, guidance, seed, scheduler=None, shift=None,
               guidance_2=None, boundary=None, output_type="np") -> np.ndarray:
    """Frames ``[F, H, W, 3]`` float32 in 0..1 exactly as diffusers' WanPipeline makes them."""
    import diffusers

    pipe = load_wan_pipeline(str(folder))
    original, original_boundary = pipe.scheduler, pipe.config.boundary_ratio
    flow_shift = original.config.flow_shift if shift is None else shift
    if scheduler == "euler":
        pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=flow_shift)
    elif scheduler == "euler_simple":
        from tpu_runtime.engine.schedulers import euler_simple_scheduler

        pipe.scheduler = euler_simple_scheduler(shift=flow_shift)
    elif shift is not None:
        pipe.scheduler = diffusers.UniPCMultistepScheduler.from_config(original.config, flow_shift=shift)
    if boundary is not None:
        pipe.register_to_config(boundary_ratio=boundary)
    try:
        out = pipe(prompt, negative_prompt=negative, height=height, width=width, num_frames=frames,
                   num_inference_steps=steps, guidance_scale=guidance, guidance_scale_2=guidance_2,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type)
    finally:
        pipe.scheduler = original
        pipe.register_to_config(boundary_ratio=original_boundary)
    return out.frames[0]


@contextlib.contextmanager
def step_cached(pipe, configs: dict):
    """diffusers' step cache on ``pipe`` for what runs inside: ``configs`` maps each transformer ("transformer",
    "transformer_2") to its MagCacheConfig / FirstBlockCacheConfig (diffusers' way: one config, one state per
    transformer). Yields a list that receives every calibration list diffusers prints, in the order printed."""
    printed, calibrations = io.StringIO(), []
    for name, config in configs.items():
        getattr(pipe, name).enable_cache(config)
    try:
        with contextlib.redirect_stdout(printed):
            yield calibrations
    finally:
        for name in configs:
            getattr(pipe, name).disable_cache()
        calibrations.extend(json.loads(m) for m in re.findall(r"^(\[[-0-9., e]+\])$", printed.getvalue(), re.M))


def lora_frames(pipeline_cls, folder, loras=(), loras_2=(), scheduler=None, cache=None, **call):
    """(frames, pipeline) of a fresh diffusers pipeline with each LoRA loaded (``load_lora_weights``), fused at its strength
    (``fuse_lora``) and its adapter unloaded, one after another: ``loras`` into the transformer, ``loras_2`` into
    Wan 2.2's low-noise ``transformer_2``. ``call``: the pipeline's own arguments plus ``seed``."""
    pipe = pipeline_cls.from_pretrained(str(folder), dtype=torch.float32)
    for i, (path, strength, second) in enumerate([(*lo, False) for lo in loras] + [(*lo, True) for lo in loras_2]):
        extra = {"load_into_transformer_2": True} if second else {}
        pipe.load_lora_weights(str(path), adapter_name=f"lora{i}", **extra)
        pipe.fuse_lora(components=["transformer_2" if second else "transformer"], lora_scale=strength,
                       adapter_names=[f"lora{i}"])
        pipe.unload_lora_weights()
    if scheduler is not None:
        pipe.scheduler = scheduler
    seed = call.pop("seed")
    call.setdefault("output_type", "np")
    with step_cached(pipe, cache or {}):
        out = pipe(generator=torch.Generator("cpu").manual_seed(seed), **call)
    return out.frames[0], pipe


@functools.lru_cache(maxsize=4)
def _i2v_pipeline(cls_name: str, folder: str):
    import diffusers

    return getattr(diffusers, cls_name).from_pretrained(folder, dtype=torch.float32)


def cogvideox_i2v_frames(folder, image, prompt, negative, height, width, frames, steps, guidance, seed,
                         scheduler=None) -> np.ndarray:
    """Frames ``[F, H, W, 3]`` exactly as diffusers' CogVideoXImageToVideoPipeline makes them from ``image``."""
    import diffusers
    from PIL import Image

    pipe = _i2v_pipeline("CogVideoXImageToVideoPipeline", str(folder))
    original = pipe.scheduler
    if scheduler is not None:
        cls = {"ddim": diffusers.CogVideoXDDIMScheduler, "dpm": diffusers.CogVideoXDPMScheduler}[scheduler]
        pipe.scheduler = cls.from_config(original.config)
    try:
        out = pipe(image=Image.open(image), prompt=prompt, negative_prompt=negative, height=height, width=width,
                   num_frames=frames, num_inference_steps=steps, guidance_scale=guidance,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
                   max_sequence_length=pipe.transformer.config.max_text_seq_length)
    finally:
        pipe.scheduler = original
    return out.frames[0]


def wan_i2v_frames(folder, image, last_image, prompt, negative, height, width, frames, steps, guidance,
                   seed, output_type="np") -> np.ndarray:
    """Frames ``[F, H, W, 3]`` exactly as diffusers' WanImageToVideoPipeline makes them (first image, optional
    last image; TI2V-5B's folder through the same pipeline, as its model card does)."""
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v
    from PIL import Image

    # diffusers 0.42's I2V module calls ftfy whether or not it is installed (its T2V module checks first); clean
    # prompts as the T2V module does, which is what the runtime does.
    pipeline_wan_i2v.prompt_clean = pipeline_wan.prompt_clean
    pipe = _i2v_pipeline("WanImageToVideoPipeline", str(folder))
    out = pipe(image=Image.open(image), last_image=Image.open(last_image) if last_image else None, prompt=prompt,
               negative_prompt=negative, height=height, width=width, num_frames=frames, num_inference_steps=steps,
               guidance_scale=guidance, generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type)
    return out.frames[0]


@functools.lru_cache(maxsize=4)
def _ltx2_pipeline(cls_name: str, folder: str):
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def ltx2_outputs(folder, seed, image=None, output_type="np", **call):
    """(frames ``[F, H, W, 3]`` or video latents, waveform ``[channels, samples]`` or sound latents) exactly as
    diffusers' LTX2Pipeline (LTX2ImageToVideoPipeline with ``image``, a PNG path) makes them; ``call``: the
    pipeline's own arguments."""
    from PIL import Image

    cls = "LTX2ImageToVideoPipeline" if image is not None else "LTX2Pipeline"
    pipe = _ltx2_pipeline(cls, str(folder))
    extra = {"image": Image.open(image)} if image is not None else {}
    out = pipe(generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type, **extra, **call)
    video = out.frames if output_type == "latent" else out.frames[0]
    audio = out.audio if output_type == "latent" else out.audio[0]
    return video, audio


def ltx2_two_stages(folder, seed, prompt, negative, height, width, frames, first_steps, stage_1=None, stage_2=None,
                    stage_2_lora=None):
    """diffusers' two-stage recipe, chained as its LTX-2 documentation chains the pipelines: LTX2Pipeline at
    ``height`` x ``width`` to latents, LTX2LatentUpsamplePipeline (the folder's latent_upsampler/) to twice the
    size, LTX2Pipeline again from the upsampled video and the first stage's sound latents with the second stage's
    distilled sigmas on a scheduler without dynamic shifting (a fresh generator of the same seed), with
    ``stage_2_lora`` ((file, strength): the distilled LoRA in LTX-2's recipe) loaded for that stage only. Returns
    (frames, waveform)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

    pipe = _ltx2_pipeline("LTX2Pipeline", str(folder))
    video, audio = ltx2_outputs(folder, seed, output_type="latent", prompt=prompt, negative_prompt=negative,
                                height=height, width=width, num_frames=frames, num_inference_steps=first_steps,
                                **(stage_1 or {}))
    upsampler = LTX2LatentUpsamplerModel.from_pretrained(str(folder) + "/latent_upsampler", dtype=torch.float32)
    upsample = LTX2LatentUpsamplePipeline(vae=pipe.vae, latent_upsampler=upsampler)
    upsampled = upsample(latents=video, output_type="latent").frames
    original = pipe.scheduler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(original.config, use_dynamic_shifting=False,
                                                                 shift_terminal=None)
    if stage_2_lora is not None:
        pipe.load_lora_weights(str(stage_2_lora[0]), adapter_name="stage_2")
        pipe.set_adapters(["stage_2"], [stage_2_lora[1]])
    try:
        out = pipe(latents=upsampled, audio_latents=audio, prompt=prompt, negative_prompt=negative,
                   num_inference_steps=3, noise_scale=STAGE_2_DISTILLED_SIGMA_VALUES[0],
                   sigmas=STAGE_2_DISTILLED_SIGMA_VALUES, generator=torch.Generator("cpu").manual_seed(seed),
                   output_type="np", **(stage_2 or {}))
    finally:
        pipe.scheduler = original
        if stage_2_lora is not None:
            pipe.unload_lora_weights()
    return out.frames[0], out.audio[0]
