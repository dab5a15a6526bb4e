"""LTX-2's sampling schedule and sizes, as diffusers' LTX-2 pipelines compute them on the host: the sigmas (the
model's dynamically shifted schedule, the distilled one, the refine stage's), the sound's length for a video's
duration, and the token positions the transformer takes."""

from __future__ import annotations

import copy

import numpy as np
import torch


def sigma_values(schedule: str | None, steps: int) -> list[float] | np.ndarray:
    """The sigmas diffusers' pipelines hand to the scheduler: ``linspace(1, 1/N, N)`` by default, or one of the
    distilled lists (``DISTILLED_SIGMA_VALUES``: 8 steps; ``STAGE_2_DISTILLED_SIGMA_VALUES``: the refine stage's 3)."""
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES, STAGE_2_DISTILLED_SIGMA_VALUES

    if schedule in (None, "default"):
        return np.linspace(1.0, 1 / steps, steps)
    return list(DISTILLED_SIGMA_VALUES if schedule == "distilled" else STAGE_2_DISTILLED_SIGMA_VALUES)


def schedule_steps(schedule: str | None) -> int | None:
    """The step count a fixed schedule has (None: any)."""
    if schedule in (None, "default"):
        return None
    return len(sigma_values(schedule, 1))


def timesteps(scheduler, schedule: str | None, steps: int, video_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps [N], sigmas [N + 1]) float32 of a run, from a copy of the model's scheduler exactly as diffusers
    sets it: ``mu`` from the video's token count (dynamic shifting), the distilled lists through the same
    scheduler, and for the refine stage (``"stage2"``) a scheduler without dynamic shifting or terminal stretch, as
    diffusers' two-stage recipe swaps in."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    if schedule == "stage2":
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler.config, use_dynamic_shifting=False,
                                                                shift_terminal=None)
    else:
        scheduler = copy.deepcopy(scheduler)
    c = scheduler.config
    mu = calculate_shift(video_tokens, c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.95), c.get("max_shift", 2.05))
    scheduler.set_timesteps(sigmas=sigma_values(schedule, steps), mu=mu, device="cpu")
    return scheduler.timesteps.float().numpy(), scheduler.sigmas.float().numpy()


def audio_latent_frames(num_frames: int, frame_rate: float, audio_vae_config: dict) -> int:
    """Latent audio frames for ``num_frames`` video frames at ``frame_rate``: the video's duration at the audio VAE's
    latent rate (sample rate / mel hop / 4), rounded as Python rounds (half to even), as diffusers does."""
    per_second = audio_vae_config.get("sample_rate", 16000) / audio_vae_config.get("mel_hop_length", 160) / 4.0
    return round(num_frames / frame_rate * per_second)


def positions(transformer: torch.nn.Module, frames: int, height: int, width: int, audio_frames: int,
              frame_rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The video tokens' coordinates ``[1, 3, F*H*W, 2]`` (frame times in seconds at ``frame_rate``, pixel rows and
    columns) and the sound tokens' ``[1, 1, L, 2]``, from the transformer's own position modules on the host."""
    video = transformer.rope.prepare_video_coords(1, frames, height, width, torch.device("cpu"), fps=frame_rate)
    audio = transformer.audio_rope.prepare_audio_coords(1, audio_frames, torch.device("cpu"))
    return video.float(), audio.float()
