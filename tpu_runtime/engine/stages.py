"""The values passed between stages, one generation's settings, and a stage's program as the runtime compiles it.

Stage values are CPU torch tensors in small dataclasses: ComfyUI can hold and cache them, the stage files write
and read them, and a multi-host slice names them by id. Nothing here touches a device.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import InputError


@dataclass
class TextEmbeddings:
    """Stage 1 output: text-encoder embeddings for the prompt and the negative prompt, CPU tensors ``[1, L, D]``.
    A model with a sound track (LTX-2) has a second text stream for it: ``audio_prompt_embeds`` and
    ``negative_audio_prompt_embeds``."""

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor
    prompt: str
    negative_prompt: str
    model_signature: str
    audio_prompt_embeds: torch.Tensor | None = None
    negative_audio_prompt_embeds: torch.Tensor | None = None


@dataclass
class VideoLatents:
    """Stage 2 output: denoised latents ``[B, C, T, h, w]`` float32 on CPU, before the VAE's scaling; with a sound
    track (LTX-2) also ``audio``, the audio VAE's latents ``[B, C, L, M]`` float32 (de-normalised, as diffusers'
    ``output_type="latent"`` returns them)."""

    latents: torch.Tensor
    height: int
    width: int
    num_frames: int
    model_signature: str
    audio: torch.Tensor | None = None


@dataclass
class ImageConditioning:
    """Image-encode output: what sampling takes from the first (and last) image, CPU tensors, for one video size.

    ``latents``: the VAE encoding of the conditioning (CogVideoX: the image posterior's mean ``[1, C, 1, h, w]``;
    Wan: the normalised latent condition, with its frame mask in front for the models that concatenate it);
    ``latents_std``: CogVideoX only, the posterior's std: sampling draws ``mean + std * noise`` from the seed as
    its first random draw, as diffusers does; ``image_embeds``: Wan 2.1 I2V / FLF2V, the CLIP vision hidden
    states ``[images, 257, 1280]``."""

    latents: torch.Tensor
    height: int
    width: int
    num_frames: int
    model_signature: str
    latents_std: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    last_image: bool = False


STAGE_VALUES = (TextEmbeddings, VideoLatents, ImageConditioning)


METHODS = ("none", "magcache", "first-block")
DEFAULT_THRESHOLD = {"magcache": 0.06, "first-block": 0.05}  # diffusers' MagCacheConfig / FirstBlockCacheConfig


@dataclass
class StepCache:
    """One generation's step-cache settings. ``mag_ratios``: per transformer ("transformer", "transformer_2"), the
    calibrated ratios (any length: interpolated to that transformer's step count as diffusers does); None: the
    model's published ones. ``calibrate``: MagCache without skipping, recording the ratios instead."""

    method: str = "none"
    threshold: float | None = None  # None: diffusers' default for the method
    max_skip: int = 3
    retention: float = 0.2
    mag_ratios: dict[str, tuple[float, ...]] | None = None
    calibrate: bool = False

    @property
    def active(self) -> bool:
        return self.method != "none"

    def resolved_threshold(self) -> float:
        return DEFAULT_THRESHOLD[self.method] if self.threshold is None else float(self.threshold)

    def check(self) -> None:
        """Refuse settings that cannot run, naming the option and the rule (before anything compiles)."""
        from .validation import check_number

        if self.method not in METHODS:
            raise InputError(f"cache {self.method!r} is not a step-cache method: use one of {', '.join(METHODS)}")
        check_number("cache threshold", self.threshold, minimum=0.0, optional=True)
        check_number("cache max skip", self.max_skip, minimum=1, integer=True)
        check_number("cache retention", self.retention, minimum=0.0, below=1.0)
        if self.calibrate and self.method != "magcache":
            raise InputError("calibrating writes MagCache's ratios: use it with the magcache method")
        for name, ratios in (self.mag_ratios or {}).items():
            if self.method != "magcache":
                raise InputError("mag ratios are MagCache's: use them with the magcache method")
            if not ratios or not all(isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for r in ratios):
                raise InputError(f"mag ratios for {name} must be a list of positive numbers, got {list(ratios)[:8]}")


@dataclass
class SampleSettings:
    """One generation's sampling settings. Options a model does not have are refused by its family, not ignored."""

    height: int
    width: int
    num_frames: int
    steps: int = 50
    guidance: float = 6.0
    seed: int = 0
    scheduler: str | None = None  # None: the model's own
    dynamic_cfg: bool = False  # CogVideoX only
    shift: float | None = None  # Wan: flow shift; None: the model's scheduler config
    guidance_2: float | None = None  # Wan 2.2 two experts: guidance of the low-noise expert (default: guidance)
    boundary: float | None = None  # Wan 2.2 two experts: boundary ratio (default: the model's)
    loras: tuple = ()  # LoraSpec: merged into the transformer (Wan 2.2 two experts: the high-noise expert)
    loras_2: tuple = ()  # LoraSpec: Wan 2.2 two experts only: merged into the low-noise expert
    cache: StepCache | None = None  # step caching (engine/stepcache.py); None: every step runs every block
    # LTX-2 (video with sound); None: the model's default. The guidance terms are diffusers' LTX2Pipeline's.
    audio_guidance: float | None = None  # CFG scale of the sound (audio_guidance_scale)
    stg_scale: float | None = None  # spatio-temporal guidance, video and sound (stg_scale, audio_stg_scale)
    stg_blocks: tuple[int, ...] | None = None  # the blocks STG perturbs (spatio_temporal_guidance_blocks)
    modality_scale: float | None = None  # modality-isolation guidance, video and sound
    guidance_rescale: float | None = None  # rescale of the guided prediction, video and sound
    frame_rate: float | None = None  # frames per second the video is made for (enters the positions)
    sigmas: str | None = None  # the sigma schedule: None (the model's), "distilled", "stage2" (the refine stage)
    noise_scale: float | None = None  # sampling from given latents: how much fresh noise (default: the first sigma)


# Settings only some families read: the family whose models read each, for messages. A family lists the ones it
# reads in ``ModelFamily.OWN_SETTINGS``; any other given a value is refused before anything runs.
FAMILY_SETTINGS = {
    "dynamic_cfg": "CogVideoX", "shift": "Wan", "guidance_2": "Wan 2.2 A14B", "boundary": "Wan 2.2 A14B",
    "audio_guidance": "LTX-2", "stg_scale": "LTX-2", "stg_blocks": "LTX-2", "modality_scale": "LTX-2",
    "guidance_rescale": "LTX-2", "frame_rate": "LTX-2", "sigmas": "LTX-2", "noise_scale": "LTX-2",
}


@dataclass
class StageProgram:
    """One stage's program as the runtime compiles it. ``example`` holds the weights' states as placed (or their
    shape structs when planning) and every other input as a ``jax.ShapeDtypeStruct`` placed on the mesh;
    ``scope`` is what tracing needs around it (attention settings, module replacements); ``components`` names the
    weights it reads; ``part`` tells apart the programs of a stage that has several (a streamed decode's first
    chunks and each later chunk)."""

    stage: str
    fn: Callable
    example: tuple
    key: tuple
    describe: str
    scope: Callable[[], contextlib.AbstractContextManager]
    components: tuple[str, ...]
    part: str = ""

    @property
    def name(self) -> str:
        return f"{self.stage}_{self.part}" if self.part else self.stage


@dataclass
class StageTimings:
    """Seconds spent per stage, split into compile and run, and how many XLA programs each compiled."""

    load: float = 0.0
    compile: dict[str, float] = field(default_factory=dict)
    run: dict[str, float] = field(default_factory=dict)
    compiles: dict[str, int] = field(default_factory=dict)
    lora: float = 0.0  # seconds spent merging LoRAs into the weights (reading the files included)
    cache_hits: dict[str, int] = field(default_factory=dict)
    programs: dict[str, object] = field(default_factory=dict)  # each stage's latest CompiledProgram (time, memory)


def config_signature(configs: dict[str, dict]) -> str:
    """A short hash of component configs: stage files record it, so files from another model are refused."""
    h = hashlib.sha256()
    for name in sorted(configs):
        config = {k: v for k, v in configs[name].items()
                  if not k.startswith("_") and k not in ("torch_dtype", "dtype")}
        h.update(name.encode() + json.dumps(config, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]
