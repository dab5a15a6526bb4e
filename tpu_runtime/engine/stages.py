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
from .settings import takes_options


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


@takes_options
@dataclass
class SampleSettings:
    """One generation's sampling settings: those every family takes, and in ``options`` the family's own (its
    declaration's ``Setting``s, by name; read as attributes: ``settings.shift``). An option the model does not
    take is refused by its family, never ignored; one left out is the model's default."""

    height: int
    width: int
    num_frames: int
    steps: int = 50
    guidance: float = 6.0
    seed: int = 0
    scheduler: str | None = None  # None: the model's own
    loras: tuple = ()  # LoraSpec: merged into the transformer (two-expert models: the first expert)
    loras_2: tuple = ()  # LoraSpec: merged into the second expert, or a recipe's later sampling
    cache: StepCache | None = None  # step caching (engine/stepcache.py); None: every step runs every block
    options: dict = field(default_factory=dict)


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
class SamplingRun:
    """One sampling run as a family sets it up (``ModelFamily.sampling_run``); the step loop is
    ``ModelFamily.sample``'s. ``program``: the step program; ``experts``: the transformer each step uses (whose
    weights it is passed); ``carry``: the device values a step returns and the next takes back (the latents
    first); ``arguments(i, carry)``: step ``i``'s inputs after the weights; ``finish(carry)``: the latents on the
    host after the last step."""

    program: StageProgram
    experts: list[str]
    carry: tuple
    arguments: Callable[[int, tuple], tuple]
    finish: Callable[[tuple], VideoLatents]


@dataclass
class StageTimings:
    """Seconds spent per stage, split into compile and run, and how many XLA programs each compiled."""

    load: float = 0.0
    compile: dict[str, float] = field(default_factory=dict)
    run: dict[str, float] = field(default_factory=dict)
    compiles: dict[str, int] = field(default_factory=dict)
    lora: float = 0.0  # seconds spent merging LoRAs into the weights (reading the files included)
    cache_hits: dict[str, int] = field(default_factory=dict)
    loaded: dict[str, int] = field(default_factory=dict)  # saved programs loaded instead of traced and compiled
    programs: dict[str, object] = field(default_factory=dict)  # each stage's latest CompiledProgram (time, memory)


def config_signature(configs: dict[str, dict]) -> str:
    """A short hash of component configs: stage files record it, so files from another model are refused."""
    h = hashlib.sha256()
    for name in sorted(configs):
        config = {k: v for k, v in configs[name].items()
                  if not k.startswith("_") and k not in ("torch_dtype", "dtype")}
        h.update(name.encode() + json.dumps(config, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]
