"""Audio VAEs on the runtime (TPU VAE): LTX-2's audio VAE, the sound of a native LTX-2 graph.

ComfyUI's LTX-2 audio VAE (``comfy/ldm/lightricks/vae/audio_vae.py``: an ``autoencoder`` of mel spectrograms and a
``vocoder`` that turns them into a waveform) has neither the ``encoder`` nor the ``decoder`` attribute video VAEs
have. Its parts on the runtime:

- **decode**: the whole ``decode`` (latent statistics, the spectrogram decoder, the vocoder): one program per latent
  length, the waveform comes back.
- **encode**: the autoencoder's encoder. The waveform's resampling and mel spectrogram before it stay on the host, as
  ComfyUI computes them (torchaudio's window and STFT, which have no lowering in torchax; a few milliseconds of the
  encode).

Found by feature: a first-stage model with an ``autoencoder`` and a ``vocoder`` module and its own ``decode``.
"""

from __future__ import annotations

import torch


def audio_vae_parts(first_stage_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]] | None:
    """(object patch key, module, method) of each part of an audio VAE to bridge (see the module's docstring), or
    ``None`` for a model that is not one."""
    autoencoder = getattr(first_stage_model, "autoencoder", None)
    vocoder = getattr(first_stage_model, "vocoder", None)
    decode = getattr(type(first_stage_model), "decode", None)
    if not (isinstance(autoencoder, torch.nn.Module) and isinstance(vocoder, torch.nn.Module) and callable(decode)):
        return None
    parts = [("decode", first_stage_model, decode)]
    encoder = getattr(autoencoder, "encoder", None)
    if isinstance(encoder, torch.nn.Module):
        parts.append(("autoencoder.encoder.forward", encoder, type(encoder).forward))
    return parts
