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
- Causal video VAEs that decode chunk by chunk (ComfyUI's Wan 2.1 and 2.2 VAEs: a list of causal-convolution
  caches carried between the decoder's or encoder's calls) keep their caches on the devices between calls
  (``BridgedModule.mutable_lists``) and settle them after the first call into the form later calls leave them in
  (``CausalFrameCache``), the later calls being those ComfyUI's own loop makes (observed once on ``meta``,
  ``comfy_part_calls``): a bounded number of programs whatever the frame count. ComfyUI 0.3.64 (and the Wan 2.2 VAE)
  decodes a latent frame a call: two programs, a first-chunk one and a later-chunk one. ComfyUI 0.33's Wan 2.1 VAE
  decodes the first frame, then two a call: three (a lone frame without caches, the first, a later chunk) and a
  fourth for the single last frame of an even length; its encoder takes two frames a call and defers a temporal
  downsampling's single frame to the next call: at most eight. VAEs that decode a whole video at once
  (HunyuanVideo's; LTX-Video's, which in ComfyUI 0.33 chunks it inside one call) and image VAEs: one program per
  latent shape.
- ComfyUI 0.33's chunked VAEs (``comfy_has_chunked_io``: LTX-Video's) ask the memory of their tensors' device to
  size their chunks and write into a host buffer they are handed: while traced, ComfyUI's memory queries answer for
  the runtime's devices (``comfy_memory_on_runtime``), ``torch.split`` gives views as torch's does
  (``split_views_on_runtime``), and the frames are copied into the buffer from the program's result. VAEs that tile
  the video in their own code (``handles_tiling``: MiniMax H3, SeedVR2) run each tile's encode or decode on the
  runtime.
- SeedVR2's VAE carries its causal caches between the slices of one encode or decode in a dict keyed by its layers
  (``memory_cache``), which its own slicing loop fills and reads: that loop runs as one program
  (``SLICING_LOOPS``), so the caches never leave the devices.
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

import contextlib
import copy
import inspect
import logging
import math
import threading
import weakref
from typing import Callable

import torch

from ..engine.sharding import frame_split_spec
from ..errors import InputError
from .audio_vae import audio_vae_parts
from .comfy import BridgedForward, BridgeSettings, comfy_attention_on_runtime, held_forward, refuse_dynamic_patcher
from .program import BridgedModule, CacheSettling
from .rules import ArchRules

log = logging.getLogger(__name__)

# A VAE's weights are small next to its activations: whole on every device, the frames split instead.
VAE_RULES = ArchRules(name="VAE")

# The arguments of a causal VAE part that carry its caches between calls (ComfyUI's Wan VAEs).
CACHE_ARGUMENTS = ("feat_cache", "feat_idx")


class CausalFrameCache(CacheSettling):
    """The causal-convolution caches of ComfyUI's Wan VAEs (``comfy/ldm/wan/vae.py``, ``vae2_2.py``), in their steady
    form from the second call on.

    Each cache slot holds the last input frames (``CACHE_T`` = 2) of one causal convolution, on axis 2. After the
    first chunk a slot holds fewer frames than later (one), and an upsampling slot holds the marker ``"Rep"`` (no
    frames yet: its time convolution zero-pads). Both mean zero frames before what is held, which the convolution
    pads anyway: a slot with its missing frames as zeros in front, and a marker as all zeros, give the same numbers
    and the same shapes as later calls. Other values are never settled: an empty slot (``None``: a downsampling
    slot that takes the first chunk's frame itself, a deferred downsampling slot of ComfyUI 0.33's encoder), an
    index.

    ``probe``: the arguments of a later call, as ComfyUI's own code makes them (``later_call``: the second call
    ComfyUI made of this part while it decoded or encoded a short video on ``meta``, see ``comfy_part_calls``),
    with the first call's own lists and frame size: its tensors take the later call's frame count (one latent frame
    a call in ComfyUI 0.3.64's decoder, two in 0.33's; the temporal factor's pixel frames in 0.3.64's encoder, two
    in 0.33's), its arguments only the first call takes are left out (Wan 2.2's ``first_chunk``) and its flags are
    the later call's (0.33's ``final``)."""

    MARKER = "Rep"  # an upsampling slot before it holds frames

    def __init__(self, later_call: Callable[[], dict | None], time_axis: int = 2):
        self._later_call = later_call
        self._later: dict | None | object = _UNKNOWN
        self.time_axis = time_axis

    def later(self) -> dict | None:
        """name -> ``_summary`` of each argument of ComfyUI's later call (None: it could not be observed)."""
        if self._later is _UNKNOWN:
            self._later = self._later_call()
        return self._later

    def probe(self, positional: list, keyword: dict) -> tuple[list, dict]:
        later = self.later()
        if not later or positional:
            raise ValueError("ComfyUI's own later calls of this part are not known")
        arguments = {}
        for name, (kind, value) in later.items():
            if kind == "tensor":
                arguments[name] = self._frames(keyword[name], value)
            elif kind == "list":
                if not isinstance(keyword.get(name), list):
                    raise ValueError(f"the first call passes no list as {name}")
                arguments[name] = keyword[name]
            else:
                arguments[name] = value
        return [], arguments

    def _frames(self, x, recorded: tuple):
        """``x`` with the recorded tensor's frame count (its own frame size: the recording's frames are small)."""
        if not isinstance(x, torch.Tensor) or x.ndim <= self.time_axis or len(recorded) != x.ndim:
            return x
        shape = list(x.shape)
        shape[self.time_axis] = recorded[self.time_axis]
        return torch.empty(shape, dtype=x.dtype, device="meta")

    def settles(self, value, steady) -> bool:
        if not hasattr(steady, "shape") or not hasattr(steady, "dtype"):
            return False
        if isinstance(value, str) and value == self.MARKER:  # no frames held yet
            return True
        if not (hasattr(value, "shape") and hasattr(value, "dtype")) or value.dtype != steady.dtype:
            return False
        have, want, axis = tuple(value.shape), tuple(steady.shape), self.time_axis
        return (len(have) == len(want) > axis and have[:axis] == want[:axis] and have[axis + 1:] == want[axis + 1:]
                and have[axis] < want[axis])

    def settle(self, value, steady):
        shape = tuple(steady.shape)
        if isinstance(value, str):  # the marker
            return torch.zeros(shape, dtype=_torch_dtype(steady.dtype), device="jax")
        missing = list(shape)
        missing[self.time_axis] = shape[self.time_axis] - value.shape[self.time_axis]
        return torch.cat([value.new_zeros(missing), value], dim=self.time_axis)


_UNKNOWN = object()


def _torch_dtype(dtype) -> torch.dtype:
    import numpy as np

    name = np.dtype(dtype).name
    return getattr(torch, name)


def _summary(value) -> tuple:
    """An argument of a recorded call: ("tensor", shape), ("list", the Python values it holds, arrays as None) or
    ("value", value)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape))
    if isinstance(value, list):
        return ("list", tuple(v if isinstance(v, (type(None), bool, int, str)) else None for v in value))
    return ("value", value)


def comfy_part_calls(first_stage_model: torch.nn.Module, part: str, outer: str, sample_shape: tuple) -> list[dict]:
    """The calls ComfyUI's own code makes of ``first_stage_model``'s ``part`` ("decoder", "encoder") while its
    ``outer`` method ("decode", "encode") runs on a video of ``sample_shape``: for each call, its arguments by name
    (``_summary``). Everything runs on ``meta`` (the model's weights swapped for empty ones while it runs): nothing
    is computed, the model is left as it was."""
    from .program import _Holder, module_state_kept

    module = getattr(first_stage_model, part)
    method = type(module).forward
    signature = inspect.signature(method)
    calls: list[dict] = []

    def record(*args, **kwargs):
        bound = signature.bind(module, *args, **kwargs).arguments
        calls.append({name: _summary(value) for i, (name, value) in enumerate(bound.items()) if i})
        return method(module, *args, **kwargs)

    named = list(first_stage_model.named_parameters(remove_duplicate=False))
    named += list(first_stage_model.named_buffers(remove_duplicate=False))
    empty = {f"inner.{n}": torch.empty_like(t, device="meta") for n, t in named}
    sample = torch.empty(sample_shape, dtype=next(iter(empty.values())).dtype, device="meta")
    holder = _Holder(first_stage_model)
    with module_state_kept(holder):  # the model's own state (0.3.64's cache lists on the VAE) as it was
        module.forward = record
        with comfy_attention_on_runtime(first_stage_model), comfy_memory_on_runtime((), "meta"):
            torch.func.functional_call(holder, empty, ((getattr(type(first_stage_model), outer), (sample,), {}),),
                                       strict=False, tie_weights=False)
    return calls


def comfy_later_call(first_stage_model: torch.nn.Module, part: str, sample_shape: tuple) -> dict | None:
    """The arguments of the second call ComfyUI's own code makes of a causal VAE part (``comfy_part_calls``) for a
    video of ``sample_shape`` (long enough for the second call not to be the last), or None if they cannot be
    observed."""
    outer = "decode" if part == "decoder" else "encode"
    try:
        calls = comfy_part_calls(first_stage_model, part, outer, sample_shape)
    except Exception as error:  # noqa: BLE001 - unknown code: the second call then compiles a program of its own
        log.info("%s.%s: ComfyUI's own calls could not be observed (%s: %s)", type(first_stage_model).__name__,
                 part, type(error).__name__, error)
        return None
    return calls[1] if len(calls) > 2 else None


# --- memory while traced ----------------------------------------------------------------------------------------------
def device_memory(devices) -> tuple[int, int]:
    """(total, free) bytes of ``devices`` together; a backend without memory statistics (the CPU) has the host's."""
    stats = [d.memory_stats() or {} for d in devices]
    if stats and all("bytes_limit" in s for s in stats):
        total = sum(int(s["bytes_limit"]) for s in stats)
        return total, total - sum(int(s.get("bytes_in_use", 0)) for s in stats)
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.total), int(memory.available)


@contextlib.contextmanager
def comfy_memory_on_runtime(devices, device: str = "jax"):
    """While a VAE part is traced: ComfyUI's memory queries (``get_total_memory``, ``get_free_memory``) answer for the
    runtime's device (``jax``, and ``meta`` while ComfyUI's calls are observed) with the memory of ``devices``, and
    ComfyUI's ``intermediate_device`` is ``device`` (the runtime's). Asked of a device that is not torch's own,
    ComfyUI would ask CUDA (LTX-Video's VAE sizes its chunks by it in ComfyUI 0.33); a tensor a part makes on the host
    inside a program could not take its traced values (LTX-Video's decoder writes its frames into a buffer it makes
    there when none is passed). Other threads (the server's) get ComfyUI's own answers."""
    import comfy.model_management as mm

    originals = {name: getattr(mm, name) for name in ("get_total_memory", "get_free_memory", "intermediate_device")}
    tracer = threading.get_ident()

    def on_runtime(dev) -> bool:
        return getattr(dev, "type", None) in ("jax", "meta") and threading.get_ident() == tracer

    def intermediate_device():
        return torch.device(device) if threading.get_ident() == tracer else originals["intermediate_device"]()

    def get_total_memory(dev=None, torch_total_too=False):
        if not on_runtime(dev):
            return originals["get_total_memory"](dev, torch_total_too)
        total = device_memory(devices)[0]
        return (total, total) if torch_total_too else total

    def get_free_memory(dev=None, torch_free_too=False):
        if not on_runtime(dev):
            return originals["get_free_memory"](dev, torch_free_too)
        free = device_memory(devices)[1]
        return (free, free) if torch_free_too else free

    replacements = {"get_total_memory": get_total_memory, "get_free_memory": get_free_memory,
                    "intermediate_device": intermediate_device}
    try:
        for name, value in replacements.items():
            setattr(mm, name, value)
        yield
    finally:
        for name, value in originals.items():
            setattr(mm, name, value)


# --- torch.split as views while traced ------------------------------------------------------------------------------
def _split_as_views(env):
    """``torch.split`` for torchax tensors that returns views (as torch does), not copies."""

    def split(tensor, split_size_or_sections=None, dim=0, *, split_size=None):  # torch.split's and the method's
        from torchax.view import NarrowInfo, View

        sections = split_size_or_sections if split_size is None else split_size
        axis = dim % tensor.ndim
        size = tensor.shape[axis]
        if isinstance(sections, int):
            sizes = [min(sections, size - start) for start in range(0, size, sections)] or [0]
        else:
            sizes = [int(n) for n in sections]
        parts, start = [], 0
        for n in sizes:
            parts.append(View(tensor, view_info=NarrowInfo((slice(None),) * axis + (slice(start, start + n),)),
                              env=env))
            start += n
        return tuple(parts)

    return split


@contextlib.contextmanager
def split_views_on_runtime(env):
    """While a VAE part is traced: ``torch.split`` gives views of the tensor, as torch's own does, so that a write
    into a part reaches the tensor. torchax (0.0.13) gives copies, and ComfyUI 0.33's LTX-Video decoder adds its causal
    cache into the parts of a split block of frames (``add_exchange_cache``) once it decodes in more than one chunk:
    with copies those additions would be lost. torchax keeps slices as views (``torchax.view.View``); the parts are
    such slices. Kept here, in one place, until torchax's own split does the same."""
    split = _split_as_views(env)
    keys = (torch.split, torch.Tensor.split)
    saved = {key: env._ops.get(key) for key in keys}
    try:
        for key in keys:
            env.override_op_definition(key, split, is_view_op=True)
        yield
    finally:
        for key, op in saved.items():
            if op is None:
                env._ops.pop(key, None)
            else:
                env._ops[key] = op


@contextlib.contextmanager
def device_on_runtime(module: torch.nn.Module):
    """While traced: a model that records the device it works on (``module.device``, which SeedVR2's VAE moves its
    input to and its output back from) records the runtime's."""
    recorded = vars(module).get("device", None)
    if not isinstance(recorded, torch.device):
        yield
        return
    module.device = torch.device("jax")
    try:
        yield
    finally:
        module.device = recorded


@contextlib.contextmanager
def part_trace_context(module: torch.nn.Module, devices):
    """What a VAE part's code needs while it is traced: the runtime's attention, memory answers and device, and views
    from ``torch.split``."""
    from ..engine.runtime import get_runtime

    with comfy_attention_on_runtime(module), comfy_memory_on_runtime(devices), device_on_runtime(module), \
            split_views_on_runtime(get_runtime().env):
        yield


# --- the parts of a VAE ------------------------------------------------------------------------------------------
# VAEs whose encoder and decoder carry their causal caches in a dict keyed by their own layers (``memory_cache``:
# SeedVR2's), filled and read across the calls one encode or decode makes in the model's own slicing loop: that loop
# (part name -> the model's method) runs as one program, its caches never leaving the devices; one program per video
# (or tile) shape.
SLICING_LOOPS = {"decoder": "slicing_decode", "encoder": "slicing_encode"}
DICT_CACHE_ARGUMENT = "memory_cache"


def _takes(method, name: str) -> bool:
    try:
        return name in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def vae_parts(first_stage_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """(object patch key, module, method) of each part to bridge: the encoder's and decoder's ``forward`` where
    the model has them (their slicing loop where they carry caches in a dict: ``SLICING_LOOPS``), else its own
    ``decode`` / ``encode`` (an audio VAE: ``audio_vae.py``)."""
    audio = audio_vae_parts(first_stage_model)
    if audio is not None:
        return audio
    parts = []
    for name, method in (("decoder", "decode"), ("encoder", "encode")):
        sub = getattr(first_stage_model, name, None)
        loop = getattr(type(first_stage_model), SLICING_LOOPS[name], None)
        if isinstance(sub, torch.nn.Module) and _takes(type(sub).forward, DICT_CACHE_ARGUMENT) and callable(loop):
            parts.append((SLICING_LOOPS[name], first_stage_model, loop))
        elif isinstance(sub, torch.nn.Module):
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
    runs the program.

    Two arguments of ComfyUI 0.33's chunked VAEs (``comfy_has_chunked_io``: LTX-Video's) name the host: ``device``
    (where the part moves each chunk it encodes) is the runtime's device inside the program, and ``output_buffer``
    (a host tensor the part writes its frames into) is filled from the program's result, not sent to the devices."""

    def __call__(self, *args, **kwargs):
        buffer = kwargs.pop("output_buffer", None)
        if buffer is not None and not isinstance(buffer, torch.Tensor):
            kwargs["output_buffer"] = buffer
            buffer = None
        args = tuple(_on_runtime(v) for v in args)
        kwargs = {k: _on_runtime(v) for k, v in kwargs.items()}
        out = super().__call__(*args, **kwargs)
        if buffer is None:
            return out
        buffer.copy_(out)
        return buffer


def _on_runtime(value):
    return torch.device("jax") if isinstance(value, torch.device) else value


def _recording_shape(vae, part: str) -> tuple:
    """A short video for observing ComfyUI's own calls of a causal part (``comfy_later_call``): five latent frames
    to decode, two latent frames' worth of pixels (and the first one) to encode; small frames."""
    factor = _temporal_factor(vae) or 4
    if part == "decoder":
        return (1, vae.latent_channels, 5, 8, 8)
    size = 4 * vae.spacial_compression_encode()
    return (1, vae.output_channels, 2 * factor + 1, size, size)


def _part_forward(vae, key: str, module: torch.nn.Module, method, settings: BridgeSettings) -> VAEPartForward:
    first_stage_model = vae.first_stage_model
    label = f"{type(first_stage_model).__name__}.{key.removesuffix('.forward')}"
    caches = _caches(method)
    part = key.removesuffix(".forward")
    model = weakref.ref(first_stage_model)  # the registry of bridged parts must not keep ComfyUI's VAE alive
    shape = _recording_shape(vae, part) if caches else None

    def later_call():
        owner = model()
        return None if owner is None else comfy_later_call(owner, part, shape)

    def build() -> VAEPartForward:
        bridged = BridgedModule(
            module=module, method=method, rules=VAE_RULES, mesh_spec=settings.mesh, attention=settings.attention,
            options_arg=None, mutable_lists=caches, settle=CausalFrameCache(later_call) if caches else None,
            input_spec=frame_spec, label=label,
            memory_hint="Split the frames over more devices (a larger slice, mesh auto), or decode in tiles "
                        "(VAE Decode (Tiled)): the tiles run on the devices too.",
        )
        bridged.trace_context = lambda: part_trace_context(module, list(bridged.mesh.devices.flat))
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
    refuse_dynamic_patcher(vae.patcher, type(first_stage_model).__name__)
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
