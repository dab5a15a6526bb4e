"""ComfyUI's own audio encoders on the runtime: the ``comfy.audio_encoders`` side of the native bridge (wav2vec2, which
Wan 2.2 S2V and InfiniteTalk read; Whisper, which HuMo reads).

``audio_encoder_on_runtime(audio_encoder, settings)`` returns a copy of ComfyUI's AUDIO_ENCODER object (what Load
Audio Encoder gives) whose model runs as compiled programs, as TPU CLIP Vision does for an image model
(``vision.py``). ComfyUI's ``encode_audio`` stays ComfyUI's: the waveform is resampled to the model's rate on the host
(torchaudio) and only the model's forward runs on the devices. How it hooks in:

- The audio encoder's patcher is cloned and an object patch replaces the model's ``forward``; ComfyUI applies it when
  ``encode_audio`` loads the model and restores the original when another patcher of the same model loads: the
  audio encoder without the node is unchanged.
- One program per waveform length (a clip's length is its own: a new clip of another length compiles another);
  every hidden state the model returns (the S2V and InfiniteTalk conditioning read them all) comes back.
- Weights are placed by the generic rule (large matrices split over ``tp``); the device copy is released by ComfyUI's
  Unload Models and ``/free`` and when ComfyUI drops the model.
- Attention: ComfyUI picks the encoder's attention when it runs; while a program is traced it is the runtime's
  (``comfy_attention_on_runtime``).

Nothing here is imported unless ComfyUI runs (or a test imports ComfyUI).
"""

from __future__ import annotations

import copy

import torch

from ..errors import InputError
from .comfy import BridgedForward, BridgeSettings, comfy_attention_on_runtime, held_forward, refuse_dynamic_patcher
from .program import BridgedModule
from .rules import ArchRules

AUDIO_ENCODER_RULES = ArchRules(name="generic", generic=True, heads_in_submodules=True)


class AudioEncoderForward(BridgedForward):
    """What the object patch puts in place of the audio model's ``forward``."""


def _audio_forward(model: torch.nn.Module, settings: BridgeSettings) -> AudioEncoderForward:
    def build() -> AudioEncoderForward:
        bridged = BridgedModule(
            module=model, method=type(model).forward, rules=AUDIO_ENCODER_RULES, mesh_spec=settings.mesh,
            attention=settings.attention, options_arg=None, trace_context=lambda: comfy_attention_on_runtime(model),
            label=type(model).__name__, memory_hint="Split the audio encoder over more devices (a larger slice), or "
                                                    "encode a shorter clip.",
        )
        return AudioEncoderForward(bridged, model, prefix="")

    return held_forward(model, "audio_encoder", settings, build)


def audio_encoder_on_runtime(audio_encoder, settings: BridgeSettings):
    """A copy of ``audio_encoder`` (ComfyUI's AUDIO_ENCODER object) whose model runs on the runtime."""
    model = getattr(audio_encoder, "model", None)
    patcher = getattr(audio_encoder, "patcher", None)
    if not isinstance(model, torch.nn.Module) or patcher is None or not callable(
            getattr(audio_encoder, "encode_audio", None)):
        raise InputError(f"the audio_encoder input holds a {type(audio_encoder).__name__}, not a loaded audio "
                         f"encoder: connect Load Audio Encoder to TPU Audio Encoder")
    refuse_dynamic_patcher(patcher, type(model).__name__)
    on_runtime = copy.copy(audio_encoder)
    on_runtime.patcher = patcher.clone()
    on_runtime.patcher.add_object_patch("forward", _audio_forward(model, settings))
    return on_runtime


def bridged_audio_models(audio_encoder) -> dict[str, BridgedModule]:
    """The bridged module behind a TPU Audio Encoder's output, by object patch key ("forward")."""
    return {k: v.bridged for k, v in audio_encoder.patcher.object_patches.items()
            if isinstance(v, AudioEncoderForward)}
