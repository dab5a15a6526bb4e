"""TPU Diffusion Model's function: a clone of ComfyUI's MODEL whose diffusion model runs on the runtime (the forward
as ``comfy.py`` bridges it, and LTX-2's text connectors as ``connectors.py`` does; of SAM 3, which Load Checkpoint
loads as a MODEL too, its image encoder as ``segmentation.py`` does)."""

from __future__ import annotations

from ..errors import InputError
from .comfy import KEEP_CAST, BridgeSettings, compute_dtype_patch, forward_for, refuse_dynamic_patcher
from .connectors import connector_patches  # LTX-2's text connectors, run while ComfyUI prepares the conds
from .segmentation import image_encoder_patches  # SAM 3: its nodes call its parts, the image encoder first


def diffusion_model_on_runtime(patcher, settings: BridgeSettings):
    """A clone of ``patcher`` (ComfyUI's MODEL) whose diffusion model runs on the runtime."""
    refuse_dynamic_patcher(patcher, type(getattr(getattr(patcher, "model", None), "diffusion_model", patcher)).__name__)
    clone = patcher.clone()
    base = clone.model
    if not hasattr(base, "diffusion_model"):
        raise InputError(f"the MODEL input holds a {type(base).__name__} without a diffusion model: connect a "
                         f"diffusion model loader (Load Diffusion Model, Load Checkpoint)")
    encoder = image_encoder_patches(base, settings)
    if encoder:  # SAM 3: its own forward (the detector's host decisions) stays ComfyUI's
        for key, patch in encoder.items():
            clone.add_object_patch(key, patch)
    else:
        forward = forward_for(base, settings)
        clone.add_object_patch(f"diffusion_model.{forward.bridged.method_name}", forward)
    for key, patch in connector_patches(base, settings).items():
        clone.add_object_patch(key, patch)
    cast = compute_dtype_patch(base, settings.compute_dtype)
    if cast is not KEEP_CAST:  # always: the live attribute may be another clone's patch, undone when this one loads
        clone.add_object_patch("manual_cast_dtype", cast)
    return clone
