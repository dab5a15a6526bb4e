"""plan --comfy-model: ComfyUI's own Wan class, planned for a TPU slice through the native bridge. The bridge's
rule tables split a 14B model as our Wan family splits it (per-chip weights within 10% at full size, on two
meshes), and its step compiles for v6e-8 with splash (Mosaic) kernels, Megatron all-reduces and no weight
gathered."""

import pytest
from comfy_native import comfyui_session

from tpu_runtime.errors import InputError
from tpu_runtime.tools.plan_compile import shard_bytes
from tpu_runtime.tools.topology import parse_topology


@pytest.fixture(scope="module")
def comfy():
    with comfyui_session():
        yield


@pytest.mark.parametrize("mesh", ["dp=2,sp=1,tp=4", "dp=1,sp=1,tp=8"])
def test_the_rules_split_a_14b_model_as_the_family_does(comfy, tmp_path, mesh):
    from tpu_runtime.bridge.architectures import architecture, parameter_count
    from tpu_runtime.tools.plan import ModelSource, open_abstract
    from tpu_runtime.tools.plan_native import _native_program

    topo = parse_topology("v6e-8")
    arch = architecture("wan2.1-t2v-14b")
    module = arch.build()
    assert 14.0e9 < parameter_count(module) < 14.5e9  # the released size: 40 layers of width 5120
    program, spec, rules = _native_program(arch, module, topo, mesh, True, 720, 1280, 81, None)
    bridged = shard_bytes(program.example[0])
    family = open_abstract(ModelSource("wan2.1-t2v-14b"), topo.devices(), tmp_path, mesh=mesh)
    family._component("transformer")
    ours = shard_bytes(family._states["transformer"])
    assert rules.name == "Wan" and str(spec) == mesh
    assert abs(bridged - ours) <= 0.10 * ours, (bridged / 2**30, ours / 2**30)
    whole = sum(s.size * s.dtype.itemsize for s in {id(s): s for s in program.example[0].values()}.values())
    tp = int(mesh.split("tp=")[1])
    assert bridged < 1.2 * whole / tp  # split over tp, not replicated


def test_the_bridged_step_and_text_encoder_compile_for_v6e8(comfy):
    from tpu_runtime.tools.plan_native import format_native_report, plan_native

    report = plan_native("wan2.1-t2v-1.3b", None, "v6e-8", height=240, width=416, frames=17, layers=1,
                         mesh="dp=2,sp=1,tp=4", compare=False, stages=("encode", "sample"))
    step = report.step
    assert step.compiled, step.error
    assert step.mosaic_kernels == 2  # splash for self- and cross-attention of the one block
    assert step.all_reduces >= 2 and step.all_gathers == 0  # Megatron: the weights are where they are used
    assert report.fits and report.rules == "Wan placement rules"
    # umT5-XXL (one of its 24 blocks) as TPU Text Encoder runs it: its 64 heads on tp=8, splash, no weight gathered
    encode = report.stages["encode"]
    assert encode["mesh"] == "dp=1,sp=1,tp=8" and "umT5-XXL" in encode["describe"]
    assert encode["report"].compiled, encode["report"].error
    assert encode["report"].mosaic_kernels == 1 and encode["report"].all_reduces >= 2
    assert encode["report"].all_gathers == 0
    assert report.resident_weights_bytes_per_chip == (encode["report"].weights_bytes_per_chip
                                                      + step.weights_bytes_per_chip)
    text = format_native_report(report)
    assert "ComfyUI (bridge)" in text and "FITS" in text and "encode" in text


def test_umt5_xxl_and_the_wan_vae_at_their_released_sizes(comfy):
    """Without compiling: umT5-XXL's weights split over a v6e-8 (its embedding stays on the host, as the node
    leaves it), the Wan VAE whole on each chip, and its decode two programs: the later-frame program takes the
    caches the first-frame program leaves and leaves them the same (a third frame runs it again)."""
    import jax

    from tpu_runtime.bridge.architectures import COMPONENTS
    from tpu_runtime.bridge.planning import decode_programs, text_program
    from tpu_runtime.engine.runtime import tracing

    devices = parse_topology("v6e-8").devices()
    t5 = COMPONENTS["umt5-xxl"].build()
    text = text_program(t5, 512, devices, None, None, "umT5-XXL")
    whole = sum(p.numel() * 2 for n, p in t5.named_parameters() if not n.startswith("shared."))
    assert 4.5e9 < whole / 2 < 4.8e9 and "shared.weight" not in text.weights  # 5.7B less its 1.05B embedding
    assert str(text.mesh) == "dp=1,sp=1,tp=8"
    assert shard_bytes(text.weights) < 1.1 * whole / 8

    vae = COMPONENTS["wan2.1-vae"].build()
    first, later = decode_programs(vae, (1, 16, 1, 90, 160), devices, None, None, "Wan VAE")
    vae_bytes = sum(p.numel() * 2 for p in vae.decoder.parameters())
    assert shard_bytes(first.weights) == vae_bytes  # a few hundred MB: whole on every chip
    assert str(first.mesh) == "dp=1,sp=8,tp=1"
    caches = [x for x in later.inputs[1:]]
    assert len(later.inputs) > len(first.inputs) and len(caches) > 20
    assert all("sp" in str(c.sharding.spec[4]) for c in caches)  # split along the frames' width
    with tracing():
        out, carried = jax.eval_shape(later.fn, later.weights, later.inputs)
    assert out.shape == (1, 3, 4, 720, 1280)  # four frames a latent frame at full size
    assert [(c.shape, c.dtype) for c in carried] == [(c.shape, c.dtype) for c in caches]


def test_bad_plan_input_is_refused_before_compiling(comfy):
    from tpu_runtime.tools.plan_native import plan_native

    with pytest.raises(InputError, match="not a known ComfyUI architecture"):
        plan_native("wan9-t2v", None, "v6e-8")
    with pytest.raises(InputError, match="4N\\+1 frames, e.g. 77 or 81"):
        plan_native("wan2.1-t2v-14b", None, "v6e-8", frames=80)
    with pytest.raises(InputError, match="tp=8 does not divide WanModel's 12 attention heads"):
        plan_native("wan2.1-t2v-1.3b", None, "v6e-8", mesh="dp=1,sp=1,tp=8")
    with pytest.raises(InputError, match="tp=8 does not divide"):  # before the text encoder and VAE compile
        plan_native("wan2.1-t2v-1.3b", None, "v6e-8", mesh="dp=1,sp=1,tp=8", stages=None)
    with pytest.raises(InputError, match="uses 3 devices but 8 are available"):
        plan_native("wan2.1-t2v-14b", None, "v6e-8", mesh="dp=1,sp=1,tp=3")
    with pytest.raises(InputError, match="takes encode, sample, decode"):
        plan_native("wan2.1-t2v-14b", None, "v6e-8", stages=("image",))
    with pytest.raises(InputError, match="text encoder and VAE of hunyuanvideo are not planned yet"):
        plan_native("hunyuanvideo", None, "v6e-8", stages=("encode", "sample"))
    with pytest.raises(InputError, match="--comfy"):
        from tpu_runtime.bridge.architectures import use_comfyui

        use_comfyui("/nonexistent/comfyui")
