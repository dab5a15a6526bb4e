"""ComfyUI's own CLIP vision models on the runtime: the ``comfy.clip_vision.ClipVisionModel`` side of the native bridge.

``clip_vision_on_runtime(clip_vision, settings)`` returns a copy of ComfyUI's CLIP_VISION object whose image model
(CLIP ViT-H/L/G, SigLIP, DINOv2...) runs as compiled programs. ComfyUI's ``encode_image`` stays ComfyUI's: the
image is resized, cropped and normalised on the host as ComfyUI does it, and only the model's forward runs on the
devices. How it hooks in:

- The CLIP vision object's patcher is cloned and an object patch replaces the image model's ``forward``; ComfyUI
  applies it when ``encode_image`` loads the model and restores the original when another patcher of the same
  model loads: the CLIP vision without the node is unchanged.
- One program per image batch and size (the size is fixed by the model: 224 for CLIP ViT-H); the hidden state
  ComfyUI asks for (the penultimate layer) is a constant of the program.
- Weights are split over the mesh like a text encoder's (attention and MLP matrices over ``tp``); the device copy
  is released by ComfyUI's Unload Models and ``/free`` and when ComfyUI drops the model.
- Attention: ComfyUI picks the vision model's attention when it runs (``optimized_attention_for_device``); while a
  program is traced it is the runtime's (``comfy_attention_on_runtime``).

Nothing here is imported unless ComfyUI runs (or a test imports ComfyUI).
"""

from __future__ import annotations

import copy
import logging

import torch

from ..errors import InputError
from .comfy import BridgedForward, BridgeSettings, comfy_attention_on_runtime, held_forward, refuse_dynamic_patcher
from .program import BridgedModule
from .rules import COLUMN, ROW, VECTOR, ArchRules

log = logging.getLogger(__name__)

# comfy/clip_model.py (CLIPVisionModelProjection, SigLIP too): vision_model.encoder.layers.N.self_attn (q_proj, k_proj,
# v_proj, out_proj), mlp (fc1, fc2). Heads are read from the attention layers.
CLIP_VISION_RULES = ArchRules(
    name="CLIP vision",
    classes=("CLIPVisionModelProjection", "CLIPVision"),
    weights=(
        (r"vision_model\.encoder\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)\.weight$", COLUMN),
        (r"vision_model\.encoder\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj)\.bias$", VECTOR),
        (r"vision_model\.encoder\.layers\.\d+\.self_attn\.out_proj\.weight$", ROW),
        (r"vision_model\.encoder\.layers\.\d+\.mlp\.fc1\.weight$", COLUMN),
        (r"vision_model\.encoder\.layers\.\d+\.mlp\.fc1\.bias$", VECTOR),
        (r"vision_model\.encoder\.layers\.\d+\.mlp\.fc2\.weight$", ROW),
    ),
    heads=("heads", "num_heads", "num_attention_heads"),
    heads_in_submodules=True,
)
VISION_GENERIC = ArchRules(name="generic", generic=True, heads_in_submodules=True)


def vision_rules_for(module: torch.nn.Module) -> ArchRules:
    """CLIP's table for ComfyUI's CLIP / SigLIP vision models, the generic placement for the others (DINOv2...)."""
    return CLIP_VISION_RULES if CLIP_VISION_RULES.matches(module) else VISION_GENERIC


class VisionModelForward(BridgedForward):
    """What the object patch puts in place of the image model's ``forward``."""


def _vision_forward(model: torch.nn.Module, settings: BridgeSettings) -> VisionModelForward:
    def build() -> VisionModelForward:
        bridged = BridgedModule(
            module=model, method=type(model).forward, rules=vision_rules_for(model), mesh_spec=settings.mesh,
            attention=settings.attention, options_arg=None, trace_context=lambda: comfy_attention_on_runtime(model),
            label=type(model).__name__, memory_hint="Split the image model over more devices (a larger slice).",
        )
        return VisionModelForward(bridged, model, prefix="")

    return held_forward(model, "clip_vision", settings, build)


def clip_vision_on_runtime(clip_vision, settings: BridgeSettings):
    """A copy of ``clip_vision`` (ComfyUI's CLIP_VISION object) whose image model runs on the runtime."""
    model = getattr(clip_vision, "model", None)
    patcher = getattr(clip_vision, "patcher", None)
    if not isinstance(model, torch.nn.Module) or patcher is None or not callable(
            getattr(clip_vision, "encode_image", None)):
        raise InputError(f"the clip_vision input holds a {type(clip_vision).__name__}, not a loaded CLIP vision "
                         f"model: connect Load CLIP Vision (or a checkpoint loader's CLIP_VISION output) to TPU CLIP "
                         f"Vision")
    refuse_dynamic_patcher(patcher, type(model).__name__)
    on_runtime = copy.copy(clip_vision)
    on_runtime.patcher = patcher.clone()
    on_runtime.patcher.add_object_patch("forward", _vision_forward(model, settings))
    return on_runtime


def bridged_vision_models(clip_vision) -> dict[str, BridgedModule]:
    """The bridged module behind a TPU CLIP Vision's output, by object patch key ("forward")."""
    return {k: v.bridged for k, v in clip_vision.patcher.object_patches.items() if isinstance(v, VisionModelForward)}
