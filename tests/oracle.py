"""diffusers' own CogVideoXPipeline, float32 on CPU: the numerical oracle for our frames."""

import functools

import numpy as np
import torch


@functools.lru_cache(maxsize=8)
def load_pipeline(folder: str):
    from diffusers import CogVideoXPipeline

    return CogVideoXPipeline.from_pretrained(folder, dtype=torch.float32)


def diffusers_frames(folder, prompt, negative, height, width, frames, steps, guidance, seed,
                     scheduler=None, dynamic_cfg=False, tiling=False) -> np.ndarray:
    """Frames ``[F, H, W, 3]`` float32 in 0..1 exactly as diffusers makes them."""
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
            generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
            max_sequence_length=pipe.transformer.config.max_text_seq_length,
        )
    finally:
        pipe.scheduler = original
        pipe.vae.disable_tiling()
    return out.frames[0]
