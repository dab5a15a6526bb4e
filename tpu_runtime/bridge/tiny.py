"""Tiny random-weight models of ComfyUI's own classes, saved as the single files ComfyUI's loaders detect, for
``bench --comfy-native`` (and the tests): the numbers they give measure the bridge's overheads and compiles, not a
real model's speed. ComfyUI's code must be importable (``architectures.use_comfyui``)."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def random_state(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A state dict of ``module``'s names and shapes with random values of sensible size: matrices ~ 1/sqrt(fan-in),
    norm scales near 1, biases and other vectors small; integer buffers kept."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in module.state_dict().items():
        shape = tuple(t.shape)
        if not t.dtype.is_floating_point:
            out[name] = t.clone()
            continue
        noise = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) >= 2:
            value = noise / math.sqrt(math.prod(shape[1:]))
        elif "norm" in name and name.endswith("weight"):
            value = 1.0 + 0.1 * noise
        else:
            value = 0.05 * noise
        out[name] = value.contiguous()
    return out


def save_diffusion_model(module: torch.nn.Module, path: Path, seed: int, dtype=torch.float32,
                         prefix: str = "model.diffusion_model.") -> Path:
    """``module``'s random weights as ComfyUI's single file (the key prefix its checkpoint files carry)."""
    from safetensors.torch import save_file

    save_file({prefix + k: v.to(dtype) for k, v in random_state(module, seed).items()}, str(path))
    return path


def tiny_wan(kind: str = "t2v", dim: int = 128, layers: int = 2, in_dim: int = 16, **extra) -> torch.nn.Module:
    """ComfyUI's Wan classes at a tiny size (heads = dim / 128, as ComfyUI's detection reads them); ``kind`` is a
    ``WanModel`` model type (t2v, i2v, ...) or "vace"."""
    import comfy.ldm.wan.model as wan
    import comfy.ops

    common = dict(dim=dim, ffn_dim=2 * dim, num_heads=max(1, dim // 128), num_layers=layers, in_dim=in_dim,
                  out_dim=16, text_dim=4096, operations=comfy.ops.disable_weight_init)
    if kind == "vace":
        return wan.VaceWanModel(vace_layers=extra.get("vace_layers", 1), vace_in_dim=96, **common)
    return wan.WanModel(model_type=kind, **common, **extra)
