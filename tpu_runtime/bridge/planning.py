"""The native bridge's programs for a mesh of devices this machine may not have (``plan --comfy-model``).

Each function builds the ``BridgedModule`` the TPU node would build for a ComfyUI module (at its released size, on
``meta``), gives it the slice's mesh, and returns the very programs it would compile — ComfyUI's own code traced
through torchax — with their weights and inputs as shape structs placed as the bridge places them, ready for
``plan``'s compiler (``tools/plan_compile.compile_program``):

- ``step_program``: the diffusion model's ``_forward`` for the call a sampler makes (TPU Diffusion Model);
- ``text_program``: a text model's ``forward`` for one padded prompt, with the embeddings ComfyUI looks up on the
  host (TPU Text Encoder);
- ``decode_programs``: a causal video VAE's decoder as its two programs, the first latent frame and every later
  chunk as the ComfyUI in use chunks it (one latent frame in 0.3.64, two in 0.33), the convolution caches carried
  between them in their steady form (TPU VAE).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..engine.attention import AttentionConfig
from ..engine.sharding import MeshSpec, parse_mesh
from . import quantized
from .calls import split_call
from .comfy import comfy_attention, comfy_attention_on_runtime
from .program import BridgedModule
from .rules import rules_for, text_rules_for
from .text import embedding_weights
from .vae import VAE_RULES, CausalFrameCache, comfy_part_calls, frame_spec, part_trace_context


@dataclass
class PlannedProgram:
    """A bridged program for ``plan``: what ``StageProgram`` needs, and the mesh it was placed on."""

    name: str
    fn: object
    weights: dict
    inputs: list
    mesh: MeshSpec
    describe: str
    component: str

    def stage_program(self, key):
        from ..engine.stages import StageProgram

        return StageProgram(stage=self.name, fn=self.fn, example=(self.weights, self.inputs), key=key,
                            describe=self.describe, scope=contextlib.nullcontext, components=(self.component,))


def _on_mesh(bridged: BridgedModule, mesh_text: str | None, devices: list) -> MeshSpec:
    """Put ``bridged`` on a mesh of ``devices`` (the node's ``auto`` unless ``mesh_text``), checked as the node
    checks it."""
    from ..engine.runtime import get_runtime

    spec = parse_mesh(mesh_text) or bridged.rules.auto_mesh(bridged.module, len(devices))
    bridged.rules.check_mesh(bridged.module, spec, len(devices))
    bridged._mesh = get_runtime().make_mesh(spec, devices)
    return spec


def abstract_weights(bridged: BridgedModule) -> dict:
    """Every array the bridge places, as a shape struct with the sharding its rules give it on the module's mesh (a
    tensor shared by two names is one struct); a quantized weight as its packed data and scales
    (``quantized.parts_of``), as the devices hold it."""
    import jax

    from ..engine.dtypes import jax_dtype
    from ..engine.runtime import get_runtime

    runtime, mesh = get_runtime(), bridged.mesh
    named = bridged._named()
    bridged._set_quantized(quantized.describe_all(named), replace=True)
    parts = quantized.device_parts(named)
    specs = bridged._specs(named, parts)
    structs: dict[tuple, object] = {}
    state = {}
    for part in parts:
        if part.key not in structs:
            structs[part.key] = jax.ShapeDtypeStruct(tuple(part.value.shape), jax_dtype(part.value.dtype),
                                                     sharding=runtime.sharding(mesh, specs[part.name]))
        state[part.name] = structs[part.key]
    return state


def step_program(module: torch.nn.Module, call: tuple, devices: list, mesh_text: str | None,
                 attention: AttentionConfig | None, describe: str) -> PlannedProgram:
    """The diffusion model's step for ``call`` (``(args, kwargs)`` of ``_forward``, meta tensors) as TPU Diffusion
    Model runs it: ComfyUI's attention override set to the runtime's, a leading batch dp divides split over dp."""
    from .comfy import host_prepared

    prepared = host_prepared(module)  # MiniMax H3: its host part first, the compiled part planned
    bridged = BridgedModule(module=module, method=prepared[1] if prepared else type(module)._forward,
                            rules=rules_for(module), attention=attention or AttentionConfig(),
                            label=type(module).__name__)
    spec = _on_mesh(bridged, mesh_text, devices)
    weights = abstract_weights(bridged)
    if prepared:
        call = ((), prepared[0](module, *call[0], **call[1]))
    positional, keyword, options = bridged._arguments(*call)
    options = {"optimized_attention_override": comfy_attention, **(options or {})}
    split = split_call((positional, keyword))
    fn, _, _ = bridged.program_function(split, options, bridged.mesh)
    return PlannedProgram("sample", fn, weights, bridged._abstract_inputs(split), spec, describe, "diffusion_model")


def text_program(module: torch.nn.Module, tokens: int, devices: list, mesh_text: str | None,
                 attention: AttentionConfig | None, describe: str) -> PlannedProgram:
    """A text model's ``forward`` (ComfyUI's T5, LLaMA, ...) for one prompt padded to ``tokens``, called as
    ComfyUI's ``SDClipModel`` calls it: the embeddings looked up on the host (the embedding matrix stays there),
    the attention mask, the token count."""
    bridged = BridgedModule(module=module, method=type(module).forward, rules=text_rules_for(module),
                            attention=attention or AttentionConfig(), options_arg=None,
                            recorded_args=("num_tokens",), trace_context=lambda: comfy_attention_on_runtime(module),
                            skip_weights=embedding_weights(module), label=type(module).__name__)
    spec = _on_mesh(bridged, mesh_text, devices)
    weights = abstract_weights(bridged)
    width = module.get_input_embeddings().weight.shape[1]
    mask = torch.empty(1, tokens, dtype=torch.int64, device="meta")
    embeds = torch.empty(1, tokens, width, dtype=torch.float32, device="meta")
    positional, keyword, _ = bridged._arguments(
        (None, mask), {"embeds": embeds, "num_tokens": [tokens], "intermediate_output": None,
                       "final_layer_norm_intermediate": True, "dtype": torch.float32, "embeds_info": []})
    recorded = {name: keyword.pop(name) for name in bridged.recorded_args if isinstance(keyword.get(name), list)}
    split = split_call((positional, keyword))
    fn, _, _ = bridged.program_function(split, None, bridged.mesh, recorded)
    return PlannedProgram("encode", fn, weights, bridged._abstract_inputs(split), spec, describe, "text_encoder")


def tile_decode_program(vae_model: torch.nn.Module, tile: tuple[int, ...], devices: list, mesh_text: str | None,
                        attention: AttentionConfig | None, describe: str) -> PlannedProgram:
    """The decoder of a VAE that tiles and chunks the video itself (MiniMax H3's: ``handles_tiling``) for one tile of
    latents of shape ``tile`` (its spatial tile, its temporal chunk with overlap), as TPU VAE runs each of them: the
    tiling, blending and chunking stay on the host; the tile's frames split over the mesh along their width."""
    decoder = vae_model.decoder
    bridged = BridgedModule(module=decoder, method=type(decoder).forward, rules=VAE_RULES, options_arg=None,
                            input_spec=frame_spec, attention=attention or AttentionConfig(),
                            label=f"{type(vae_model).__name__}.decoder")
    bridged.trace_context = lambda: part_trace_context(decoder, devices)
    spec = _on_mesh(bridged, mesh_text, devices)
    weights = abstract_weights(bridged)
    z = torch.empty(tile, dtype=torch.bfloat16, device="meta")
    split = split_call(bridged._arguments((z,), {})[:2])
    fn, _, _ = bridged.program_function(split, None, bridged.mesh)
    return PlannedProgram("decode", fn, weights, bridged._abstract_inputs(split), spec, describe, "vae")


def decode_programs(vae_model: torch.nn.Module, latent: tuple[int, ...], devices: list, mesh_text: str | None,
                    attention: AttentionConfig | None, describe: str) -> list[PlannedProgram]:
    """A causal VAE's decoder (ComfyUI's Wan VAEs: a list of causal-convolution caches carried between calls) as TPU
    VAE runs it, for latents of ``latent``'s frame size: the first chunk's program, which leaves the caches in their
    steady form, and the steady program of every later chunk, which takes them and leaves them the same; frames split
    over the mesh along their width. The chunks are those ComfyUI's own ``decode`` makes (observed on ``meta``, see
    ``vae.comfy_part_calls``): one latent frame a call in ComfyUI 0.3.64, the first frame and then two a call in
    0.33."""
    import jax

    from ..engine.runtime import get_runtime, tracing

    decoder = vae_model.decoder
    calls = comfy_part_calls(vae_model, "decoder", "decode", (1, latent[1], 5, *latent[3:]))
    if len(calls) < 3:
        raise ValueError(f"{type(vae_model).__name__} decodes without chunks: it has no later-chunk program")
    bridged = BridgedModule(module=decoder, method=type(decoder).forward, rules=VAE_RULES,
                            attention=attention or AttentionConfig(), options_arg=None, mutable_lists=True,
                            settle=CausalFrameCache(lambda: calls[1]), input_spec=frame_spec,
                            trace_context=lambda: part_trace_context(decoder, ()), label=type(decoder).__name__)
    spec = _on_mesh(bridged, mesh_text, devices)
    weights = abstract_weights(bridged)
    dtype = next(decoder.parameters()).dtype
    positional, keyword, _ = bridged._arguments((), _recorded_arguments(calls[0], dtype))
    first = split_call((positional, keyword))
    plan = bridged._settle_plan(first, None, {}, weights, positional, keyword)
    fn, _, layouts = bridged.program_function(first, None, bridged.mesh, {}, plan)
    first_inputs = bridged._abstract_inputs(first)
    with tracing():
        _, arrays = jax.eval_shape(fn, weights, first_inputs)
    runtime, mesh = get_runtime(), bridged.mesh

    def placed(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=runtime.sharding(mesh, bridged._spec(tuple(a.shape))))

    left = [[placed(arrays[ref]) if kind == "array" else ref for kind, ref in layout] for layout in layouts]
    later = bridged._probe_call(*bridged.settle.probe(list(positional), dict(keyword)), left)
    later_fn, _, _ = bridged.program_function(later, None, mesh, {}, None)
    frames = next((shape[2] for kind, shape in calls[1].values() if kind == "tensor" and len(shape) == 5), None)
    chunk = "latent frame" if frames == 1 else f"chunk of {frames} latent frames" if frames else "chunk"
    return [PlannedProgram("decode_first", fn, weights, first_inputs, spec, f"{describe}: the first latent frame",
                           "vae"),
            PlannedProgram("decode_later", later_fn, weights, bridged._abstract_inputs(later), spec,
                           f"{describe}: every later {chunk}, the caches carried on the devices", "vae")]


def _recorded_arguments(call: dict, dtype) -> dict:
    """The keyword arguments of a recorded call (``vae.comfy_part_calls``), tensors on ``meta``."""
    arguments = {}
    for name, (kind, value) in call.items():
        if kind == "tensor":
            arguments[name] = torch.empty(value, dtype=dtype, device="meta")
        elif kind == "list":
            arguments[name] = list(value)
        else:
            arguments[name] = value
    return arguments
