"""SAM 3 / 3.1 (ComfyUI 0.33's segmentation and video tracking model, a MODEL that Load Checkpoint loads) on the
runtime, with TPU Diffusion Model: its image encoder.

SAM 3's nodes (SAM3 Detect, SAM3 Video Track) do not call the model's forward as a sampler calls a diffusion model's:
they call its detector, its interactive segmenter and its tracker, whose code decides on the host, frame by frame,
what to compute next (scores against thresholds, non-maximum suppression, connected components, which objects to add
or drop, a memory bank of past frames). Every one of them starts from the image encoder, the ViT ``trunk`` of the
vision backbone (32 blocks 1024 wide over the 72x72 patches of a 1008x1008 frame: nearly all of SAM 3's
computation), and calls it once per frame. ``image_encoder_patches`` runs that trunk as a compiled program (one per
frame batch and size); the detector, segmenter and tracker heads stay ComfyUI's, on the host, with the trunk's
features coming back from the devices. SAM 3's own ``forward`` is left alone.

Found by feature: a model with a detector whose vision backbone has a ``trunk``, and a tracker.
"""

from __future__ import annotations

import torch

from .comfy import BridgedForward, BridgeSettings, comfy_attention_on_runtime, held_forward
from .program import BridgedModule
from .rules import rules_for

TRUNK = "detector.backbone.vision_backbone.trunk"


def image_encoder(module: torch.nn.Module) -> torch.nn.Module | None:
    """SAM 3's image encoder (the vision backbone's ViT trunk) in a diffusion model slot, or None for any other
    model."""
    detector = getattr(module, "detector", None)
    backbone = getattr(detector, "backbone", None)
    if not isinstance(getattr(module, "tracker", None), torch.nn.Module) or not isinstance(
            backbone, torch.nn.ModuleDict) or "vision_backbone" not in backbone:
        return None
    trunk = getattr(backbone["vision_backbone"], "trunk", None)
    return trunk if isinstance(trunk, torch.nn.Module) else None


def image_encoder_patches(base_model, settings: BridgeSettings) -> dict[str, BridgedForward]:
    """Object patch key -> bridged forward of SAM 3's image encoder (empty for a model that is not SAM 3)."""
    trunk = image_encoder(base_model.diffusion_model)
    if trunk is None:
        return {}

    def build() -> BridgedForward:
        bridged = BridgedModule(
            module=trunk, method=type(trunk).forward, rules=rules_for(trunk), mesh_spec=settings.mesh,
            attention=settings.attention, options_arg=None, trace_context=lambda: comfy_attention_on_runtime(trunk),
            label=type(trunk).__name__,
            memory_hint="Split the image encoder over more devices (a larger slice).",
        )
        return BridgedForward(bridged, base_model, prefix=f"diffusion_model.{TRUNK}.")

    return {f"diffusion_model.{TRUNK}.forward": held_forward(base_model, TRUNK, settings, build)}
