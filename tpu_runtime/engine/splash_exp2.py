"""A Pallas flash-attention forward kernel in base-2 form, with segment-id masking.

The softmax is computed as ``2 ** (s·log2 e - m)`` instead of ``e ** (s - m)``: q is pre-multiplied by log2 e
once, and the kernel's inner loop uses ``exp2``, which TPUs evaluate natively (seed 003 measured this form in
its best CogVideoX1.5 runs). Padding tokens carry segment id 1 and real tokens 0, so padded keys never receive
weight, which a zero-padded K/V without a mask gets wrong.

Layout follows JAX's splash kernel: q/k/v ``[H, L, D]`` head-dim minor, segment ids widened to the TPU lane and
sublane tiles. Forward only (inference). Off TPU it runs with ``interpret=True``.
"""

from __future__ import annotations

import functools
import math

LANES = 128
SUBLANES = 8
_NEG = -0.7 * 3.4028235e38


@functools.partial(
    __import__("jax").jit, static_argnames=("block_q", "block_kv", "block_kv_compute", "interpret")
)
def flash_attention_exp2(q, k, v, q_segment_ids, kv_segment_ids, *, block_q: int, block_kv: int,
                         block_kv_compute: int, interpret: bool = False):
    """softmax(q kᵀ) v per head for q already multiplied by the softmax scale; lengths multiples of the blocks."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    heads, lq, d = q.shape
    lk = k.shape[1]
    if lq % block_q or lk % block_kv or block_kv % block_kv_compute:
        raise ValueError(f"lengths ({lq}, {lk}) must be multiples of the blocks ({block_q}, {block_kv}) and "
                         f"block_kv of block_kv_compute ({block_kv_compute})")
    q = q * jnp.asarray(math.log2(math.e), q.dtype)
    q_ids = jnp.broadcast_to(q_segment_ids.astype(jnp.int32)[:, None], (lq, LANES))
    kv_ids = jnp.broadcast_to(kv_segment_ids.astype(jnp.int32)[None, :], (SUBLANES, lk))
    n_kv = lk // block_kv
    n_compute = block_kv // block_kv_compute

    def kernel(q_ref, k_ref, v_ref, qid_ref, kvid_ref, o_ref, m_ref, l_ref, acc_ref):
        j = pl.program_id(2)

        @pl.when(j == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        q_blk = q_ref[...]
        q_id = qid_ref[:, 0:1]  # [bq, 1]

        def body(c, _):
            start = pl.multiple_of(c * block_kv_compute, block_kv_compute)
            k_blk = k_ref[pl.ds(start, block_kv_compute), :]
            v_blk = v_ref[pl.ds(start, block_kv_compute), :]
            kv_id = kvid_ref[0:1, pl.ds(start, block_kv_compute)]  # [1, bkc]
            s = jax.lax.dot_general(q_blk, k_blk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = jnp.where(q_id == kv_id, s, _NEG)
            m_prev = m_ref[:, 0:1]
            m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
            p = jnp.exp2(s - m_new)
            correction = jnp.exp2(m_prev - m_new)
            l_new = l_ref[:, 0:1] * correction + p.sum(axis=-1, keepdims=True)
            acc_ref[...] = acc_ref[...] * correction + jax.lax.dot_general(
                p.astype(v_blk.dtype), v_blk, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
            l_ref[...] = jnp.broadcast_to(l_new, l_ref.shape)
            return None

        jax.lax.fori_loop(0, n_compute, body, None)

        @pl.when(j == n_kv - 1)
        def _finish():
            o_ref[...] = (acc_ref[...] / l_ref[:, 0:1]).astype(o_ref.dtype)

    return pl.pallas_call(
        kernel,
        grid=(heads, lq // block_q, n_kv),
        in_specs=[
            pl.BlockSpec((None, block_q, d), lambda h, i, j: (h, i, 0)),
            pl.BlockSpec((None, block_kv, d), lambda h, i, j: (h, j, 0)),
            pl.BlockSpec((None, block_kv, d), lambda h, i, j: (h, j, 0)),
            pl.BlockSpec((block_q, LANES), lambda h, i, j: (i, 0)),
            pl.BlockSpec((SUBLANES, block_kv), lambda h, i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, block_q, d), lambda h, i, j: (h, i, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[
            pltpu.VMEM((block_q, LANES), jnp.float32),
            pltpu.VMEM((block_q, LANES), jnp.float32),
            pltpu.VMEM((block_q, d), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(q, k, v, q_ids, kv_ids)
