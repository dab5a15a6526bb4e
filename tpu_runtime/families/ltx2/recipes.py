"""LTX-2's recipes (``SPEC.recipes``): the settings of each sampling of a generation made in several stage calls."""

from __future__ import annotations

import dataclasses

from ...engine.stages import SampleSettings
from ...engine.validation import neighbours
from ...errors import InputError


def two_stage_settings(family, settings: SampleSettings) -> tuple[SampleSettings, SampleSettings]:
    """The two-stage recipe for ``settings`` (the final size): the first sampling at half the width and height,
    then, after the spatial latent upsampler, 3 refine steps over the stage-2 distilled sigmas with one transformer
    pass a step (guidance 1, no STG or isolation: the distilled stage-2 settings), the same seed. The LoRAs of
    ``loras_2`` (``--lora-2``: LTX-2's distilled LoRA in its own recipe) join the refine stage only."""
    if family.upsampler_path is None:
        raise InputError(f"--two-stage needs the spatial latent upsampler: {family.label} has none; give its folder "
                         "with --upsampler (with single files: --latent-upscaler FILE)")
    m = 2 * family.size_multiple
    if settings.height % m or settings.width % m:
        nearest = "; ".join(f"{name} {' or '.join(map(str, neighbours(v, m, m)))}"
                            for name, v in (("height", settings.height), ("width", settings.width)) if v % m)
        raise InputError(f"--two-stage samples at half the size first: height and width must be multiples of {m} "
                         f"(got {settings.width}x{settings.height}, width x height; nearest: {nearest})")
    if settings.cache is not None:
        raise InputError("--cache with --two-stage: step caching is not offered for LTX-2; leave --cache out")
    first = dataclasses.replace(settings, height=settings.height // 2, width=settings.width // 2, loras_2=())
    refine = dataclasses.replace(settings, steps=3, guidance=1.0, loras=settings.loras + settings.loras_2, loras_2=(),
                                 options={**settings.options, "sigmas": "stage2", "audio_guidance": 1.0,
                                          "stg_scale": 0.0, "modality_scale": 1.0})
    return first, refine
