"""The one map between dtype names, torch dtypes and the dtypes arrays have once on the devices."""

from __future__ import annotations

import numpy as np
import torch

# What users choose (--dtype, the loaders' dtype input); "auto" resolves per platform in the family's setup.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


_FLOAT8 = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def jax_dtype(dtype: torch.dtype):
    """The dtype a tensor of torch ``dtype`` has once placed on the devices (64-bit narrowed as JAX does without
    x64, bfloat16 kept)."""
    import jax.numpy as jnp

    narrowed = {torch.float64: torch.float32, torch.int64: torch.int32}.get(dtype, dtype)
    if narrowed == torch.bfloat16:
        return jnp.bfloat16
    if narrowed in _FLOAT8:
        return jnp.dtype(getattr(jnp, _FLOAT8[narrowed]))
    return jnp.dtype(torch.empty((), dtype=narrowed).numpy().dtype)


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU torch tensor as the numpy array JAX stores (bfloat16 kept; 64-bit narrowed as JAX does without x64)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype in _FLOAT8:  # ComfyUI's fp8 weights, kept fp8 on the devices (numpy has no fp8: ml_dtypes does)
        import ml_dtypes

        return t.view(torch.uint8).numpy().view(getattr(ml_dtypes, _FLOAT8[t.dtype]))
    array = t.numpy()
    if array.dtype == np.float64:
        return array.astype(np.float32)
    if array.dtype == np.int64:
        return array.astype(np.int32)
    return array
