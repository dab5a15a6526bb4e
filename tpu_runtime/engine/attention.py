"""Attention for the torchax environment: ``scaled_dot_product_attention`` without an L×L score matrix.

torchax's own lowering of ``F.scaled_dot_product_attention`` materialises every score (2.5 GB at CogVideoX's
17,776 tokens with 2 heads of 64 in float32). The runtime overrides it with ``sdpa_override``, which dispatches
on the active ``AttentionConfig``:

- ``splash``: JAX's Pallas splash-attention kernel (TPU; off TPU it runs in Pallas interpret mode, slow, for
  checking). q is scaled by the caller (the kernel does not), lengths are padded to the block sizes and the
  padding masked with segment ids; heads are split over the mesh's ``tp`` axis inside ``shard_map``.
  ``exp2=True`` uses this project's kernel in the base-2 form (``exp2`` with q pre-scaled by log2 e).
- ``cudnn``: ``jax.nn.dot_product_attention`` with the cuDNN implementation (GPU).
- ``blockwise``: online-softmax attention over q and kv chunks (any backend; memory O(chunk_q × chunk_kv)).
- ``reference``: plain softmax(q kᵀ) v, for checking.

Calls with a mask take a path that honours it: a padding mask (the same for every query and head, e.g. ComfyUI's
text masks for HunyuanVideo and LTX-Video) keeps the memory-efficient paths (splash with segment ids for a boolean
mask, blockwise with the scores' bias for an additive one); any other mask (T5-style relative biases, causal)
takes the plain masked path.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from ..errors import InputError

IMPLS = ("auto", "splash", "cudnn", "blockwise", "reference")
_NEG = -0.7 * float(np.finfo(np.float32).max)  # finite "minus infinity": keeps exp() and max() NaN-free


@dataclass(frozen=True)
class AttentionConfig:
    """How attention runs; part of every compiled program's key."""

    impl: str = "auto"
    block_q: int = 3328  # splash block sizes: the seed's defaults for long video sequences
    block_kv: int = 2816
    block_kv_compute: int = 256
    exp2: bool = False
    chunk_q: int = 1024  # blockwise chunk sizes
    chunk_kv: int = 1024

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise InputError(f"attention must be one of {IMPLS}, got {self.impl!r}")
        for name in ("block_q", "block_kv", "block_kv_compute", "chunk_q", "chunk_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InputError(f"attention {name}={value!r} must be a positive integer")
        if self.block_kv % self.block_kv_compute:
            raise InputError(
                f"attention block_kv={self.block_kv} must be a multiple of block_kv_compute={self.block_kv_compute}"
            )

    def resolve(self, backend: str) -> "AttentionConfig":
        """``auto`` made concrete for a JAX backend: splash on TPU, cuDNN on GPU, blockwise elsewhere."""
        if self.impl != "auto":
            return self
        return replace(self, impl={"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}.get(backend, "blockwise"))


_active: contextvars.ContextVar[tuple[AttentionConfig, object] | None] = contextvars.ContextVar(
    "tpu_video_attention", default=None
)


@contextlib.contextmanager
def attention_scope(config: AttentionConfig, mesh=None):
    """Trace code inside this block with ``config`` (and, for splash, heads split over ``mesh``'s tp axis)."""
    token = _active.set((config, mesh))
    try:
        yield
    finally:
        _active.reset(token)


def target_platform(mesh=None) -> str:
    """The platform a program is compiled for: that of the mesh's devices when there is a mesh (a mesh over a TPU
    topology's devices compiles for TPU even in a CPU-only process), else the process's default backend."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    import jax

    return jax.default_backend()


def target_device_kind(mesh=None) -> str:
    """The kind of chip a program is compiled for (``TPU v6 lite``...): the mesh's devices', else the default."""
    if mesh is not None:
        return mesh.devices.flat[0].device_kind
    import jax

    return jax.devices()[0].device_kind


def active_config() -> tuple[AttentionConfig, object, str]:
    """The active configuration resolved for its mesh's platform, the mesh, and that platform."""
    config, mesh = _active.get() or (AttentionConfig(), None)
    platform = target_platform(mesh)
    return config.resolve(platform), mesh, platform


# --- implementations over jax arrays [B, H, L, D] --------------------------------------------------------------
def reference_attention(q, k, v, scale: float, mask=None):
    import jax
    import jax.numpy as jnp

    scores = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        scores = jnp.where(mask, scores, _NEG) if mask.dtype == jnp.bool_ else scores + mask.astype(scores.dtype)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("...qk,...kd->...qd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def _pad_axis(x, axis: int, size: int):
    import jax.numpy as jnp

    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def blockwise_attention(q, k, v, scale: float, chunk_q: int = 1024, chunk_kv: int = 1024, key_bias=None):
    """Exact attention with an online softmax over kv chunks, one q chunk at a time; never builds L×S.
    ``key_bias`` ([B, S], optional) is added to every query's score of each key (a padding mask's 0 / -max)."""
    import jax
    import jax.numpy as jnp

    b, h, lq, d = q.shape
    lk = k.shape[2]
    cq, ck = min(chunk_q, lq), min(chunk_kv, lk)
    nq, nk = -(-lq // cq), -(-lk // ck)
    qp = _pad_axis(q, 2, nq * cq).reshape(b, h, nq, cq, d)
    kp = _pad_axis(k, 2, nk * ck).reshape(b, h, nk, ck, d)
    vp = _pad_axis(v, 2, nk * ck).reshape(b, h, nk, ck, d)
    valid = jnp.arange(nk * ck) < lk
    if key_bias is None:
        bias = jnp.where(valid, 0.0, _NEG)[None, :]
    else:
        bias = jnp.where(valid[None, :], jnp.maximum(_pad_axis(key_bias.astype(jnp.float32), 1, nk * ck), _NEG), _NEG)
    kv_bias = jnp.moveaxis(bias.reshape(bias.shape[0], nk, ck), 1, 0)  # [nk, B or 1, ck]

    def one_q_chunk(qc):  # [B, H, cq, D]
        qc = qc.astype(jnp.float32) * scale

        def step(carry, inputs):
            m, l, acc = carry
            kc, vc, chunk_bias = inputs
            s = jnp.einsum("bhqd,bhkd->bhqk", qc, kc.astype(jnp.float32))
            s = jnp.maximum(s + chunk_bias[:, None, None, :], _NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(-1)
            acc = acc * correction[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p, vc.astype(jnp.float32))
            return (m_new, l, acc), None

        init = (jnp.full((b, h, cq), _NEG, jnp.float32), jnp.zeros((b, h, cq), jnp.float32),
                jnp.zeros((b, h, cq, d), jnp.float32))
        kvs = (jnp.moveaxis(kp, 2, 0), jnp.moveaxis(vp, 2, 0), kv_bias)
        (_, l, acc), _ = jax.lax.scan(step, init, kvs)
        return (acc / l[..., None]).astype(q.dtype)

    out = jax.lax.map(one_q_chunk, jnp.moveaxis(qp, 2, 0))  # [nq, B, H, cq, D]
    return jnp.moveaxis(out, 0, 2).reshape(b, h, nq * cq, d)[:, :, :lq]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


SPLASH_BLOCK_HEAD_DIM = 128  # the head width the configured block sizes are for (the transformers': 64, 128)
# The configured block sizes fit a v6e core's scoped VMEM. Earlier generations' cores allow less: the
# transformers' blocks (3328 x 2816) are refused there (found compiling Wan 14B and CogVideoX-5b for v5e-8 and
# v5p-8: CompileTimeScopedVmemOom); halved, they compile.
_NARROW_VMEM_CHIPS = ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v5e", "TPU v5p")


def vmem_narrowing(device_kind: str | None) -> int:
    """How many times shorter splash blocks are made on a chip of ``device_kind`` (``TPU v5 lite``...) than the
    configured ones: 2 on v4/v5e/v5p, 1 on v6e and anything else (other backends run no Mosaic kernel)."""
    return 2 if device_kind in _NARROW_VMEM_CHIPS else 1


def splash_block_sizes(config: AttentionConfig, lq: int, lk: int, head_dim: int = SPLASH_BLOCK_HEAD_DIM,
                       narrowing: int = 1) -> tuple[int, int, int, int, int]:
    """Block sizes fitted to the sequence (never larger than it needs), and the padded lengths.

    Blocks are multiples of 128 (the kernel's lane width); a long sequence uses the configured sizes. Heads wider
    than 128 get q and kv blocks narrower in proportion: a block's VMEM grows with its width, and the Wan VAE's
    384-wide attention with the transformer's blocks needs more scoped VMEM than a TPU core has (the compiler
    refuses it: CompileTimeScopedVmemOom). ``narrowing`` (``vmem_narrowing``) divides them again for chips
    whose cores allow less scoped VMEM than a v6e core.
    """
    wide = max(1, -(-head_dim // SPLASH_BLOCK_HEAD_DIM)) * narrowing
    block_q = max(128, config.block_q // wide // 128 * 128)
    block_kv = max(config.block_kv_compute, config.block_kv // wide // config.block_kv_compute
                   * config.block_kv_compute)
    bq = min(block_q, _round_up(lq, 128))
    bkv_c = min(config.block_kv_compute, _round_up(lk, 128))
    bkv_c = max(128, bkv_c // 128 * 128)
    bkv = min(block_kv, _round_up(lk, bkv_c))
    bkv = max(bkv_c, bkv // bkv_c * bkv_c)
    return bq, bkv, bkv_c, _round_up(lq, bq), _round_up(lk, bkv)


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, lq_pad: int, lk_pad: int, bq: int, bkv: int, bkv_c: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    import jax

    mask = sm.MultiHeadMask([sm.FullMask((lq_pad, lk_pad)) for _ in range(heads)])
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv_c)
    # The kernel's mask tables are arrays it keeps: made while a program is traced they would be that trace's values,
    # and this cache would hand them to the next program with the same shapes (an escaped tracer). Made here as
    # constants, the kernel is valid in every program.
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(q, k, v, scale: float, config: AttentionConfig, interpret: bool, narrowing: int = 1,
                     key_valid=None):
    """Splash attention on [B, H, L, D]: pads to the block sizes, masks the padding with segment ids (and the keys
    ``key_valid`` ([B or 1, S] booleans) leaves out: a padding mask)."""
    import jax
    import jax.numpy as jnp

    b, h, lq, d = q.shape
    lk = k.shape[2]
    bq, bkv, bkv_c, lq_pad, lk_pad = splash_block_sizes(config, lq, lk, d, narrowing)
    q_seg = (jnp.arange(lq_pad) >= lq).astype(jnp.int32)  # 0 = real token, 1 = padding
    kv_seg = (jnp.arange(lk_pad) >= lk).astype(jnp.int32)
    kv_axis = None
    if key_valid is not None:  # per batch element: a key left out is in another segment than every query
        valid = _pad_axis(key_valid.astype(jnp.int32), 1, lk_pad)
        kv_seg = jnp.broadcast_to(1 - valid, (b, lk_pad)).astype(jnp.int32)
        kv_axis = 0
    qp = _pad_axis(q * jnp.asarray(scale, q.dtype), 2, lq_pad)
    kp, vp = _pad_axis(k, 2, lk_pad), _pad_axis(v, 2, lk_pad)
    if config.exp2:
        from .splash_exp2 import flash_attention_exp2

        kernel = functools.partial(flash_attention_exp2, block_q=bq, block_kv=bkv, block_kv_compute=bkv_c,
                                   interpret=interpret)
    else:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

        splash = _splash_kernel(h, lq_pad, lk_pad, bq, bkv, bkv_c, interpret)

        def kernel(q1, k1, v1, q_seg, kv_seg):
            return splash(q1, k1, v1, segment_ids=sk.SegmentIds(q_seg, kv_seg))

    out = jax.vmap(kernel, in_axes=(0, 0, 0, None, kv_axis))(qp, kp, vp, q_seg, kv_seg)
    return out[:, :, :lq]


def cudnn_attention(q, k, v, scale: float):
    import jax
    import jax.numpy as jnp

    t = lambda x: jnp.swapaxes(x, 1, 2)  # jax.nn.dot_product_attention takes [B, L, H, D]
    try:
        out = jax.nn.dot_product_attention(t(q), t(k), t(v), scale=scale, implementation="cudnn")
    except Exception:  # noqa: BLE001 - shapes/dtypes cuDNN does not take: XLA's fused path, same result
        out = jax.nn.dot_product_attention(t(q), t(k), t(v), scale=scale, implementation="xla")
    return t(out)


def local_attention(q, k, v, scale: float, config: AttentionConfig, backend: str, narrowing: int = 1,
                    key_bias=None, key_valid=None):
    """Attention on [B, H, L, D] jax arrays of one device, with the implementation ``config`` names
    (``narrowing``: see ``vmem_narrowing``). A padding mask comes as ``key_valid`` (booleans) or ``key_bias``
    (added to the scores), [B or 1, S]: splash takes the first as segment ids; an additive bias, which splash
    cannot add, runs blockwise (exact, memory-efficient) on every backend."""
    impl = config.resolve(backend).impl
    if key_valid is not None and impl != "splash":
        import jax.numpy as jnp

        key_bias, key_valid = jnp.where(key_valid, 0.0, _NEG), None
    if impl == "reference":
        return reference_attention(q, k, v, scale, None if key_bias is None else key_bias[:, None, None, :])
    if impl == "blockwise" or key_bias is not None:
        return blockwise_attention(q, k, v, scale, config.chunk_q, config.chunk_kv, key_bias=key_bias)
    if impl == "cudnn":
        return cudnn_attention(q, k, v, scale)
    return splash_attention(q, k, v, scale, config, interpret=backend != "tpu", narrowing=narrowing,
                            key_valid=key_valid)


def attention(q, k, v, scale: float, config: AttentionConfig, backend: str, mesh=None, key_bias=None,
              key_valid=None):
    """Attention on [B, H, L, D]; on a mesh of several devices each device computes its part inside
    ``shard_map``: batch on dp, heads on tp, query positions on sp (k/v whole on every sp shard). A padding mask
    (``key_bias`` or ``key_valid``, [B or 1, S]) follows the batch.

    A query length that sp does not divide is padded to a multiple of sp; the padded query rows are dropped.
    """
    fn = functools.partial(local_attention, scale=scale, config=config, backend=backend,
                           narrowing=vmem_narrowing(target_device_kind(mesh)) if backend == "tpu" else 1)
    masks = {k: m for k, m in (("key_bias", key_bias), ("key_valid", key_valid)) if m is not None}
    if mesh is None or mesh.size == 1:
        return fn(q, k, v, **masks)
    from jax.sharding import PartitionSpec as P

    try:
        from jax import shard_map
    except ImportError:  # older JAX
        from jax.experimental.shard_map import shard_map

    b, h, lq, _ = q.shape
    dp = "dp" if b % mesh.shape["dp"] == 0 and mesh.shape["dp"] > 1 else None
    tp = "tp" if h % mesh.shape["tp"] == 0 and mesh.shape["tp"] > 1 else None
    sp_size = mesh.shape["sp"]
    sp = "sp" if sp_size > 1 else None
    q = _pad_axis(q, 2, _round_up(lq, sp_size))
    q_spec, kv_spec = P(dp, tp, sp, None), P(dp, tp, None, None)
    names = list(masks)
    mask_specs = tuple(P(dp if m.shape[0] == b else None, None) for m in masks.values())

    def local(q, k, v, *mask_values):
        return fn(q, k, v, **dict(zip(names, mask_values)))

    out = shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, *mask_specs), out_specs=q_spec,
                    check_vma=False)(q, k, v, *masks.values())
    return out[:, :, :lq]


def _padding_mask(mask_shape: tuple, query_shape: tuple) -> bool:
    """Whether a mask of ``mask_shape`` only leaves keys out (the same for every query and head): [B or 1, 1, 1, S]."""
    if len(mask_shape) != 4 or len(query_shape) != 4:
        return False
    return mask_shape[1] == 1 and mask_shape[2] == 1 and mask_shape[0] in (1, query_shape[0])


# --- the torchax override ----------------------------------------------------------------------------------------
def _fold_groups(q, kv_heads: int):
    """Grouped-query attention as plain attention: [B, H, L, D] queries whose H = kv_heads x G heads share each key
    head in order (torch's ``enable_gqa``: query head i reads key head i // G) become [B, kv_heads, G x L, D], the G
    queries of a key head one after another along the sequence. No key or value is repeated."""
    b, h, length, d = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * length, d)


def _unfold_groups(out, heads: int, length: int):
    b, _, _, d = out.shape
    return out.reshape(b, heads, length, d)


def sdpa_override(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Stands in for ``torch.nn.functional.scaled_dot_product_attention`` inside the torchax environment. A padding
    mask (the same for every query: ComfyUI's text masks) keeps the memory-efficient paths; other masks take the
    plain masked path. Grouped-query attention (``enable_gqa``, fewer key/value heads than query heads) runs without
    repeating keys and values (each key head's queries folded along the sequence), except where the mesh splits
    heads over more devices than there are key heads."""
    import jax.numpy as jnp
    import torch
    from torchax.interop import call_jax

    if dropout_p:
        raise NotImplementedError("attention dropout is not supported (inference only)")
    head_dim = query.shape[-1]
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
    config, mesh, platform = active_config()
    heads, kv_heads = query.shape[-3] if query.ndim >= 3 else 1, key.shape[-3] if key.ndim >= 3 else 1
    grouped = bool(enable_gqa) and query.ndim == 4 and kv_heads != heads
    if grouped and heads % kv_heads:
        raise ValueError(f"grouped-query attention needs the query heads ({heads}) to be a multiple of the key "
                         f"heads ({kv_heads})")
    tp = mesh.shape["tp"] if mesh is not None else 1
    if grouped and tp > 1 and kv_heads % tp:  # tp splits the query heads: each takes its own copy of its keys
        key, value = (t.repeat_interleave(heads // kv_heads, dim=-3) for t in (key, value))
        grouped, kv_heads = False, heads
    length = query.shape[-2]

    def fold(q):
        return _fold_groups(q, kv_heads) if grouped else q

    def unfold(out):
        return _unfold_groups(out, heads, length) if grouped else out

    if attn_mask is not None and not is_causal and _padding_mask(tuple(attn_mask.shape), tuple(query.shape)):
        boolean = attn_mask.dtype == torch.bool

        def padded(q, k, v, mask):
            flat = mask.reshape(mask.shape[0], mask.shape[-1])
            masks = {"key_valid": flat} if boolean else {"key_bias": flat.astype(jnp.float32)}
            return unfold(attention(fold(q), k, v, scale=scale, config=config, backend=platform, mesh=mesh, **masks))

        return call_jax(padded, query, key, value, attn_mask)
    if attn_mask is not None or is_causal or query.ndim != 4:
        def masked(q, k, v, mask):
            if is_causal:
                causal = jnp.tril(jnp.ones((q.shape[-2], k.shape[-2]), jnp.bool_))
                mask = causal if mask is None else (mask & causal if mask.dtype == jnp.bool_ else mask + jnp.where(causal, 0.0, _NEG))
            if not grouped:
                return reference_attention(q, k, v, scale, mask)
            b, _, lq, d = q.shape  # [B, KV, G, L, D] against [B, KV, 1, S, D]: each key head's group at once
            q5 = q.reshape(b, kv_heads, heads // kv_heads, lq, d)
            mask5 = mask
            if mask is not None and mask.ndim >= 3:  # per query head: [.., KV, G, L, S]; shared: [.., 1, 1, L, S]
                mask5 = (mask.reshape(*mask.shape[:-3], kv_heads, heads // kv_heads, *mask.shape[-2:])
                         if mask.shape[-3] == heads else jnp.expand_dims(mask, -3))
            out = reference_attention(q5, k[:, :, None], v[:, :, None], scale, mask5)
            return out.reshape(q.shape)

        return call_jax(masked, query, key, value, attn_mask)

    def plain(q, k, v):
        return unfold(attention(fold(q), k, v, scale=scale, config=config, backend=platform, mesh=mesh))

    return call_jax(plain, query, key, value)
