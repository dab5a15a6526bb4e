"""ComfyUI's own text encoders on the runtime: the ``comfy.sd.CLIP`` side of the native bridge.

``text_encoder_on_runtime(clip, settings)`` returns a clone of ComfyUI's CLIP object whose text models run as
compiled programs. Tokenizers, prompt weights, sections, schedules and hooks stay ComfyUI's: CLIPTextEncode and every
node that encodes through the CLIP object run ComfyUI's own code down to the text model. How it hooks in:

- A CLIP object holds one text model per encoder it combines (umT5-XXL for Wan; T5-XXL for LTX-Video; LLaMA and
  CLIP-L for HunyuanVideo; Qwen, Gemma...), each inside one of ComfyUI's ``SDClipModel``s as ``.transformer``. An
  object patch on the clone's patcher replaces each ``transformer.forward``; ComfyUI applies it when it loads the
  text encoder for an encode and restores the original when another patcher of it loads.
- ComfyUI looks the tokens' embeddings up on the host (its prompt-embedding and textual-inversion logic) and calls
  the text model with them: the program takes the embeddings, so the embedding matrix (a quarter of umT5-XXL) is not
  placed on the devices unless a caller passes token ids.
- One program per padded length (and batch): ComfyUI also passes the prompt's token count, as a Python list, which
  T5 and LLaMA never read; it keys a program only for a model that reads it (CLIP-L's pooled output).
- Weights are split over the mesh by the rule tables (``bridge/rules.py``: T5, LLaMA-style, CLIP), attention heads
  over ``tp``: a 12B encoder does not fit one chip. fp8 files stay fp8 on the devices (ComfyUI's ops cast them
  inside the program). Weight patches (a LoRA's text-encoder part) are followed as the diffusion model's are.
- Attention: ComfyUI picks the text model's attention when it runs (``optimized_attention_for_device``); while a
  program is traced it is the runtime's (``comfy_attention_on_runtime``).
- The device copy is released by ComfyUI's Unload Models and ``/free`` and when ComfyUI drops the text encoder.

Nothing here is imported unless ComfyUI runs (or a test imports ComfyUI).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys

import torch

from ..errors import InputError
from .comfy import BridgedForward, BridgeSettings, comfy_attention_on_runtime, held_forward, refuse_dynamic_patcher
from .program import BridgedModule
from .rules import text_rules_for

log = logging.getLogger(__name__)


def text_models(cond_stage_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, SDClipModel-like module) of every text model a CLIP object holds: a module with a ``transformer``
    that ComfyUI feeds embeddings to (``process_tokens``)."""
    found = []
    for name, module in cond_stage_model.named_modules():
        if isinstance(getattr(module, "transformer", None), torch.nn.Module) and callable(
                getattr(module, "process_tokens", None)):
            found.append((name, module))
    return found


def embedding_weights(transformer: torch.nn.Module) -> frozenset:
    """The names of the input embedding's tensors (left on the host while calls pass embeddings)."""
    getter = getattr(transformer, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if not isinstance(embedding, torch.nn.Module):
        return frozenset()
    for name, module in transformer.named_modules():
        if module is embedding:
            prefix = f"{name}." if name else ""
            return frozenset(prefix + n for n, _ in module.named_parameters(remove_duplicate=False))
    return frozenset()


class TextModelForward(BridgedForward):
    """What the object patch puts in place of a text model's ``forward``: the embedding goes to the devices only if
    a call passes token ids instead of embeddings; what a vision-language model computes from its images' host values
    is computed on the host (``with_image_inputs``), and what its forward records on itself for ComfyUI's code around
    it is recorded on the host (``record_host_values``)."""

    def __call__(self, *args, **kwargs):
        ids = args[0] if args else next((kwargs[k] for k in ("input_ids", "input_tokens", "x") if k in kwargs), None)
        if ids is not None and kwargs.get("embeds") is None and self.bridged.skip_weights:
            self.bridged.include_weights(embedding_weights(self.bridged.module))
        kwargs = with_image_inputs(self.bridged.module, kwargs)
        out = super().__call__(*args, **kwargs)
        record_host_values(self.bridged.module, ids, kwargs)
        return out


# Arguments of a text model's forward whose tensors are constants of its program: where a vision-language model puts
# its image features among the tokens (a boolean mask its code indexes with).
TEXT_CONSTANT_ARGUMENTS = ("visual_pos_masks",)


def with_image_inputs(transformer: torch.nn.Module, kwargs: dict) -> dict:
    """The keyword arguments of a call of a vision-language text model (Qwen2.5-VL / Qwen3-VL: ``build_image_inputs``)
    with what its forward would compute from the images' host values computed here, as its own code does: the
    multimodal RoPE positions (from each image's patch grid), the image positions' mask and DeepStack's per-layer
    features. The program then takes them as inputs (the mask as a constant), and the images' grids stay out of it."""
    build = getattr(transformer, "build_image_inputs", None)
    info = kwargs.get("embeds_info") or []
    embeds = kwargs.get("embeds")
    if not callable(build) or embeds is None or kwargs.get("position_ids") is not None or not any(
            isinstance(e, dict) and e.get("type") == "image" for e in info):
        return kwargs
    position_ids, masks, deepstack = build(embeds, info)
    return {**kwargs, "position_ids": position_ids, "visual_pos_masks": masks, "deepstack_embeds": deepstack,
            "embeds_info": [{k: v for k, v in e.items() if k != "extra"} for e in info]}


# What text models' forwards record on themselves for the code around them (``record_host_values``).
HOST_RECORDED = ("last_token_tags",)


def record_host_values(transformer: torch.nn.Module, ids, kwargs: dict) -> None:
    """What a text model's forward records on itself for the code around it to read after the encode, recorded as its
    forward records it (a program leaves the model's own state as it was). MiniMax H3's Qwen3-VL: the tokens'
    modality tags (``token_tags_from_embeds_info``: vision blocks 0, text 1), which its CLIP model returns beside the
    embeddings."""
    code = sys.modules.get(type(transformer).__module__)
    tags = getattr(code, "token_tags_from_embeds_info", None)
    if callable(tags):
        embeds = kwargs.get("embeds")
        seq = embeds.shape[1] if embeds is not None else ids.shape[1]
        transformer.last_token_tags = tags(seq, kwargs.get("embeds_info") or [])


def vision_tower(transformer: torch.nn.Module) -> torch.nn.Module | None:
    """A vision-language text model's vision tower (Qwen2.5-VL, Qwen3-VL: ``visual``, called with the images' patches
    and their patch grids while ComfyUI prepares the prompt's embeddings), or None."""
    visual = getattr(transformer, "visual", None)
    if not isinstance(visual, torch.nn.Module):
        return None
    try:
        parameters = inspect.signature(type(visual).forward).parameters
    except (TypeError, ValueError):
        return None
    return visual if "grid_thw" in parameters else None


def _weights_of(module: torch.nn.Module, prefix: str) -> frozenset:
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in module.named_buffers(remove_duplicate=False)]
    return frozenset(prefix + n for n in names)


def _text_forward(cond_stage_model, name: str, module: torch.nn.Module, settings: BridgeSettings) -> TextModelForward:
    transformer = module.transformer
    label = f"{type(transformer).__name__} ({name})" if name else type(transformer).__name__
    visual = vision_tower(transformer)

    def build() -> TextModelForward:
        skipped = embedding_weights(transformer) | (_weights_of(visual, "visual.") if visual is not None else set())
        bridged = BridgedModule(
            module=transformer, method=type(transformer).forward, rules=text_rules_for(transformer),
            mesh_spec=settings.mesh, attention=settings.attention, options_arg=None, recorded_args=("num_tokens",),
            device_constant_args=TEXT_CONSTANT_ARGUMENTS, host_recorded=HOST_RECORDED,
            trace_context=lambda: comfy_attention_on_runtime(transformer), skip_weights=frozenset(skipped),
            label=label, memory_hint="Split the text encoder over more devices (a larger slice; mesh auto puts its "
                                     "attention heads on tp).",
        )
        prefix = f"{name}.transformer." if name else "transformer."
        return TextModelForward(bridged, cond_stage_model, prefix=prefix)

    return held_forward(cond_stage_model, f"{name}.transformer", settings, build)


@contextlib.contextmanager
def _constants_evaluated(context):
    """``context`` entered, and what the traced code computes from constants alone (a vision tower's positions and
    interpolation indices, from its patch grid) computed while it is traced (``jax.ensure_compile_time_eval``): its
    code reads such values back as Python numbers (``.tolist()``)."""
    import jax

    with context, jax.ensure_compile_time_eval():
        yield


def _vision_forward(cond_stage_model, name: str, visual: torch.nn.Module, settings: BridgeSettings) -> BridgedForward:
    """A vision tower as a program of its own: one per image size (its patch grid, a constant of the program: the
    tower's code computes its positions from it on the host)."""
    label = f"{type(visual).__name__} ({name})" if name else type(visual).__name__

    def build() -> BridgedForward:
        bridged = BridgedModule(
            module=visual, method=type(visual).forward, rules=text_rules_for(visual), mesh_spec=settings.mesh,
            attention=settings.attention, options_arg=None, constant_args=("grid_thw",),
            trace_context=lambda: _constants_evaluated(comfy_attention_on_runtime(visual)), label=label,
            memory_hint="Split the vision tower over more devices (a larger slice), or use smaller images.",
        )
        prefix = f"{name}.transformer.visual." if name else "transformer.visual."
        return BridgedForward(bridged, cond_stage_model, prefix=prefix)

    return held_forward(cond_stage_model, f"{name}.transformer.visual", settings, build)


# Text models whose program on the runtime is known not to equal ComfyUI's own run yet, by the module of their class
# (e.g. ``{"comfy.text_encoders.gemma4": "Gemma 4"}``): refused, so that TPU Text Encoder names it and the automatic
# mode leaves it on the host, rather than a wrong result. None now: Gemma 4 (LTX-2.5's encoders) was here until its
# difference was found in XLA's CPU backend, not in the bridge (``engine/program_key.compiler_options``).
KNOWN_DIFFERENT: dict[str, str] = {}


def refuse_known_differences(transformer: torch.nn.Module) -> None:
    """InputError for a text model of ``KNOWN_DIFFERENT`` (by the module of any class it derives from)."""
    for cls in type(transformer).__mro__:
        family = KNOWN_DIFFERENT.get(cls.__module__)
        if family is not None:
            raise InputError(f"TPU Text Encoder does not run {family} text encoders yet ({type(transformer).__name__}): "
                             f"on the runtime their result still differs from ComfyUI's own run (docs/templates.md); "
                             f"connect the loader's CLIP output directly to encode on the host")


def text_encoder_on_runtime(clip, settings: BridgeSettings):
    """A clone of ``clip`` (ComfyUI's CLIP object) whose text models run on the runtime."""
    cond_stage_model = getattr(clip, "cond_stage_model", None)
    if cond_stage_model is None or not hasattr(clip, "patcher"):
        raise InputError(f"the clip input holds a {type(clip).__name__} without a text encoder: connect Load CLIP "
                         f"(or a checkpoint loader's CLIP output) to TPU Text Encoder")
    models = text_models(cond_stage_model)
    if not models:
        raise InputError(f"TPU Text Encoder does not know how to run {type(cond_stage_model).__name__}: it holds no "
                         f"text model ComfyUI feeds embeddings to; remove the TPU Text Encoder node to encode on the "
                         f"host")
    for name, module in models:
        refuse_known_differences(module.transformer)
    refuse_dynamic_patcher(clip.patcher, type(cond_stage_model).__name__)
    clone = clip.clone()
    for name, module in models:
        forward = _text_forward(cond_stage_model, name, module, settings)
        key = f"{name}.transformer.forward" if name else "transformer.forward"
        clone.patcher.add_object_patch(key, forward)
        visual = vision_tower(module.transformer)
        if visual is not None:
            clone.patcher.add_object_patch(key.replace(".forward", ".visual.forward"),
                                           _vision_forward(cond_stage_model, name, visual, settings))
    return clone


def bridged_text_models(clip) -> dict[str, BridgedModule]:
    """The bridged modules behind a TPU Text Encoder's output (text models and vision towers), by object patch key."""
    return {k: v.bridged for k, v in clip.patcher.object_patches.items() if isinstance(v, BridgedForward)}
