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

import logging

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
    a call passes token ids instead of embeddings."""

    def __call__(self, *args, **kwargs):
        ids = args[0] if args else next((kwargs[k] for k in ("input_ids", "input_tokens", "x") if k in kwargs), None)
        if ids is not None and kwargs.get("embeds") is None and self.bridged.skip_weights:
            self.bridged.include_weights(self.bridged.skip_weights)
        return super().__call__(*args, **kwargs)


def _text_forward(cond_stage_model, name: str, module: torch.nn.Module, settings: BridgeSettings) -> TextModelForward:
    transformer = module.transformer
    label = f"{type(transformer).__name__} ({name})" if name else type(transformer).__name__

    def build() -> TextModelForward:
        bridged = BridgedModule(
            module=transformer, method=type(transformer).forward, rules=text_rules_for(transformer),
            mesh_spec=settings.mesh, attention=settings.attention, options_arg=None, recorded_args=("num_tokens",),
            trace_context=lambda: comfy_attention_on_runtime(transformer), skip_weights=embedding_weights(transformer),
            label=label, memory_hint="Split the text encoder over more devices (a larger slice; mesh auto puts its "
                                     "attention heads on tp).",
        )
        prefix = f"{name}.transformer." if name else "transformer."
        return TextModelForward(bridged, cond_stage_model, prefix=prefix)

    return held_forward(cond_stage_model, f"{name}.transformer", settings, build)


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
    refuse_dynamic_patcher(clip.patcher, type(cond_stage_model).__name__)
    clone = clip.clone()
    for name, module in models:
        forward = _text_forward(cond_stage_model, name, module, settings)
        key = f"{name}.transformer.forward" if name else "transformer.forward"
        clone.patcher.add_object_patch(key, forward)
    return clone


def bridged_text_models(clip) -> dict[str, BridgedModule]:
    """The bridged modules behind a TPU Text Encoder's output, by object patch key."""
    return {k: v.bridged for k, v in clip.patcher.object_patches.items() if isinstance(v, TextModelForward)}
