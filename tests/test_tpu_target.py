"""Programs compiled for a TPU mesh from this CPU-only process get the real TPU kernels: the attention path follows
the mesh's platform, not the process's default backend. Compiled ahead of time for a v6e-8 topology with the TPU
compiler that `jax[tpu]` installs (no TPU needed), through the same torchax override the models use."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_runtime.engine.attention import AttentionConfig, attention_scope, target_platform

MOSAIC = "tpu_custom_call"  # how a Pallas kernel lowered for TPU (Mosaic) appears in the compiled program


@pytest.fixture(scope="module")
def v6e_mesh():
    from jax.experimental import topologies

    try:
        devices = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x4").devices
    except Exception as exc:  # noqa: BLE001 - the TPU compiler is part of jax[tpu], a dependency
        pytest.fail(f"no TPU topology to compile for ({exc}): is jax[tpu] (libtpu) installed?")
    return Mesh(np.asarray(devices).reshape(2, 1, 4), ("dp", "sp", "tp"))


def _compile_sdpa(mesh, config, tokens=17_776, heads=8, head_dim=64):
    """torch's scaled_dot_product_attention, traced through torchax and our override, compiled for ``mesh``."""
    import torch.nn.functional as F

    from tpu_runtime.engine.runtime import get_runtime

    get_runtime()  # imports torchax (tolerating ops newer torch removed) and installs the override
    from torchax.interop import call_torch

    def f(q, k, v):
        with attention_scope(config, mesh):
            return call_torch(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, k, v)

    spec = jax.ShapeDtypeStruct((2, heads, tokens, head_dim), jnp.bfloat16,
                                sharding=NamedSharding(mesh, P("dp", "tp", None, None)))
    return jax.jit(f).lower(spec, spec, spec).compile()


def test_the_mesh_decides_the_platform(v6e_mesh):
    assert jax.default_backend() == "cpu" and target_platform(v6e_mesh) == "tpu"
    assert target_platform(None) == "cpu"


@pytest.mark.parametrize("config, tokens", [(AttentionConfig(), 2048), (AttentionConfig(impl="splash"), 17_776),
                                            (AttentionConfig(impl="splash", exp2=True), 17_776)],
                         ids=["auto", "splash", "exp2"])
def test_attention_for_a_tpu_mesh_lowers_the_mosaic_kernel(v6e_mesh, config, tokens):
    """auto means splash on a TPU mesh, and splash/exp2 compile as TPU kernels, not in Pallas interpret mode, at
    a real video length (auto at a short one: which kernel it picks does not depend on the length)."""
    text = _compile_sdpa(v6e_mesh, config, tokens=tokens).as_text()
    assert MOSAIC in text, "the attention fell back to a non-kernel path on a TPU mesh"


def test_reference_path_on_a_tpu_mesh_has_no_kernel(v6e_mesh):
    """The check above can fail: the reference implementation compiles without any Mosaic call."""
    text = _compile_sdpa(v6e_mesh, AttentionConfig(impl="reference"), tokens=1024).as_text()
    assert MOSAIC not in text


@pytest.mark.parametrize("topology,heads,head_dim", [("v5e:2x4", 40, 128), ("v5p:2x2x1", 48, 64)])
def test_splash_blocks_fit_the_scoped_vmem_of_earlier_chips(topology, heads, head_dim):
    """The transformers' splash blocks (3328 x 2816, sized for a v6e core) need more scoped VMEM than a v5e or
    v5p core has (CompileTimeScopedVmemOom, found planning Wan 14B and CogVideoX-5b for v5e-8 and v5p-8); on
    those chips they are halved and the kernel compiles (Wan 14B's and CogVideoX-5b's heads)."""
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = Mesh(np.asarray(devices).reshape(2, 1, -1), ("dp", "sp", "tp"))
    text = _compile_sdpa(mesh, AttentionConfig(impl="splash"), tokens=17_776, heads=heads, head_dim=head_dim).as_text()
    assert MOSAIC in text
    assert re.search(r'"block_q\\*": 1664', text)  # the narrowed blocks are the ones compiled


def test_splash_on_wide_heads_fits_a_tpu_core(v6e_mesh):
    """The Wan VAE's attention (heads 384 wide, 6240 tokens per frame at 480x832) through splash with the
    transformer's block sizes needs more scoped VMEM than a v6e core has (the TPU compiler refuses it:
    CompileTimeScopedVmemOom); blocks narrowed for the width compile."""
    text = _compile_sdpa(v6e_mesh, AttentionConfig(impl="splash"), tokens=6240, heads=4,
                         head_dim=384).as_text()
    assert MOSAIC in text
