"""What ComfyUI 0.33's model code calls inside our programs besides ATen: comfy-kitchen's custom ops, grouped-query
attention, and in-place updates of slices.

- Each comfy-kitchen op has a JAX lowering (``bridge/kitchen.py``) equal to comfy-kitchen's own eager CPU backend
  within float32 rounding, in-place forms included; every op 0.33's model code calls has one.
- Grouped-query attention (``enable_gqa``, LLaMA / Qwen / Gemma text encoders) equals torch's, with no key or value
  repeated to the query heads, with and without masks, on every attention implementation.
- An in-place op on a slice (``e[..., :h].addcmul_(a, b)``, 0.33's LLaMA RoPE) writes through to the tensor.
"""

import re
from pathlib import Path

import comfy_kitchen  # ComfyUI 0.33's dependency, installed with the tests
import pytest
import torch
from comfy_native import COMFYUI_TREES

TOL = 2e-6  # float32 rounding: the same math in another order


@pytest.fixture(scope="module")
def env():
    from tpu_runtime.bridge import kitchen
    from tpu_runtime.engine.runtime import get_runtime

    runtime = get_runtime()
    kitchen.install(runtime.env)
    return runtime.env


def on_runtime(env, op, *args, **kwargs):
    """``op`` run on jax arrays through the runtime's torchax environment; results back on the host."""
    from tpu_runtime.engine.runtime import Runtime

    with env:
        moved = [env.to_xla(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*moved, **kwargs)
        out = moved if out is None else out
    to_host = lambda t: Runtime.to_cpu(t.jax()) if hasattr(t, "jax") else t  # noqa: E731
    return tuple(to_host(t) for t in out) if isinstance(out, (tuple, list)) else to_host(out)


def eager(op, *args, **kwargs):
    with comfy_kitchen.use_backend("eager"):
        return op(*args, **kwargs)


def close(a, b, tol=TOL):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) <= tol


def rope_freqs(g, *lead, pairs):
    """A rotation matrix per pair, as ComfyUI builds them: [..., pairs, 2, 2] (cos, -sin; sin, cos)."""
    angles = torch.rand(*lead, pairs, generator=g) * 6.28
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)


CK = torch.ops.comfy_kitchen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["apply_rope1", "apply_rope_split_half1"])
def test_rope_single(env, name, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 10, 8, generator=g).to(dtype)  # [B, heads, L, D]
    # interleaved RoPE takes frequencies for a longer sequence (comfy-kitchen trims them), split-half does not
    freqs = rope_freqs(g, 2, 1, 12 if name == "apply_rope1" else 10, pairs=4)
    op = getattr(CK, name)
    want = eager(op, x, freqs)
    got = on_runtime(env, op, x, freqs)
    assert got.dtype == want.dtype == dtype
    assert close(got, want, TOL if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("name", ["apply_rope", "apply_rope_split_half"])
def test_rope_pairs_and_in_place(env, name):
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 9, 2, 16, generator=g), torch.randn(1, 9, 2, 16, generator=g)  # [B, L, heads, D]
    freqs = rope_freqs(g, 1, 9, 1, pairs=8)
    want = eager(getattr(CK, name), q, k, freqs)
    got = on_runtime(env, getattr(CK, name), q, k, freqs)
    assert all(close(a, b) for a, b in zip(got, want))
    # the in-place form writes its results into q and k
    q2, k2 = q.clone(), k.clone()
    eager(getattr(CK, name + "_"), q2, k2, freqs)
    got_in_place = on_runtime(env, getattr(CK, name + "_"), q, k, freqs)
    assert close(got_in_place[0], q2) and close(got_in_place[1], k2)
    assert close(q2, want[0]) and close(k2, want[1])


@pytest.mark.parametrize("name,rot_dim", [("rms_rope", None), ("rms_rope_split_half", 0),
                                          ("rms_rope_split_half", 8)])
def test_rms_rope(env, name, rot_dim):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 2, 6, 16, generator=g)  # k: fewer heads (GQA)
    pairs = (rot_dim or 16) // 2
    freqs = rope_freqs(g, 2, 1, 6, pairs=pairs)
    q_scale, k_scale = torch.rand(16, generator=g) + 0.5, torch.rand(16, generator=g) + 0.5
    args = (q, k, freqs, q_scale, k_scale, 1e-6) + ((rot_dim,) if rot_dim is not None else ())
    want = eager(getattr(CK, name), *args)
    got = on_runtime(env, getattr(CK, name), *args)
    assert all(close(a, b) for a, b in zip(got, want))
    q2, k2 = q.clone(), k.clone()
    eager(getattr(CK, name + "_"), q2, k2, *args[2:])
    got_in_place = on_runtime(env, getattr(CK, name + "_"), q, k, *args[2:])
    assert close(got_in_place[0], q2) and close(got_in_place[1], k2)


@pytest.mark.parametrize("name", ["rms_rope1", "rms_rope_split_half1"])
def test_rms_rope_single(env, name):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 3, 5, 8, generator=g)
    freqs, scale = rope_freqs(g, 1, 1, 5, pairs=4), torch.rand(8, generator=g) + 0.5
    want = eager(getattr(CK, name), x, freqs, scale, 1e-5)
    assert close(on_runtime(env, getattr(CK, name), x, freqs, scale, 1e-5), want)
    x2 = x.clone()
    eager(getattr(CK, name + "_"), x2, freqs, scale, 1e-5)
    assert close(on_runtime(env, getattr(CK, name + "_"), x, freqs, scale, 1e-5)[0], x2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["adaln", "rms_adaln"])
def test_adaptive_norms(env, name, dtype):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 7, 32, generator=g) * 3 + 1).to(dtype)
    scale, shift = (torch.randn(2, 1, 32, generator=g).to(dtype) for _ in range(2))
    want = eager(getattr(CK, name), x, scale, shift, 1e-6)
    got = on_runtime(env, getattr(CK, name), x, scale, shift, 1e-6)
    assert got.dtype == want.dtype
    assert close(got, want, TOL * 2 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("kernel,causal", [([3, 3, 3], [False, False, False]), ([2, 5, 3], [True, False, False]),
                                           ([8, 2, 2], [False, False, False])])
def test_neighbourhood_attention(env, kernel, causal):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 3, 4, 5, 2, 8, generator=g) for _ in range(3))  # [B, T, H, W, heads, D]
    want = eager(CK.na3d, q, k, v, kernel, causal, None)
    assert close(on_runtime(env, CK.na3d, q, k, v, kernel, causal, None), want, 1e-5)


def _kitchen_calls_in(tree: Path) -> set[str]:
    """The comfy-kitchen functions ComfyUI's model code calls (``ck.x(`` / ``comfy_kitchen.x(``)."""
    found = set()
    for folder in ("comfy/ldm", "comfy/text_encoders"):
        for path in (tree / folder).rglob("*.py"):
            found.update(re.findall(r"(?:quant_ops\.ck|comfy_kitchen)\.([a-z_0-9]+)\(", path.read_text(errors="ignore")))
    return found


# Kitchen functions model code calls that never reach a traced program: the attention the runtime replaces, a
# language model's token-by-token decoding (text encoding runs the prompt at once), and availability checks.
NOT_TRACED = {"int8_attention", "int8_attention_from_prequantized", "prequantize_int8_attention",
              "int8_attention_is_available", "flash_attention_decode", "flash_attention_decode_is_available"}


def test_every_op_the_model_code_calls_is_lowered():
    from tpu_runtime.bridge.kitchen import LOWERINGS

    called = set()
    for tree in COMFYUI_TREES.values():
        found = _kitchen_calls_in(tree)
        if "comfy-kitchen" in (tree / "requirements.txt").read_text():  # a ComfyUI built on comfy-kitchen
            assert {"apply_rope", "apply_rope1", "rms_adaln", "apply_rope_split_half1"} <= found  # the scan works
        called |= found - NOT_TRACED
    ops = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("comfy_kitchen::")}
    assert called <= ops, f"not torch ops: {sorted(called - ops)}"
    assert not called - set(LOWERINGS), f"kitchen ops without a lowering: {sorted(called - set(LOWERINGS))}"


def test_in_place_update_of_a_slice_writes_through(env):
    """0.33's LLaMA RoPE: ``q_embed[..., :h].addcmul_(x[..., h:], nsin)`` on a product; torchax alone drops it."""
    g = torch.Generator().manual_seed(7)
    x, cos, sin = (torch.randn(2, 3, 8, generator=g) for _ in range(3))

    def rope(x, cos, sin):
        e = x * cos
        half = e.shape[-1] // 2
        e[..., :half].addcmul_(x[..., half:], -sin[..., :half])
        e[..., half:].addcmul_(x[..., :half], sin[..., half:])
        e[:, 0].lerp_(x[:, 0], 0.25)
        e[..., :1].masked_fill_(x[..., :1] > 1.0, 0.0)
        return e

    assert close(on_runtime(env, rope, x, cos, sin), rope(x, cos, sin))


@pytest.mark.parametrize("impl", ["blockwise", "reference", "splash"])
@pytest.mark.parametrize("mask", [None, "padding", "causal", "full"])
def test_grouped_query_attention(env, impl, mask):
    from tpu_runtime.engine.attention import AttentionConfig, attention_scope

    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 6, 12, 16, generator=g)
    k, v = torch.randn(2, 2, 20, 16, generator=g), torch.randn(2, 2, 20, 16, generator=g)  # 3 queries per key head
    m, causal = None, mask == "causal"
    if mask == "padding":
        m = torch.arange(20).expand(2, 1, 1, 20) < torch.tensor([14, 20]).view(2, 1, 1, 1)
    elif mask == "causal":
        q = torch.randn(2, 6, 20, 16, generator=g)
    elif mask == "full":
        m = torch.randn(2, 1, 12, 20, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, m, is_causal=causal, enable_gqa=True, scale=0.3)

    def run(q, k, v, m):
        with attention_scope(AttentionConfig(impl=impl, block_q=128, block_kv=128, block_kv_compute=128)):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, m, is_causal=causal, enable_gqa=True,
                                                                    scale=0.3)

    assert close(on_runtime(env, run, q, k, v, m), want, 1e-5)


def test_grouped_query_attention_repeats_no_key(env):
    """The program never holds the keys or values repeated to the query heads."""
    import jax

    from tpu_runtime.engine.attention import AttentionConfig, attention_scope

    q, k, v = torch.randn(1, 8, 12, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)

    def run(q, k, v):
        q, k, v = env.j2t_iso((q, k, v))
        with env, attention_scope(AttentionConfig(impl="blockwise")):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return env.t2j_iso(out)

    jaxpr = jax.make_jaxpr(run)(*(jax.numpy.asarray(t.numpy()) for t in (q, k, v)))
    shapes = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            shapes.update(tuple(getattr(o.aval, "shape", ())) for o in eqn.outvars)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jaxpr.jaxpr)
    assert (1, 8, 20, 16) not in shapes and (1, 4, 2, 20, 16) not in shapes
