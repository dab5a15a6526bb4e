"""The automatic mode: every model ComfyUI's loaders load runs on the runtime, with the graph unchanged.

Started with ``TPU_VIDEO_AUTO=1`` (or a subset of ``model,text,vae,clip_vision,audio_encoder``), or switched in
ComfyUI's settings dialog (``TPUVideo.AutomaticMode``, read from ComfyUI's settings store at each prompt), ComfyUI
runs as if TPU Diffusion Model, TPU Text Encoder, TPU VAE, TPU CLIP Vision and TPU Audio Encoder stood, with their
defaults, right after every loader.
How it hooks in:

- ComfyUI's executor turns what a node's function returned into the node's outputs in one function
  (``execution.get_output_from_returns``, the same in every ComfyUI since node expansion). The hook wraps it: a node
  whose declared inputs take no MODEL, CLIP, VAE, CLIP_VISION or AUDIO_ENCODER (a loader, of any pack: Load
  Diffusion Model, Load Checkpoint, Load CLIP, DualCLIPLoader, Load VAE, Load CLIP Vision, Load Audio Encoder, the
  LTX-2 and audio loaders, a custom pack's) has each such output passed through the function the TPU node of that
  type calls (``diffusion_model_on_runtime``, ``text_encoder_on_runtime``, ``vae_on_runtime``,
  ``clip_vision_on_runtime``, ``audio_encoder_on_runtime``).
  What the loader returned is then cached by ComfyUI as any output is; LoRA loaders, model patches and every
  other node after it work on the bridged copy as they would after the TPU node.
- The mode is part of a loader's cache key (``execution.IsChangedCache``): switching it in the settings re-runs
  the loaders and everything after them, never a cached result of the other mode.
- An explicit TPU node after a loader still works and wins: it bridges its input again with its own settings.
- A model the runtime cannot run stays on the host: a loader output of no known kind is named once in the log and
  passed on unchanged; a model whose code cannot be compiled (``UntraceableModel``, found at its first call) is
  named once in the log and runs with ComfyUI's own code from then on (``HostFallback``); found midway through a
  VAE's chunked decode or encode, the whole decode or encode runs again on the host (``RestartOnHost``). The failed
  trace leaves the model as it was. Any other failure (out of device memory, a bad mesh) stops the prompt as it does
  with the TPU nodes.

Importing this module is cheap (no torch, no JAX, no ComfyUI): the pack's ``__init__`` calls ``start`` at
ComfyUI's start-up.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import weakref
from dataclasses import dataclass

from ..engine import notices
from ..errors import InputError
from .settings_store import runtime as settings_runtime
from .settings_store import settings_file

log = logging.getLogger(__name__)

ENV = "TPU_VIDEO_AUTO"
SETTING = "TPUVideo.AutomaticMode"
AS_STARTED = "as started"
PARTS = ("model", "text", "vae", "clip_vision", "audio_encoder")
# ComfyUI's output types -> the part of the automatic mode that runs them on the runtime.
OUTPUT_PARTS = {"MODEL": "model", "CLIP": "text", "VAE": "vae", "CLIP_VISION": "clip_vision",
                "AUDIO_ENCODER": "audio_encoder"}
_ON = ("1", "on", "true", "yes", "all")
_OFF = ("", "0", "off", "false", "no", "none")
VALID = ("1 (or all: every part), 0 (or off), or a comma-separated subset of " + ", ".join(PARTS)
         + " (e.g. model,text,vae)")


class AutoModeError(InputError):
    """A bad value of TPU_VIDEO_AUTO or of the automatic mode's setting."""


def parse_parts(value: str, source: str = ENV) -> frozenset[str]:
    """The parts a value of ``TPU_VIDEO_AUTO`` (or of the setting) turns on; a bad value names ``source`` and the valid
    values."""
    text = str(value).strip().lower()
    if text in _OFF:
        return frozenset()
    if text in _ON:
        return frozenset(PARTS)
    parts = [p.strip() for p in text.split(",")]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise AutoModeError(f"{source}={value!r} is not a valid value ({', '.join(map(repr, unknown))} unknown): use "
                            f"{VALID}")
    return frozenset(parts)


def describe(parts: frozenset[str]) -> str:
    return ",".join(p for p in PARTS if p in parts) or "off"


# --- which parts are on -------------------------------------------------------------------------------------------
@dataclass
class _State:
    started: frozenset = frozenset()  # from TPU_VIDEO_AUTO at start-up
    settings_stamp: tuple | None = None
    setting: frozenset | None = None  # from ComfyUI's settings store; None: as started


_state = _State()
_state_lock = threading.Lock()


def _setting_value() -> frozenset | None:
    """The setting's parts, or None for "as started" (re-read when the settings file changes)."""
    path = settings_file()
    try:
        stat = os.stat(path) if path else None
    except OSError:
        stat = None
    stamp = (path, stat.st_mtime_ns, stat.st_size) if stat else None
    with _state_lock:
        if stamp == _state.settings_stamp:
            return _state.setting
    value = None
    if stamp is not None:
        try:
            with open(path) as f:
                value = json.load(f).get(SETTING)
        except (OSError, ValueError, AttributeError):
            value = None
    parts = None if value is None or str(value).strip().lower() in ("", AS_STARTED) else parse_parts(
        value, f"the setting {SETTING}")
    with _state_lock:
        _state.settings_stamp, _state.setting = stamp, parts
    return parts


def active_parts() -> frozenset[str]:
    """The parts on now: the settings dialog's choice, or TPU_VIDEO_AUTO's when the setting says "as started"."""
    setting = _setting_value()
    return _state.started if setting is None else setting


# --- what a node is -----------------------------------------------------------------------------------------------
_loader_slots: dict[type, dict[int, str]] = {}


def _declared_inputs(cls) -> set[str]:
    try:
        spec = cls.INPUT_TYPES()
    except Exception:  # noqa: BLE001 - a node whose inputs cannot be listed is not treated as a loader
        return {"?"}
    types = set()
    for section in ("required", "optional"):
        for value in (spec.get(section) or {}).values():
            kind = value[0] if isinstance(value, (tuple, list)) and value else value
            if isinstance(kind, str):
                types.update(t.strip() for t in kind.split(","))
    return types


def loader_slots(cls) -> dict[int, str]:
    """Output index -> part, for a node class that takes no MODEL / CLIP / VAE / CLIP_VISION / AUDIO_ENCODER input and
    returns some;
    empty for any other node."""
    if cls not in _loader_slots:
        slots: dict[int, str] = {}
        try:
            returns = tuple(cls.RETURN_TYPES or ())
        except Exception:  # noqa: BLE001
            returns = ()
        if any(t in OUTPUT_PARTS for t in returns if isinstance(t, str)) and not (
                _declared_inputs(cls) & set(OUTPUT_PARTS)):
            slots = {i: OUTPUT_PARTS[t] for i, t in enumerate(returns) if isinstance(t, str) and t in OUTPUT_PARTS}
        _loader_slots[cls] = slots
    return _loader_slots[cls]


# --- the outputs ------------------------------------------------------------------------------------------------------
class StartAgainOnHost(Exception):
    """A part found untraceable after earlier calls of the same operation left values on the devices (a causal VAE's
    caches after its first chunks): the host cannot take over midway, so the whole operation (the VAE's decode or
    encode, ``RestartOnHost``) starts again on the host."""


class HostFallback:
    """In place of a bridged forward in the automatic mode: a model whose code cannot be compiled is named once in the
    log and runs with ComfyUI's own code on the host from then on (the TPU nodes instead stop with the error). The
    trace that failed left the model as it was (``program.module_state_kept``)."""

    def __init__(self, forward, module, method_name: str):
        self.forward = forward
        self.bridged = forward.bridged
        self._module = weakref.ref(module)
        self._method = getattr(type(module), method_name)

    def __call__(self, *args, **kwargs):
        from .calls import DeviceValue, split_call
        from .program import UntraceableModel

        if id(self.bridged) not in _on_host:
            try:
                return self.forward(*args, **kwargs)
            except UntraceableModel as error:
                _on_host.add(id(self.bridged))
                weakref.finalize(self.bridged, _on_host.discard, id(self.bridged))
                self.forward.release()
                notices.warn(log, f"automatic mode: {self.bridged.label} runs on the host: {error}")
                if any(isinstance(leaf, DeviceValue) for leaf in split_call((args, kwargs)).leaves):
                    raise StartAgainOnHost(str(error)) from error
        return self._method(self._module(), *args, **kwargs)


class RestartOnHost:
    """In place of a VAE's own ``decode`` or ``encode`` in the automatic mode, around the parts it calls chunk by chunk:
    when a part is found untraceable midway (``StartAgainOnHost``), the operation runs again from its start, its
    parts now on the host, as ComfyUI would run it without the pack (its inputs are the host's; 0.3.64's Wan VAEs
    clear the caches they hold at the start of each operation, 0.33's make new ones)."""

    def __init__(self, module, method_name: str):
        self._module = weakref.ref(module)
        self._name = method_name
        self._method = getattr(type(module), method_name)

    def __call__(self, *args, **kwargs):
        module = self._module()
        try:
            return self._method(module, *args, **kwargs)
        except StartAgainOnHost:
            notices.warn(log, f"automatic mode: {type(module).__name__}.{self._name} starts again on the host")
            return self._method(module, *args, **kwargs)


_on_host: set[int] = set()  # ids of the bridged modules found untraceable (each forgotten when it is dropped)
_skipped: set[str] = set()


def _with_fallback(patcher) -> list:
    """Wrap every bridged forward of ``patcher``'s object patches in a ``HostFallback``; returns the bridged modules."""
    import comfy.utils

    from .comfy import BridgedForward

    bridged = []
    for key, value in list(patcher.object_patches.items()):
        if not isinstance(value, BridgedForward):
            continue
        path, _, attr = key.rpartition(".")
        module = comfy.utils.get_attr(patcher.model, path) if path else patcher.model
        patcher.add_object_patch(key, HostFallback(value, module, attr))
        bridged.append(value.bridged)
        outer = _OUTER_METHODS.get(key)  # a VAE's part: its own decode / encode can start again on the host
        if outer and callable(getattr(type(patcher.model), outer, None)) and outer not in patcher.object_patches:
            patcher.add_object_patch(outer, RestartOnHost(patcher.model, outer))
    return bridged


# A VAE part's object patch key -> the VAE's own method that calls it (chunk by chunk for a causal video VAE).
_OUTER_METHODS = {"decoder.forward": "decode", "encoder.forward": "encode"}


def _patcher_of(part: str, value):
    return value if part == "model" else value.patcher


def on_runtime(part: str, value, node: str):
    """``value`` (a loader's output of ``part``) bridged as its TPU node's defaults do, or unchanged (named once in
    the log) when the runtime has no bridge for it."""
    from .audio_encoder import audio_encoder_on_runtime
    from .comfy import BridgeSettings
    from .diffusion import diffusion_model_on_runtime
    from .text import text_encoder_on_runtime
    from .vae import vae_on_runtime
    from .vision import clip_vision_on_runtime

    bridge = {"model": diffusion_model_on_runtime, "text": text_encoder_on_runtime, "vae": vae_on_runtime,
              "clip_vision": clip_vision_on_runtime, "audio_encoder": audio_encoder_on_runtime}[part]
    try:
        bridged_value = bridge(value, BridgeSettings())
    except InputError as error:
        name = f"{node}/{type(value).__name__}"
        if name not in _skipped:
            _skipped.add(name)
            notices.warn(log, f"automatic mode: {node}'s {part} output stays on the host: {error}")
        return value
    modules = _with_fallback(_patcher_of(part, bridged_value))
    _announce(node, part, modules)
    return bridged_value


def _announce(node: str, part: str, modules: list) -> None:
    devices = len(settings_runtime().devices)
    for bridged in modules:
        spec = bridged.mesh_spec or bridged.rules.auto_mesh(bridged.module, devices)
        log.info("automatic mode: %s from %s runs on the TPU runtime (%s, mesh %s)", bridged.label, node, part, spec)


def bridge_outputs(output: list, cls) -> list:
    """A node's outputs (one list of values per output) with its model outputs on the runtime, as the parts on now
    say; any other node's outputs unchanged."""
    slots = loader_slots(cls)
    if not slots or not output:
        return output
    parts = active_parts()
    if not parts:
        return output
    node = getattr(cls, "__name__", str(cls))
    for index, part in slots.items():
        if part in parts and index < len(output) and isinstance(output[index], list):
            output[index] = [v if _blocked(v) else on_runtime(part, v, node) for v in output[index]]
    return output


def _blocked(value) -> bool:
    """Nothing to run: a blocked output, none, or a checkpoint's VAE output that holds no model (a checkpoint without
    VAE weights, SAM 3's: ComfyUI's loader returns a VAE object with none, which nothing can decode with)."""
    empty_vae = hasattr(value, "first_stage_model") and getattr(value, "first_stage_model") is None
    return type(value).__name__ == "ExecutionBlocker" or value is None or empty_vae


# --- ComfyUI's executor -----------------------------------------------------------------------------------------------
_HOOKED = "_tpu_video_automatic_mode"


def install(execution) -> bool:
    """Hook ComfyUI's executor (the module ``execution``): loader outputs pass through ``bridge_outputs``, and the
    mode is part of a loader's cache key. Idempotent; False when this ComfyUI has no such functions."""
    if getattr(execution, _HOOKED, False):
        return True
    outputs = getattr(execution, "get_output_from_returns", None)
    is_changed = getattr(getattr(execution, "IsChangedCache", None), "get", None)
    if outputs is None or is_changed is None:
        return False

    def get_output_from_returns(return_values, obj):
        output, ui, has_subgraph = outputs(return_values, obj)
        if not has_subgraph:
            output = bridge_outputs(output, obj if isinstance(obj, type) else type(obj))
        return output, ui, has_subgraph

    async def get(self, node_id):
        value = await is_changed(self, node_id)
        class_type = self.dynprompt.get_node(node_id)["class_type"]
        cls = getattr(sys.modules.get("nodes"), "NODE_CLASS_MAPPINGS", {}).get(class_type)  # ComfyUI's nodes.py
        if cls is not None and loader_slots(cls):
            parts = active_parts() & set(loader_slots(cls).values())
            if parts:
                return [value, "tpu-video-automatic-mode", describe(frozenset(parts))]
        return value

    execution.get_output_from_returns = get_output_from_returns
    execution.IsChangedCache.get = get
    setattr(execution, _HOOKED, True)
    return True


def start(environ=os.environ) -> frozenset[str]:
    """At ComfyUI's start-up: read ``TPU_VIDEO_AUTO`` (a bad value raises ``AutoModeError``), hook the executor when
    ComfyUI's is loaded, and say once what the mode does."""
    parts = parse_parts(environ.get(ENV, ""))
    _state.started = parts
    execution = sys.modules.get("execution")
    if execution is None or not install(execution):
        if parts:
            log.warning("%s=%s: ComfyUI's executor is not loaded in this process; the automatic mode is off",
                        ENV, environ.get(ENV))
        return parts
    if parts:
        log.info("TPU video automatic mode on (%s=%s): %s that ComfyUI's loaders load run on the TPU runtime",
                 ENV, environ.get(ENV), _names(parts))
    else:
        log.info("TPU video automatic mode off (set %s=1, or %s in the settings, to run every loaded model on the "
                 "TPU runtime)", ENV, SETTING)
    return parts


def _names(parts: frozenset[str]) -> str:
    names = {"model": "diffusion models", "text": "text encoders", "vae": "VAEs", "clip_vision": "CLIP vision models",
             "audio_encoder": "audio encoders"}
    return ", ".join(names[p] for p in PARTS if p in parts)
