"""LTX-2's text connectors (and MiniMax H3's token refiner) on the runtime, with TPU Diffusion Model.

ComfyUI's LTX-2 model (``LTXAVModel``) turns the text encoder's output into the context its blocks attend to in
``preprocess_text_embeds``: the video and the audio text connectors (two to eight transformer blocks each, 3840 or
4096 wide over 1024 tokens: the prompt, then learnable registers) and, for LTX-2.3, the per-stream caption
projections. ComfyUI runs it while it prepares the conditioning for sampling (``extra_conds``), outside the
diffusion model's forward: left alone it would run on the host for every prompt of every sampling run.

``connector_patches(base_model, settings)`` gives the object patches that run it as a compiled program beside the
bridged forward: ``diffusion_model.preprocess_text_embeds`` replaced, applied and restored by ComfyUI with the rest of
the TPU node's clone. Only the weights it reads (the connectors' and the projections') are placed for it; the rule
table is the model's (LTX-2's connectors: Megatron). One program per prompt length (the text encoder's output is the
prompt's own tokens; the connectors fill up to 1024 with their registers inside the program), as a text encoder that
does not pad compiles one per length.

MiniMax H3 prepares its text the same way (``condition_proj`` and a two-block ``token_refiner`` over the Qwen3-VL
states, once per sampling run in ``extra_conds``): the same patch runs it on the runtime.

Found by feature: a diffusion model with ``preprocess_text_embeds`` and the modules one of those models reads there.
"""

from __future__ import annotations

import contextlib

import torch

from .comfy import BridgedForward, BridgeSettings, comfy_attention_on_runtime, held_forward, runtime_attention
from .program import BridgedModule
from .rules import rules_for

# The modules preprocess_text_embeds reads, by their attribute names: the first ones of each group must be there.
# ComfyUI's LTXAVModel (its video and audio text connectors, LTX-2.3's caption projections) and MiniMaxH3Model.
CONNECTOR_MODULES = (
    (("video_embeddings_connector", "audio_embeddings_connector"), ("caption_projection", "audio_caption_projection")),
    (("condition_proj", "token_refiner"), ()),
)
METHOD = "preprocess_text_embeds"


def _connector_modules(module: torch.nn.Module) -> tuple[str, ...]:
    """The modules ``preprocess_text_embeds`` reads in ``module`` (empty: a model without such a preparation)."""
    for required, optional in CONNECTOR_MODULES:
        if all(isinstance(getattr(module, attr, None), torch.nn.Module) for attr in required):
            return required + optional
    return ()


def _connector_weights(module: torch.nn.Module) -> set[str]:
    names = set()
    for attr in _connector_modules(module):
        sub = getattr(module, attr, None)
        if isinstance(sub, torch.nn.Module):
            names |= {f"{attr}.{n}" for n, _ in sub.named_parameters(remove_duplicate=False)}
            names |= {f"{attr}.{n}" for n, _ in sub.named_buffers(remove_duplicate=False)}
    return names


@contextlib.contextmanager
def _attention_on_runtime(module: torch.nn.Module):
    """While tracing: ComfyUI's attention functions the module holds or names are the runtime's, and so is
    ``comfy.ldm.modules.attention.optimized_attention``, which LTX's attention layers call through the module (the
    connectors call it without the options that carry the diffusion model's override)."""
    import comfy.ldm.modules.attention as attention

    with comfy_attention_on_runtime(module):
        original = attention.optimized_attention
        attention.optimized_attention = runtime_attention
        try:
            yield
        finally:
            attention.optimized_attention = original


def connector_patches(base_model, settings: BridgeSettings) -> dict[str, BridgedForward]:
    """Object patch key -> bridged forward for the text connectors of ``base_model``'s diffusion model (none for a
    model without them)."""
    module = base_model.diffusion_model
    method = getattr(type(module), METHOD, None)
    used = _connector_weights(module)
    if not callable(method) or not used:
        return {}

    def build() -> BridgedForward:
        named = [n for n, _ in module.named_parameters(remove_duplicate=False)]
        named += [n for n, _ in module.named_buffers(remove_duplicate=False)]
        bridged = BridgedModule(
            module=module, method=method, rules=rules_for(module), mesh_spec=settings.mesh,
            attention=settings.attention, options_arg=None, label=f"{type(module).__name__}.{METHOD}",
            trace_context=lambda: _attention_on_runtime(module), skip_weights=frozenset(set(named) - used),
        )
        return BridgedForward(bridged, base_model)

    return {f"diffusion_model.{METHOD}": held_forward(base_model, METHOD, settings, build)}
