"""TPU VAE: ComfyUI's own VAEs, made by ComfyUI's own loader, decode and encode through ComfyUI's own nodes on the
runtime and equal ComfyUI's native CPU run on the same weights (float32, 1e-4 relative). Programs are counted per
bridged part (``stats.programs``) and XLA compiles per process.

A causal Wan VAE decodes one latent frame per decoder call with its caches on the devices: two programs (the first
chunk, every later one) whatever the frame count, for decode and for encode. VAEs that decode a video at once
(HunyuanVideo's, LTX-Video's) and image VAEs: one program per shape."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from comfy_native import comfyui_session, versions_param, load_pack, relative
from conftest import subprocess_env

TOL = 1e-4
WORKER = str(Path(__file__).with_name("bridge_vae_text_worker.py"))


@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param), torch.inference_mode():  # ComfyUI runs its nodes in inference mode
        yield load_pack()


@pytest.fixture(scope="module")
def vaes(pack):
    from tpu_runtime.bridge.tiny import tiny_vae

    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = tiny_vae(kind, seed=len(built) + 1)
        return built[kind]

    return get


def tpu_vae(pack, vae, **inputs):
    """The TPU VAE node applied to ``vae``."""
    return pack.NODE_CLASS_MAPPINGS["TPUVAE"]().apply(vae, **inputs)[0]


def parts(vae) -> dict:
    from tpu_runtime.bridge.vae import bridged_parts

    return bridged_parts(vae)


def xla_compiles() -> int:
    from tpu_runtime.engine.runtime import compile_stats

    return compile_stats().xla_compiles


def latents(vae, frames: int, size: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, vae.latent_channels, frames, size, size, generator=g)


def decode(vae, samples):
    import nodes

    return nodes.VAEDecode().decode(vae, {"samples": samples})[0]


def encode(vae, pixels):
    import nodes

    return nodes.VAEEncode().encode(vae, pixels)[0]["samples"]


@pytest.mark.parametrize("kind", ["wan2.1", "wan2.2"])
def test_wan_decode_of_any_length_is_two_programs(pack, vaes, kind):
    vae = vaes(kind)
    on_tpu = tpu_vae(pack, vae)
    decoder = parts(on_tpu)["decoder.forward"]
    lengths = (3, 1, 5)
    for i, frames in enumerate(lengths):
        z = latents(vae, frames, seed=frames)
        native = decode(vae, z)
        before = xla_compiles()
        out = decode(on_tpu, z)
        assert out.shape == native.shape == (4 * frames - 3, 4 * vae.spacial_compression_decode(),
                                             4 * vae.spacial_compression_decode(), 3)
        assert relative(out, native) < TOL, frames
        if i:  # the first length compiled the first-chunk and later-chunk programs; other lengths compile nothing
            assert xla_compiles() == before, frames
    assert decoder.stats.programs == 2
    assert decoder.stats.calls == sum(lengths)  # one call per latent frame, as ComfyUI's own loop calls it
    calls = decoder.stats.calls
    decode(vae, latents(vae, 2))  # the VAE without the node decodes on the host, as before
    assert decoder.stats.calls == calls


@pytest.mark.parametrize("kind", ["wan2.1", "wan2.2"])
def test_wan_encode_of_any_length_is_two_programs(pack, vaes, kind):
    vae = vaes(kind)
    on_tpu = tpu_vae(pack, vae)
    g = torch.Generator().manual_seed(7)
    for frames in (9, 1, 5):
        pixels = torch.rand(frames, 64, 64, 3, generator=g)
        native = encode(vae, pixels)
        out = encode(on_tpu, pixels)
        assert out.shape == native.shape and out.shape[2] == (frames - 1) // 4 + 1
        assert relative(out, native) < TOL, frames
    assert parts(on_tpu)["encoder.forward"].stats.programs == 2


def test_wan_image_to_video_encodes_its_image_on_the_devices(pack, vaes):
    from comfy_extras.nodes_wan import WanImageToVideo

    vae = vaes("wan2.1")
    on_tpu = tpu_vae(pack, vae)
    g = torch.Generator().manual_seed(8)
    image = torch.rand(1, 48, 40, 3, generator=g)  # not the video's size: the node resizes it
    positive, negative = [[torch.randn(1, 4, 8, generator=g), {}]], [[torch.randn(1, 4, 8, generator=g), {}]]

    def run(v):
        result = WanImageToVideo.execute(positive, negative, v, 64, 64, 9, 1, start_image=image).result
        return result[0][0][1]["concat_latent_image"]

    native = run(vae)
    encoder = parts(on_tpu)["encoder.forward"]
    calls = encoder.stats.calls
    out = run(on_tpu)
    assert relative(out, native) < TOL
    assert encoder.stats.calls - calls == 3  # 9 frames: the first, then two chunks of 4


def test_tiled_decode_runs_its_tiles_on_the_devices(pack, vaes):
    import nodes

    vae = vaes("wan2.1")
    on_tpu = tpu_vae(pack, vae)
    z = torch.randn(1, 16, 3, 8, 14, generator=torch.Generator().manual_seed(9))  # 64x112 frames
    native = nodes.VAEDecodeTiled().decode(vae, {"samples": z}, 64, 16, 64, 8)[0]  # two 64x64 tiles, 16 overlap
    decoder = parts(on_tpu)["decoder.forward"]
    calls, programs = decoder.stats.calls, decoder.stats.programs
    out = nodes.VAEDecodeTiled().decode(on_tpu, {"samples": z}, 64, 16, 64, 8)[0]
    assert relative(out, native) < TOL
    assert decoder.stats.calls - calls == 2 * 3  # each tile's each latent frame ran on the devices
    assert decoder.stats.programs - programs == 2  # the tiles' shape: its first-chunk and later-chunk programs


@pytest.mark.parametrize("kind,shape,frames", [("hunyuan_video", (3, 4, 4), 9), ("ltxv", (2, 2, 2), 9),
                                               ("image", (4, 4), 1)])
def test_video_and_image_vaes_are_one_program_per_shape(pack, vaes, kind, shape, frames):
    vae = vaes(kind)
    on_tpu = tpu_vae(pack, vae)
    z = torch.randn(1, vae.latent_channels, *shape, generator=torch.Generator().manual_seed(10))
    for _ in range(2):
        torch.manual_seed(11)  # LTX-Video's decode adds noise drawn from torch's generator, on the host as natively
        native = decode(vae, z)
        torch.manual_seed(11)
        out = decode(on_tpu, z)
        assert relative(out, native) < TOL
    pixels = torch.rand(frames, 64, 64, 3, generator=torch.Generator().manual_seed(12))
    assert relative(encode(on_tpu, pixels), encode(vae, pixels)) < TOL
    assert {k: v.stats.programs for k, v in parts(on_tpu).items()} == {"decoder.forward": 1, "encoder.forward": 1}


def test_a_vae_without_encoder_and_decoder_parts_runs_its_own_decode_and_encode(pack, vaes):
    """TAESD (ComfyUI's previewer VAE) has no encoder/decoder modules: its decode and encode are bridged whole."""
    vae = vaes("taesd")
    on_tpu = tpu_vae(pack, vae)
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(13))
    assert relative(decode(on_tpu, z), decode(vae, z)) < TOL
    pixels = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(14))
    assert relative(encode(on_tpu, pixels), encode(vae, pixels)) < TOL
    assert {k: v.stats.programs for k, v in parts(on_tpu).items()} == {"decode": 1, "encode": 1}


def test_a_bfloat16_vae_decodes_in_bfloat16(pack):
    """A VAE ComfyUI loaded in bfloat16 (``--bf16-vae``) computes in bfloat16 on the devices: as far from the
    float32 decode as ComfyUI's own bfloat16 decode is."""
    from tpu_runtime.bridge.tiny import tiny_vae

    vae32, vae16 = tiny_vae("wan2.1", seed=20), tiny_vae("wan2.1", seed=20, dtype=torch.bfloat16)
    on_tpu = tpu_vae(pack, vae16)
    z = latents(vae32, 3, seed=21)
    reference, native = decode(vae32, z), decode(vae16, z)
    out = decode(on_tpu, z)
    assert str(parts(on_tpu)["decoder.forward"].state["conv1.weight"].dtype) == "bfloat16"
    assert relative(out, reference) < 2 * relative(native, reference) < 0.2
    assert (out - reference).abs().mean() < 2 * (native - reference).abs().mean()


def test_vae_attention_is_the_runtimes(pack, vaes):
    """ComfyUI chose the image VAE's mid-block attention when it built it (on the CPU: split attention, which asks
    torch for free device memory): while traced it is the runtime's, and ComfyUI's choice is put back."""
    import comfy.ldm.modules.diffusionmodules.model as model

    vae = vaes("image")
    attention = vae.first_stage_model.decoder.mid.attn_1
    chosen = attention.optimized_attention
    assert chosen in (model.normal_attention, model.pytorch_attention)
    on_tpu = tpu_vae(pack, vae)
    decode(on_tpu, torch.randn(1, 4, 6, 6))
    assert attention.optimized_attention is chosen


def test_host_memory_estimate_and_no_silent_host_fallback(pack, vaes, monkeypatch):
    """ComfyUI sizes a decode for the device it runs on and decodes in tiles when torch runs out of memory. The
    copy's estimate is what the host holds (latents and frames); a device out of memory is an error that names the
    mesh, never a decode on the host."""
    from tpu_runtime.errors import InputError

    vae = vaes("wan2.1")
    on_tpu = tpu_vae(pack, vae)
    shape = (1, 16, 21, 90, 160)  # 1280x720, 81 frames
    assert on_tpu.memory_used_decode(shape, torch.float32) == (16 * 21 * 90 * 160 + 3 * 81 * 720 * 1280) * 4
    assert on_tpu.memory_used_decode(shape, torch.float32) < vae.memory_used_decode(shape, torch.float32) / 10
    decoder = parts(on_tpu)["decoder.forward"]
    z = latents(vae, 2)
    decode(on_tpu, z)

    def exhausted(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 25.81GiB")

    for variant in [v for variants in decoder._variants.values() for v in variants]:
        monkeypatch.setattr(variant, "executable", exhausted)
    with pytest.raises(InputError, match="ran out of device memory .* on mesh .*tiles"):
        decode(on_tpu, z)


def test_unload_models_releases_the_vae_weights(pack, vaes):
    import comfy.model_management as mm

    vae = vaes("wan2.1")
    on_tpu = tpu_vae(pack, vae)
    z = latents(vae, 2)
    first = decode(on_tpu, z)
    decoder = parts(on_tpu)["decoder.forward"]
    programs = decoder.stats.programs
    assert decoder.state is not None
    mm.unload_all_models()  # ComfyUI's "Unload Models" and POST /free
    assert all(p.state is None for p in parts(on_tpu).values())
    assert relative(decode(on_tpu, z), first) < 1e-6  # placed again when used, nothing compiled again
    assert decoder.stats.programs == programs


def test_one_device_copy_per_vae(pack, vaes):
    vae = vaes("wan2.1")
    assert parts(tpu_vae(pack, vae))["decoder.forward"] is parts(tpu_vae(pack, vae))["decoder.forward"]


def test_bad_inputs_are_named_before_any_decode(pack, vaes):
    from tpu_runtime.errors import InputError

    with pytest.raises(InputError, match="mesh dp=3,sp=1,tp=1 uses 3 devices"):
        tpu_vae(pack, vaes("wan2.1"), mesh="dp=3")
    with pytest.raises(InputError, match="the vae input holds a str"):
        tpu_vae(pack, "not a vae")


def test_meshes_of_eight_devices_split_the_frames():
    """The decode and the text encode on 8 simulated devices equal ComfyUI's native run on every mesh; the caches a
    decode carries between chunks stay on the devices split along their width, the text encoder's weights over tp,
    and the decode is still two programs."""
    proc = subprocess.run([sys.executable, WORKER, "auto", "dp=2,sp=2,tp=2"], capture_output=True,
                          text=True, timeout=900, cwd=str(Path(WORKER).parent),
                          env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    line = next((l for l in proc.stdout.splitlines() if l.startswith("BRIDGE ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(line[len("BRIDGE "):])
    assert report["devices"] == 8
    for mesh, result in report["meshes"].items():
        assert result["vae_relative"] < TOL and result["text_relative"] < TOL, mesh
        assert result["decoder_programs"] == 2 and result["text_programs"] == 1, mesh
        # a 1x16x2x8x8 cache: its 8 columns over the 8 devices
        assert result["cache_shape"] == [1, 16, 2, 8, 8] and result["cache_shard_shape"] == [1, 16, 2, 8, 1], mesh
        tp = result["text_mesh"]["tp"]
        assert result["q_shard_elements"] * tp == result["q_elements"], mesh
        assert not result["embedding_placed"]
    assert report["meshes"]["auto"]["vae_mesh"] == {"dp": 1, "sp": 8, "tp": 1}
    assert report["meshes"]["auto"]["text_mesh"] == {"dp": 1, "sp": 2, "tp": 4}  # 4 heads on tp
