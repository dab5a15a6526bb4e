"""Attention without an L×L matrix: splash (Pallas, interpret mode here), its exp2 form and the blockwise path
equal the reference; masked calls stay correct; the whole model runs through --attention splash."""

import numpy as np
import pytest
import torch
from conftest import NEGATIVE, PROMPT
from oracle import diffusers_frames

from tpu_runtime.engine import attention as A
from tpu_runtime.errors import InputError


def _qkv(b=1, h=2, lq=400, lk=400, d=64, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for shape in ((b, h, lq, d), (b, h, lk, d), (b, h, lk, d))]


@pytest.mark.parametrize("exp2", [False, True])
@pytest.mark.parametrize("lengths", [(400, 400), (200, 333)])
def test_splash_interpret_equals_reference(exp2, lengths):
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(x) for x in _qkv(lq=lengths[0], lk=lengths[1]))
    # Blocks that do not divide the lengths: the tails are padded and masked with segment ids.
    config = A.AttentionConfig(impl="splash", block_q=128, block_kv=256, block_kv_compute=128, exp2=exp2)
    out = A.splash_attention(q, k, v, 0.125, config, interpret=True)
    ref = A.reference_attention(q, k, v, 0.125)
    assert out.shape == ref.shape
    assert float(jnp.abs(out - ref).max()) < 1e-5


def test_a_kernel_first_made_inside_one_program_serves_the_next():
    """The splash kernel of a shape is made once and kept: made while one program was traced, it must hold no value
    of that trace (a second program with the same shapes failed with an escaped tracer)."""
    import jax
    import jax.numpy as jnp

    A._splash_kernel.cache_clear()
    q, k, v = (jnp.asarray(x) for x in _qkv(lq=256, lk=256, seed=3))
    config = A.AttentionConfig(impl="splash", block_q=128, block_kv=128, block_kv_compute=128)
    ref = A.reference_attention(q, k, v, 0.125)
    first = jax.jit(lambda q, k, v: A.splash_attention(q, k, v, 0.125, config, interpret=True))(q, k, v)
    second = jax.jit(lambda q, k, v: A.splash_attention(q * 1.0, k, v, 0.125, config, interpret=True) + 0.0)(q, k, v)
    assert A._splash_kernel.cache_info().hits >= 1
    assert float(jnp.abs(first - ref).max()) < 1e-5 and float(jnp.abs(second - ref).max()) < 1e-5


def test_unmasked_zero_padding_would_be_wrong():
    """What the segment ids guard against: zero-padded keys without a mask shift the softmax."""
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(x) for x in _qkv(lq=400, lk=400))
    kp, vp = A._pad_axis(k, 2, 512), A._pad_axis(v, 2, 512)
    wrong = A.reference_attention(q, kp, vp, 0.125)
    assert float(jnp.abs(wrong - A.reference_attention(q, k, v, 0.125)).max()) > 1e-2


@pytest.mark.parametrize("chunks", [(128, 128), (96, 160), (1024, 1024)])
def test_blockwise_equals_reference(chunks):
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(x) for x in _qkv(b=2, lq=300, lk=450))
    out = A.blockwise_attention(q, k, v, 0.125, *chunks)
    assert float(jnp.abs(out - A.reference_attention(q, k, v, 0.125)).max()) < 1e-5


def test_block_sizes_fit_the_sequence():
    config = A.AttentionConfig()
    assert A.splash_block_sizes(config, 17776, 17776) == (3328, 2816, 256, 19968, 19712)
    assert A.splash_block_sizes(config, 17776, 17776, head_dim=64) == (3328, 2816, 256, 19968, 19712)
    bq, bkv, bkvc, lq, lk = A.splash_block_sizes(config, 88, 88)
    assert (bq, bkv, bkvc, lq, lk) == (128, 128, 128, 128, 128)
    # The Wan VAE's 384-wide single head at 480x832 (6240 tokens): blocks a third as long, still lane multiples.
    assert A.splash_block_sizes(config, 6240, 6240, head_dim=384) == (1024, 768, 256, 7168, 6912)
    # v4/v5e/v5p cores have half a v6e core's scoped VMEM: blocks half as long there.
    assert [A.vmem_narrowing(k) for k in ("TPU v6 lite", "TPU v5 lite", "TPU v5", "TPU v4", "cpu")] == [1, 2, 2, 2, 1]
    assert A.splash_block_sizes(config, 75600, 75600, narrowing=2) == (1664, 1280, 256, 76544, 76800)
    with pytest.raises(InputError, match="multiple of block_kv_compute"):
        A.AttentionConfig(block_kv=300, block_kv_compute=256)
    assert A.AttentionConfig().resolve("tpu").impl == "splash"
    assert A.AttentionConfig().resolve("gpu").impl == "cudnn"
    assert A.AttentionConfig().resolve("cpu").impl == "blockwise"


def test_cudnn_path_falls_back_where_cudnn_is_absent():
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(x) for x in _qkv(lq=64, lk=64))
    assert float(jnp.abs(A.cudnn_attention(q, k, v, 0.125) - A.reference_attention(q, k, v, 0.125)).max()) < 1e-5


def test_sdpa_override_in_torchax(runtime):
    """Inside the runtime's torchax environment F.scaled_dot_product_attention takes our paths, masks included."""
    import jax

    env = runtime.env
    q, k, v = (torch.from_numpy(x) for x in _qkv(lq=70, lk=90, d=16))
    mask = torch.randn(1, 2, 70, 90)  # an additive mask (T5-style)
    bool_mask = torch.rand(1, 2, 70, 90) > 0.3
    cases = {
        "plain": dict(),
        "scale": dict(scale=0.3),
        "additive": dict(attn_mask=mask),
        "boolean": dict(attn_mask=bool_mask),
        "causal": dict(is_causal=True),
    }
    for name, kwargs in cases.items():
        ref = torch.nn.functional.scaled_dot_product_attention(q, k if name != "causal" else k[:, :, :70],
                                                               v if name != "causal" else v[:, :, :70], **kwargs)

        def run(q, k, v, m, kwargs=kwargs, name=name):
            q, k, v, m = env.j2t_iso((q, k, v, m))
            with env:
                if name == "causal":
                    k, v = k[:, :, :70], v[:, :, :70]
                extra = {**kwargs, "attn_mask": m} if "attn_mask" in kwargs else kwargs
                return env.t2j_iso(torch.nn.functional.scaled_dot_product_attention(q, k, v, **extra))

        m = kwargs.get("attn_mask", torch.zeros(1))
        out = runtime.to_cpu(jax.jit(run)(*runtime.put((q, k, v, m))))
        assert (out - ref).abs().max().item() < 1e-5, name


def test_full_model_through_splash(tiny_models, tmp_path):
    from tpu_runtime.tools import stage_files
    from tpu_runtime.tools.cli import GenerateRequest, generate

    req = GenerateRequest(model=str(tiny_models["5b"]), output_dir=str(tmp_path), prompt=PROMPT,
                          negative_prompt=NEGATIVE, height=64, width=96, frames=9, steps=2, seed=9, dtype="float32",
                          attention="splash", block_q=128, block_kv=128, block_kv_compute=128)
    config = generate(req)
    assert config["attention"] == "splash"
    ours = stage_files.load_frames(tmp_path).numpy()
    ref = diffusers_frames(tiny_models["5b"], PROMPT, NEGATIVE, 64, 96, 9, 2, 6.0, 9)
    assert np.abs(ours - ref).max() < 1e-4


@pytest.mark.parametrize("impl", ["blockwise", "splash", "reference"])
@pytest.mark.parametrize("boolean", [True, False])
def test_a_padding_mask_keeps_the_efficient_paths_and_equals_torch(impl, boolean):
    """ComfyUI's text masks (HunyuanVideo's joint attention, LTX-Video's cross-attention) leave keys out for every
    query: [B or 1, 1, 1, S], boolean or additive (0 and -max). Through the torchax override they equal torch's
    own scaled_dot_product_attention with the same mask, per batch element."""
    import jax

    from tpu_runtime.engine.runtime import get_runtime

    runtime = get_runtime()
    q, k, v = (torch.from_numpy(x) for x in _qkv(b=2, lq=150, lk=90, d=64, seed=3))
    valid = torch.ones(2, 1, 1, 90, dtype=torch.bool)
    valid[0, ..., 70:] = False
    valid[1, ..., 40:] = False
    mask = valid if boolean else (valid.float() - 1.0) * torch.finfo(torch.float32).max
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    config = A.AttentionConfig(impl=impl, block_q=128, block_kv=128, block_kv_compute=128, chunk_q=64, chunk_kv=32)
    env = runtime.env

    def run(q, k, v, m):
        with A.attention_scope(config), env:
            args = env.j2t_iso((q, k, v, m))
            return env.t2j_iso(torch.nn.functional.scaled_dot_product_attention(*args[:3], attn_mask=args[3]))

    lowered = jax.jit(run).lower(*(runtime.put(t) for t in (q, k, v, mask))).as_text()
    got = jax.jit(run)(*(runtime.put(t) for t in (q, k, v, mask)))
    assert float(np.abs(np.asarray(got) - expected.numpy()).max()) < 1e-5
    full_scores = "2x2x150x90x" in lowered  # a score for every query and key at once
    assert full_scores == (impl == "reference")
