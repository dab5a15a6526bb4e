"""comfy-kitchen's custom ops inside compiled programs: a JAX implementation of each op ComfyUI's model code calls.

ComfyUI (0.33 and later) computes RoPE and adaptive norms through comfy-kitchen, a package of fused kernels exposed
as torch custom ops (``torch.ops.comfy_kitchen.apply_rope1``, ``rms_adaln``, ...): Wan, HunyuanVideo, Flux-style
models reach them through ``comfy/ldm/flux/math.py``, LTX-Video and LTX-2 through ``comfy/ldm/lightricks/``. torchax
traces only ATen ops, so each of these ops gets a lowering here, registered with the runtime's torchax environment:
inside a traced program the op runs as the JAX code below (XLA fuses it like any other elementwise code). The
numbers are those of comfy-kitchen's own eager CPU backend (the tests compare the two): the same pairing of RoPE
elements, the same dtype each step computes in.

Ops (the ``torch.ops.comfy_kitchen`` names; a trailing ``_`` is the in-place form, which writes its result into its
tensor arguments as ComfyUI expects):

- ``apply_rope``, ``apply_rope1`` (+ ``_``): interleaved RoPE, pair k = elements (2k, 2k+1), rotated by
  ``freqs_cis[..., k, :, :]`` (a 2x2 matrix per pair);
- ``apply_rope_split_half``, ``apply_rope_split_half1`` (+ ``_``): split-half RoPE, pair k = elements (k, k + D/2);
- ``rms_rope``, ``rms_rope1``, ``rms_rope_split_half``, ``rms_rope_split_half1`` (+ ``_``): a per-head RMS norm with
  a learned scale, then RoPE (``rot_dim``: only the first ``rot_dim`` elements rotate);
- ``adaln``, ``rms_adaln``: ``norm(x) * (1 + scale) + shift`` with a layer norm / an RMS norm without affine terms;
- ``na3d``: 3-D neighbourhood attention (each query attends to the keys in a window around it; LTX-2's VAE).

ComfyUI without comfy-kitchen (0.3.64 and earlier) never calls these ops: ``install`` registers only the ops that the
running process has, so it does nothing there.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

NAMESPACE = "comfy_kitchen"


# --- the math, on jax arrays ----------------------------------------------------------------------------------------
def _trim(x, freqs):
    """comfy-kitchen's rule: frequencies for a longer sequence (axis 2) than ``x`` holds are cut to ``x``'s length."""
    if x.ndim > 2 and freqs.ndim > 2 and x.shape[2] != 1 and freqs.shape[2] > x.shape[2]:
        return freqs[:, :, : x.shape[2]]
    return freqs


def _rotate_pairs(pairs, freqs):
    """``pairs`` [..., D/2, 1, 2] (each pair's two elements) rotated by ``freqs`` [..., D/2, 2, 2]: [..., D/2, 2]."""
    return freqs[..., 0] * pairs[..., 0] + freqs[..., 1] * pairs[..., 1]


def rope_interleaved(x, freqs):
    freqs = _trim(x, freqs)
    pairs = x.astype(freqs.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    return _rotate_pairs(pairs, freqs).reshape(x.shape).astype(x.dtype)


def rope_split_half(x, freqs):
    import jax.numpy as jnp

    pairs = jnp.moveaxis(x.reshape(*x.shape[:-1], 2, -1), -2, -1)[..., None, :].astype(freqs.dtype)
    out = jnp.moveaxis(_rotate_pairs(pairs, freqs), -1, -2)
    return out.reshape(x.shape).astype(x.dtype)


def _rms_norm(x, weight, eps):
    """torch's ``rms_norm`` over the last axis: computed in float32 for half inputs, returned in ``x``'s dtype."""
    import jax
    import jax.numpy as jnp

    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    out = wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + eps)
    if weight is not None:
        out = out * weight.astype(out.dtype)
    return out.astype(x.dtype)


def _layer_norm(x, eps):
    import jax
    import jax.numpy as jnp

    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.mean(wide, axis=-1, keepdims=True)
    centred = wide - mean
    out = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return out.astype(x.dtype)


def _rms_rope1(x, freqs, scale, eps, *, split_half: bool, rot_dim: int = 0):
    import jax.numpy as jnp

    rope = rope_split_half if split_half else rope_interleaved
    normed = _rms_norm(x, scale, eps)
    if rot_dim and rot_dim != x.shape[-1]:
        return jnp.concatenate([rope(normed[..., :rot_dim], freqs), normed[..., rot_dim:]], axis=-1)
    return rope(normed, freqs)


def apply_rope(xq, xk, freqs_cis):
    return rope_interleaved(xq, freqs_cis), rope_interleaved(xk, freqs_cis)


def apply_rope_split_half(xq, xk, freqs_cis):
    return rope_split_half(xq, freqs_cis), rope_split_half(xk, freqs_cis)


def rms_rope1(x, freqs_cis, scale, epsilon=1e-6):
    return _rms_rope1(x, freqs_cis, scale, epsilon, split_half=False)


def rms_rope_split_half1(x, freqs_cis, scale, epsilon=1e-6):
    return _rms_rope1(x, freqs_cis, scale, epsilon, split_half=True)


def rms_rope(q, k, freqs_cis, q_scale, k_scale=None, epsilon=1e-6):
    k_scale = q_scale if k_scale is None else k_scale
    return (_rms_rope1(q, freqs_cis, q_scale, epsilon, split_half=False),
            _rms_rope1(k, freqs_cis, k_scale, epsilon, split_half=False))


def rms_rope_split_half(q, k, freqs_cis, q_scale, k_scale=None, epsilon=1e-6, rot_dim=0):
    k_scale = q_scale if k_scale is None else k_scale
    return (_rms_rope1(q, freqs_cis, q_scale, epsilon, split_half=True, rot_dim=rot_dim),
            _rms_rope1(k, freqs_cis, k_scale, epsilon, split_half=True, rot_dim=rot_dim))


def adaln(x, scale, shift, eps=1e-6):
    return _layer_norm(x, eps) * (1 + scale) + shift


def rms_adaln(x, scale, shift, eps=1e-6):
    return _rms_norm(x, None, eps) * (1 + scale) + shift


def na3d(q, k, v, kernel_size, is_causal=None, scale=None):
    """3-D neighbourhood attention on ``[B, T, H, W, heads, D]`` tensors: each query attends to the
    ``kernel_size`` window of keys around it, the window shifted inward at the borders (NATTEN's rule, which
    comfy-kitchen reproduces), or ending at the query along a causal axis. Written as attention over all keys
    with a mask: exact; its score matrix is (tokens x tokens) per head, so it suits the latent grids of a test, not
    a released VAE's (a windowed form is the way for those)."""
    import jax
    import jax.numpy as jnp

    batch, *grid, heads, dim = q.shape
    causal = list(is_causal) if is_causal else [False] * len(grid)
    allowed = None
    for axis, (size, window, is_c) in enumerate(zip(grid, kernel_size, causal)):
        positions = jnp.arange(size)
        if is_c:
            start = jnp.maximum(positions - window + 1, 0)
            near = (positions[None, :] >= start[:, None]) & (positions[None, :] <= positions[:, None])
        else:
            window = min(window, size)
            start = jnp.clip(positions - window // 2, 0, size - window)
            near = (positions[None, :] >= start[:, None]) & (positions[None, :] < start[:, None] + window)
        shape = [1] * (2 * len(grid))
        shape[axis], shape[len(grid) + axis] = size, size
        near = near.reshape(shape)
        allowed = near if allowed is None else allowed & near
    tokens = 1
    for size in grid:
        tokens *= size
    mask = allowed.reshape(tokens, tokens)
    qf, kf, vf = (t.reshape(batch, tokens, heads, dim) for t in (q, k, v))
    scale = dim ** -0.5 if scale is None else scale
    wide = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("bqhd,bkhd->bhqk", qf.astype(wide), kf.astype(wide)) * scale
    logits = jnp.where(mask[None, None], logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, vf.astype(wide))
    return out.astype(v.dtype).reshape(q.shape)


# --- the registry --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lowering:
    """A kitchen op's JAX implementation; ``mutates``: the positions of the tensor arguments an in-place form writes
    its results into (its outputs in order)."""

    function: Callable
    mutates: tuple[int, ...] = ()


def _in_place(function: Callable, *positions: int) -> Lowering:
    return Lowering(function, positions)


LOWERINGS: dict[str, Lowering] = {
    "apply_rope": Lowering(apply_rope),
    "apply_rope_": _in_place(apply_rope, 0, 1),
    "apply_rope1": Lowering(rope_interleaved),
    "apply_rope1_": _in_place(rope_interleaved, 0),
    "apply_rope_split_half": Lowering(apply_rope_split_half),
    "apply_rope_split_half_": _in_place(apply_rope_split_half, 0, 1),
    "apply_rope_split_half1": Lowering(rope_split_half),
    "apply_rope_split_half1_": _in_place(rope_split_half, 0),
    "rms_rope": Lowering(rms_rope),
    "rms_rope_": _in_place(rms_rope, 0, 1),
    "rms_rope1": Lowering(rms_rope1),
    "rms_rope1_": _in_place(rms_rope1, 0),
    "rms_rope_split_half": Lowering(rms_rope_split_half),
    "rms_rope_split_half_": _in_place(rms_rope_split_half, 0, 1),
    "rms_rope_split_half1": Lowering(rms_rope_split_half1),
    "rms_rope_split_half1_": _in_place(rms_rope_split_half1, 0),
    "adaln": Lowering(adaln),
    "rms_adaln": Lowering(rms_adaln),
    "na3d": Lowering(na3d),
}


def available_ops() -> list[str]:
    """The kitchen ops this process has (none unless comfy-kitchen was imported, as ComfyUI 0.33 does)."""
    if NAMESPACE not in sys.modules:
        return []
    import torch

    prefix = f"{NAMESPACE}::"
    return sorted(name[len(prefix):] for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix))


def _torch_function(env, name: str, lowering: Lowering) -> Callable:
    """The op as torchax calls it (torchax tensors in and out), running ``lowering`` on their jax arrays."""

    def run(*args, **kwargs):
        out = env.j2t_iso(lowering.function(*env.t2j_iso(args), **env.t2j_iso(kwargs)))
        if not lowering.mutates:
            return out
        results = out if isinstance(out, tuple) else (out,)
        for position, value in zip(lowering.mutates, results):
            args[position].copy_(value)
        return None

    run.__name__ = f"{NAMESPACE}_{name}"
    return run


_installed: dict[int, set[str]] = {}


def install(env) -> list[str]:
    """Register the lowering of every kitchen op this process has with torchax environment ``env`` (once per op);
    returns the ops newly registered. An op without a lowering stays unregistered: tracing a model that calls it
    fails with the op's name (``program.explain_trace_failure``)."""
    import torch

    done = _installed.setdefault(id(env), set())
    added = []
    for name in available_ops():
        if name in done or name not in LOWERINGS:
            continue
        packet = getattr(torch.ops.comfy_kitchen, name)
        env.override_op_definition(packet.default, _torch_function(env, name, LOWERINGS[name]))
        done.add(name)
        added.append(name)
    if added:
        log.info("comfy-kitchen ops lowered to JAX: %s", ", ".join(added))
    return added
