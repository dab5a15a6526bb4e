"""ComfyUI's own VAEs on the runtime: the ``comfy.sd.VAE`` side of the native bridge.

``vae_on_runtime(vae, settings)`` returns a copy of ComfyUI's VAE object whose encoder and decoder run as compiled
programs. Everything around them stays ComfyUI's: VAEDecode, VAEEncode, the tiled nodes and every node that calls
the VAE object (WanImageToVideo, LTXVImgToVideo, ...) run ComfyUI's own code, which calls the encoder and the
decoder; the few host operations around them (a 1x1 convolution of the latents, LTX-Video's decode noise drawn from
ComfyUI's generator) stay on the host as ComfyUI does them. How it hooks in:

- The VAE's patcher is cloned and object patches replace ``first_stage_model.decoder.forward`` and
  ``encoder.forward`` (a VAE without those parts: its ``decode`` and ``encode`` themselves); ComfyUI applies them
  when it loads the VAE for a decode or an encode and restores the originals when another patcher of the same VAE
  loads: the VAE without the node is unchanged.
- Causal video VAEs that decode chunk by chunk (ComfyUI's Wan 2.1 and 2.2 VAEs: one latent frame per decoder call,
  a list of causal-convolution caches carried between calls) keep their caches on the devices between calls
  (``BridgedModule.mutable_lists``) and settle them after the first call into their steady form
  (``CausalFrameCache``): two programs whatever the frame count, a first-chunk one and a later-chunk one. VAEs that
  decode a whole video at once (HunyuanVideo's, LTX-Video's) and image VAEs: one program per latent shape.
- Frames are split over the mesh: every tensor going into (or carried between) the programs is split along its
  width over the mesh axes that divide it, then its height (``engine.sharding.frame_split_spec``); XLA adds the
  convolutions' halos. The weights (a few hundred MB) are whole on every device.
- Attention: ComfyUI chose the VAE's attention function when it built the model (on the CPU, a split attention
  that asks torch for free memory); while a program is traced it is the runtime's (``comfy_attention_on_runtime``).
- Memory: ComfyUI estimates a decode's memory for the device it decodes on and falls back to a tiled decode when
  torch runs out of it. On the runtime the host holds only the latents and the frames, so the copy estimates that;
  the tiled nodes' tiles run on the runtime too; a device out of memory is an error naming the mesh, never a
  silent decode on the host.
- The device copy is released with the diffusion model's: ComfyUI's Unload Models and ``/free``, and ComfyUI
  dropping the VAE.

Nothing here is imported unless ComfyUI runs (or a test imports ComfyUI).
"""

from __future__ import annotations

import copy
import inspect
import logging
import math

import torch

from ..engine.sharding import frame_split_spec
from ..errors import InputError
from .audio_vae import audio_vae_parts
from .comfy import BridgedForward, BridgeSettings, comfy_attention_on_runtime, held_forward
from .program import BridgedModule, CacheSettling
from .rules import ArchRules

log = logging.getLogger(__name__)

# A VAE's weights are small next to its activations: whole on every device, the frames split instead.
VAE_RULES = ArchRules(name="VAE")

# The arguments of a causal VAE part that carry its caches between calls (ComfyUI's Wan VAEs).
CACHE_ARGUMENTS = ("feat_cache", "feat_idx")


class CausalFrameCache(CacheSettling):
    """The causal-convolution caches of ComfyUI's Wan VAEs (``comfy/ldm/wan/vae.py``, ``vae2_2.py``), in their steady
    form from the first call on.

    Each cache slot holds the last input frames (``CACHE_T`` = 2) of one causal convolution, on axis 2. After the
    first chunk a slot holds fewer frames than later (one), and an upsampling slot holds the marker ``"Rep"``
    (no frames yet: its time convolution zero-pads). Both mean zero frames before what is held, which the
    convolution pads anyway: a slot with its missing frames as zeros in front, and a marker as all zeros, give the
    same numbers and the same shapes as every later call, so the second call runs the later calls' program.

    ``probe`` gives the second call's arguments from the first's: the same, without the arguments only the first
    chunk takes (Wan 2.2's ``first_chunk``), with ``later_frames`` frames where the first chunk is shorter (the
    encoder takes one frame, then chunks of the temporal compression factor)."""

    FIRST_ONLY = ("first_chunk",)

    def __init__(self, later_frames: int | None = None, time_axis: int = 2):
        self.later_frames = later_frames
        self.time_axis = time_axis

    def probe(self, positional: list, keyword: dict) -> tuple[list, dict]:
        keyword = {k: v for k, v in keyword.items() if k not in self.FIRST_ONLY}
        if self.later_frames:
            positional = [self._later(v) if i == 0 else v for i, v in enumerate(positional)]
            if "x" in keyword:
                keyword["x"] = self._later(keyword["x"])
        return positional, keyword

    def _later(self, x):
        if not isinstance(x, torch.Tensor) or x.ndim <= self.time_axis:
            return x
        shape = list(x.shape)
        shape[self.time_axis] = self.later_frames
        return torch.empty(shape, dtype=x.dtype, device="meta")

    def settle(self, value, steady):
        shape = tuple(steady.shape)
        axis = self.time_axis
        if isinstance(value, str):  # a marker: no frames held yet
            return torch.zeros(shape, dtype=_torch_dtype(steady.dtype), device="jax")
        if not isinstance(value, torch.Tensor) or value.ndim != len(shape):
            return None
        have = tuple(value.shape)
        if have[:axis] != shape[:axis] or have[axis + 1:] != shape[axis + 1:] or have[axis] >= shape[axis]:
            return None
        missing = list(shape)
        missing[axis] = shape[axis] - have[axis]
        return torch.cat([value.new_zeros(missing), value], dim=axis)


def _torch_dtype(dtype) -> torch.dtype:
    import numpy as np

    name = np.dtype(dtype).name
    return getattr(torch, name)


# --- the parts of a VAE ------------------------------------------------------------------------------------------
def vae_parts(first_stage_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """(object patch key, module, method) of each part to bridge: the encoder's and decoder's ``forward`` where
    the model has them, else its own ``decode`` / ``encode`` (an audio VAE: ``audio_vae.py``)."""
    audio = audio_vae_parts(first_stage_model)
    if audio is not None:
        return audio
    parts = []
    for name, method in (("decoder", "decode"), ("encoder", "encode")):
        sub = getattr(first_stage_model, name, None)
        if isinstance(sub, torch.nn.Module):
            parts.append((f"{name}.forward", sub, type(sub).forward))
        elif callable(getattr(type(first_stage_model), method, None)):
            parts.append((method, first_stage_model, getattr(type(first_stage_model), method)))
    return parts


def _caches(method) -> bool:
    """Whether a part takes ComfyUI's causal cache lists."""
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return all(name in parameters for name in CACHE_ARGUMENTS)


def _temporal_factor(vae) -> int | None:
    """Frames per latent frame of a video VAE (ComfyUI's ``downscale_index_formula``), else None."""
    formula = getattr(vae, "downscale_index_formula", None)
    if isinstance(formula, (tuple, list)) and formula and isinstance(formula[0], int) and formula[0] > 1:
        return formula[0]
    return None


class VAEPartForward(BridgedForward):
    """What the object patch puts in place of a VAE part: checks for Cancel (between chunks of a long decode),
    runs the program."""


def _part_forward(vae, key: str, module: torch.nn.Module, method, settings: BridgeSettings) -> VAEPartForward:
    first_stage_model = vae.first_stage_model
    label = f"{type(first_stage_model).__name__}.{key.removesuffix('.forward')}"
    caches = _caches(method)
    later = _temporal_factor(vae) if key.startswith("encoder") else None

    def build() -> VAEPartForward:
        bridged = BridgedModule(
            module=module, method=method, rules=VAE_RULES, mesh_spec=settings.mesh, attention=settings.attention,
            options_arg=None, mutable_lists=caches, settle=CausalFrameCache(later) if caches else None,
            input_spec=frame_spec, trace_context=lambda: comfy_attention_on_runtime(module), label=label,
            memory_hint="Split the frames over more devices (a larger slice, mesh auto), or decode in tiles "
                        "(VAE Decode (Tiled)): the tiles run on the devices too.",
        )
        prefix = key.removesuffix("forward") if key.endswith(".forward") else ""
        return VAEPartForward(bridged, first_stage_model, prefix=prefix)

    return held_forward(first_stage_model, key, settings, build)


def frame_spec(shape: tuple[int, ...], mesh_sizes: dict) -> tuple:
    """``input_spec`` of a bridged VAE part: a frame (``[..., H, W]``, 4 or more dimensions) split along its width
    over the mesh axes that divide it, then its height; anything else whole on every device."""
    if len(shape) < 4:
        return ()
    return frame_split_spec(mesh_sizes, shape)


# --- what the host holds ------------------------------------------------------------------------------------------
def _scaled_elements(shape, ratio, channels: int) -> int:
    dims = list(shape[2:])
    ratios = list(ratio) if isinstance(ratio, (tuple, list)) else [ratio] * len(dims)
    ratios = ([1] * len(dims) + ratios)[-len(dims):] if dims else []
    count = shape[0] * channels
    for size, r in zip(dims, ratios):
        count *= max(1, int(r(size) if callable(r) else size * r))
    return count


def host_memory_decode(vae):
    """Bytes the host holds for a decode on the runtime: the latents and the float32 frames."""

    def estimate(shape, dtype) -> int:
        try:
            frames = _scaled_elements(shape, vae.upscale_ratio, vae.output_channels)
        except Exception:  # noqa: BLE001 - an unusual ratio: the latents alone, scaled as image VAEs scale
            frames = math.prod(shape) * 64
        return max(1, (math.prod(shape) + frames) * 4)

    return estimate


def host_memory_encode(vae):
    """Bytes the host holds for an encode on the runtime: the pixels and the latents."""

    def estimate(shape, dtype) -> int:
        return max(1, math.prod(shape) * 4 * 2)

    return estimate


# --- the node's work --------------------------------------------------------------------------------------------------
def vae_on_runtime(vae, settings: BridgeSettings):
    """A copy of ``vae`` (ComfyUI's VAE object) whose encoder and decoder run on the runtime."""
    first_stage_model = getattr(vae, "first_stage_model", None)
    if first_stage_model is None or not hasattr(vae, "patcher"):
        raise InputError(f"the vae input holds a {type(vae).__name__} without a loaded model: connect Load VAE (or "
                         f"a checkpoint loader's VAE output) to TPU VAE")
    parts = vae_parts(first_stage_model)
    if not parts:
        raise InputError(f"TPU VAE does not know how to run {type(first_stage_model).__name__}: it has neither an "
                         f"encoder and decoder nor decode and encode methods; remove the TPU VAE node to decode "
                         f"on the host")
    on_runtime = copy.copy(vae)
    on_runtime.patcher = vae.patcher.clone()
    for key, module, method in parts:
        forward = _part_forward(vae, key, module, method, settings)
        on_runtime.patcher.add_object_patch(key, forward)
    on_runtime.memory_used_decode = host_memory_decode(vae)
    on_runtime.memory_used_encode = host_memory_encode(vae)
    return on_runtime


def bridged_parts(vae) -> dict[str, BridgedModule]:
    """The bridged modules behind a TPU VAE's output, by object patch key ("decoder.forward", ...)."""
    return {k: v.bridged for k, v in vae.patcher.object_patches.items() if isinstance(v, VAEPartForward)}
