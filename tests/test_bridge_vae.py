"""TPU VAE: ComfyUI's own VAEs, made by ComfyUI's own loader, decode and encode through ComfyUI's own nodes on the
runtime and equal ComfyUI's native CPU run on the same weights (float32, 1e-4 relative), on each ComfyUI tree.
Programs are counted per bridged part (``stats.programs``) and XLA compiles per process.

A causal Wan VAE decodes chunk by chunk as ComfyUI's own loop calls its decoder (ComfyUI 0.3.64: one latent frame a
call; 0.33's Wan 2.1 VAE: the first frame, then two a call), its caches on the devices: a bounded number of programs
whatever the length (0.3.64: two, a first-chunk and a later-chunk one; 0.33's Wan 2.1 VAE: three, and one more for a
last single frame), and so does its encoder (0.33's with its deferred downsampling: eight at most). VAEs that decode
a video at once (HunyuanVideo's; LTX-Video's, chunked inside one call in 0.33) and image VAEs: one program per shape.
VAEs that tile the video in their own code (0.33's ``handles_tiling``: MiniMax H3's) run their tiles on the runtime:
tests/test_bridge_minimax.py."""

import contextlib
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


def _form(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, list):
        return tuple(_form(v) for v in value)
    return value


@contextlib.contextmanager
def native_calls(module):
    """The calls ComfyUI's own code makes of a VAE part natively while the block runs (not those of a TPU VAE, which
    run its object patch): for each, its input's shape and every other argument, a cache list item by item (arrays
    by shape), as the call began."""
    from tpu_runtime.bridge.vae import VAEPartForward

    calls: list[tuple] = []

    def record(part, args, kwargs):
        if not isinstance(vars(part).get("forward"), VAEPartForward):
            x = args[0] if args else kwargs["x"]
            calls.append((tuple(x.shape), _form(list(args[1:])),
                          tuple(sorted((k, _form(v)) for k, v in kwargs.items() if k != "x"))))

    handle = module.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def cache_slots(vae) -> int:
    """The length of the cache list ComfyUI's Wan VAE gives its decoder."""
    import importlib

    module = importlib.import_module(type(vae.first_stage_model.decoder).__module__)
    count = getattr(module, "count_cache_layers", None) or module.count_conv3d  # 0.33 counts downsampling slots too
    return count(vae.first_stage_model.decoder)


def _first_only(module) -> dict:
    """The arguments only a first chunk takes (Wan 2.2's ``first_chunk``)."""
    import inspect

    return {"first_chunk": True} if "first_chunk" in inspect.signature(type(module).forward).parameters else {}


# Both Wan VAEs on both trees: ComfyUI 0.3.64's Wan 2.2 VAE keeps its caches on the module (0.33's passes new lists).
WAN_KINDS = ["wan2.1", "wan2.2"]


@pytest.mark.parametrize("kind", WAN_KINDS)
def test_a_first_decode_and_encode_of_several_chunks_equal_native(pack, kind):
    """The first call of a fresh TPU VAE is a whole video of several chunks (as in a template: the first decode is
    the video's): its caches' steady form is found by observing ComfyUI's own loop on ``meta`` while ComfyUI's loop is
    running, which must leave the VAE's own state alone (ComfyUI 0.3.64's Wan VAEs hold the cache list their loop
    passes to the next chunk, and reset it at the start of a decode)."""
    from tpu_runtime.bridge.tiny import tiny_vae

    vae = tiny_vae(kind, seed=9)
    size = 4 * vae.spacial_compression_encode() // 2
    g = torch.Generator().manual_seed(4)
    pixels = torch.rand(9, size, size, 3, generator=g)
    z = latents(vae, 3, seed=4)
    native_latents, native_frames = encode(vae, pixels), decode(vae, z)
    on_tpu = tpu_vae(pack, vae)
    assert relative(encode(on_tpu, pixels), native_latents) < TOL
    assert relative(decode(on_tpu, z), native_frames) < TOL
    assert relative(decode(vae, z), native_frames) < TOL  # the VAE without the node, as before


@pytest.mark.parametrize("kind", WAN_KINDS)
def test_wan_decode_of_any_length_is_a_bounded_number_of_programs(pack, vaes, kind):
    """1, 3, 5 and 9 latent frames decode as ComfyUI's native run, one bridged call per call ComfyUI's own loop makes:
    a first-chunk and a later-chunk program where the loop decodes a latent frame a call, and also one for a lone
    frame (decoded without caches) where it decodes two a call (ComfyUI 0.33's Wan 2.1 VAE). Lengths after the first
    two compile nothing; an even length adds, once, the program of its last chunk (a single frame) where chunks are
    two frames. The caches a first chunk leaves are on the devices in the form later chunks leave them."""
    import jax

    from tpu_runtime.bridge.calls import DeviceValue

    vae = vaes(kind)
    on_tpu = tpu_vae(pack, vae)
    decoder = parts(on_tpu)["decoder.forward"]
    module = vae.first_stage_model.decoder
    scale = vae.spacial_compression_decode()
    chunks = {}
    for frames in (1, 3, 5, 9):
        z = latents(vae, frames, seed=frames)
        with native_calls(module) as calls:
            native = decode(vae, z)
        chunks[frames] = [shape[2] for shape, _, _ in calls]
        before, bridged = xla_compiles(), decoder.stats.calls
        out = decode(on_tpu, z)
        assert out.shape == native.shape == (4 * frames - 3, 4 * scale, 4 * scale, 3)
        assert relative(out, native) < TOL, frames
        assert decoder.stats.calls - bridged == len(calls), frames
        if frames > 3:
            assert xla_compiles() == before, frames
    two_frames = chunks[3] == [1, 2]
    assert two_frames or chunks[3] == [1, 1, 1], chunks
    assert decoder.stats.programs == (3 if two_frames else 2)
    for frames, added in ((2, int(two_frames)), (6, 0)):
        programs, before = decoder.stats.programs, xla_compiles()
        z = latents(vae, frames, seed=frames)
        assert relative(decode(on_tpu, z), decode(vae, z)) < TOL, frames
        assert decoder.stats.programs - programs == added, frames
        if not added:
            assert xla_compiles() == before, frames
    # The first chunk, called as ComfyUI's loop calls it: its caches stay on the devices, settled to two frames each
    # (CACHE_T), no marker left on the host; a later chunk takes them as they are.
    z, programs = latents(vae, 5), decoder.stats.programs
    cache = [None] * cache_slots(vae)
    decoder(z[:, :, :1], feat_cache=cache, feat_idx=[0], **_first_only(module))
    arrays = [v for v in cache if v is not None]
    assert arrays and all(isinstance(v, DeviceValue) and isinstance(v.array, jax.Array) for v in arrays)
    assert all(v.shape[2] == 2 for v in arrays)
    decoder(z[:, :, 1:1 + chunks[5][1]], feat_cache=cache, feat_idx=[0])
    assert decoder.stats.programs == programs
    calls = decoder.stats.calls
    decode(vae, latents(vae, 2))  # the VAE without the node decodes on the host, as before
    assert decoder.stats.calls == calls


@pytest.mark.parametrize("kind", WAN_KINDS)
def test_wan_encode_of_any_length_is_a_bounded_number_of_programs(pack, vaes, kind):
    """1, 5, 9 and 13 frames encode as ComfyUI's native run, in no more programs than the distinct calls ComfyUI's
    own loop makes, and a longer video compiles nothing. Where the loop encodes the temporal factor's frames a call
    (ComfyUI 0.3.64, Wan 2.2): two programs. ComfyUI 0.33's Wan 2.1 encoder takes two frames a call and defers a
    downsampling's single output frame to the next call: eight, a lone frame (no caches), the first chunk, a later
    chunk in each of the four states of its two deferred slots, and a last chunk in the two states it can meet."""
    vae = vaes(kind)
    on_tpu = tpu_vae(pack, vae)
    module = vae.first_stage_model.encoder
    size = 4 * vae.spacial_compression_encode() // 2
    g = torch.Generator().manual_seed(7)
    distinct = set()
    for frames in (1, 5, 9, 13):
        pixels = torch.rand(frames, size, size, 3, generator=g)
        with native_calls(module) as calls:
            native = encode(vae, pixels)
        distinct.update(calls)
        out = encode(on_tpu, pixels)
        assert out.shape == native.shape and out.shape[2] == (frames - 1) // 4 + 1
        assert relative(out, native) < TOL, frames
    encoder = parts(on_tpu)["encoder.forward"]
    two_frames = calls[1][0][2] == 2
    assert encoder.stats.programs == (8 if two_frames else 2) <= len(distinct)
    programs, before = encoder.stats.programs, xla_compiles()
    pixels = torch.rand(21, size, size, 3, generator=g)
    assert relative(encode(on_tpu, pixels), encode(vae, pixels)) < TOL
    assert encoder.stats.programs == programs and xla_compiles() == before


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

    with native_calls(vae.first_stage_model.encoder) as calls:
        native = run(vae)
    encoder = parts(on_tpu)["encoder.forward"]
    before = encoder.stats.calls
    out = run(on_tpu)
    assert relative(out, native) < TOL
    assert encoder.stats.calls - before == len(calls) >= 3  # 9 frames, chunked as ComfyUI's loop chunks them


def test_tiled_decode_runs_its_tiles_on_the_devices(pack, vaes):
    import nodes

    vae = vaes("wan2.1")
    on_tpu = tpu_vae(pack, vae)
    z = torch.randn(1, 16, 3, 8, 14, generator=torch.Generator().manual_seed(9))  # 64x112 frames
    with native_calls(vae.first_stage_model.decoder) as calls:
        native = nodes.VAEDecodeTiled().decode(vae, {"samples": z}, 64, 16, 64, 8)[0]  # two 64x64 tiles, 16 overlap
    decoder = parts(on_tpu)["decoder.forward"]
    before, programs = decoder.stats.calls, decoder.stats.programs
    out = nodes.VAEDecodeTiled().decode(on_tpu, {"samples": z}, 64, 16, 64, 8)[0]
    assert relative(out, native) < TOL
    assert decoder.stats.calls - before == len(calls) >= 4  # each tile's each chunk ran on the devices
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


@pytest.mark.comfy_versions("0.33")
def test_ltxv_decodes_in_chunks_sized_for_the_runtimes_memory(pack, vaes, monkeypatch):
    """ComfyUI 0.33's LTX-Video VAE (``comfy_has_chunked_io``) sizes the chunks it decodes and encodes in by asking
    the memory of the device its tensors are on: traced, that is the runtime's, answered without asking CUDA. Chunks
    small enough to split this decode into several (its causal caches added into the parts of each split block)
    give ComfyUI's native numbers in one program per part; the frames land in the buffer ComfyUI hands the decoder."""
    import comfy.ldm.lightricks.vae.causal_video_autoencoder as ltx

    from tpu_runtime.bridge.vae import device_memory

    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA's memory was asked")

    monkeypatch.setattr(torch.cuda, "memory_stats", no_cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_cuda)
    asked, sizes = [], ltx.get_max_chunk_size

    def small_chunks(device):
        asked.append((device.type, ltx.comfy.model_management.get_total_memory(device)))
        sizes(device)
        return 1_000_000  # bytes: a few frames of this decode's last blocks a chunk

    monkeypatch.setattr(ltx, "get_max_chunk_size", small_chunks)
    vae = vaes("ltxv")
    on_tpu = tpu_vae(pack, vae)
    programs = {k: v.stats.programs for k, v in parts(on_tpu).items()}
    z = torch.randn(1, vae.latent_channels, 3, 2, 2, generator=torch.Generator().manual_seed(15))
    torch.manual_seed(16)  # the decode noise, drawn on the host as natively
    native = decode(vae, z)
    asked.clear()
    torch.manual_seed(16)
    assert relative(decode(on_tpu, z), native) < TOL
    devices = list(parts(on_tpu)["decoder.forward"].mesh.devices.flat)
    assert asked == [("jax", device_memory(devices)[0])]
    pixels = torch.rand(17, 64, 64, 3, generator=torch.Generator().manual_seed(17))
    assert relative(encode(on_tpu, pixels), encode(vae, pixels)) < TOL
    assert {k: v.stats.programs - programs.get(k, 0) for k, v in parts(on_tpu).items()} == {"decoder.forward": 1,
                                                                                           "encoder.forward": 1}


def test_plan_plans_the_steady_decode_program_comfyui_runs(pack, vaes):
    """``plan --comfy-model ... --stages decode`` plans the Wan VAE decode's first-chunk program and the program of
    the later chunks ComfyUI's own loop makes (one latent frame in 0.3.64, two in 0.33): that program takes the
    caches the first leaves and leaves them the same, and makes four frames a latent frame (a reduced VAE on meta,
    its released layout; compiled for a v6e-8 by ``plan``, traced here)."""
    import dataclasses

    import jax

    from tpu_runtime.bridge.architectures import COMPONENTS
    from tpu_runtime.bridge.planning import decode_programs
    from tpu_runtime.engine.runtime import tracing
    from tpu_runtime.tools.topology import parse_topology

    vae = vaes("wan2.1")
    with native_calls(vae.first_stage_model.decoder) as calls:
        decode(vae, latents(vae, 5))
    later_frames = calls[1][0][2]
    component = COMPONENTS["wan2.1-vae"]
    reduced = dataclasses.replace(component, config={**component.config, "dim": 8})
    first, later = decode_programs(reduced.build(), (1, 16, 1, 4, 8), parse_topology("v6e-8").devices(), None, None,
                                   "Wan VAE")
    assert str(later.mesh) == "dp=1,sp=8,tp=1"
    assert later.inputs[0].shape == (1, 16, later_frames, 4, 8)
    caches = later.inputs[1:]
    assert len(caches) > 20 and all("sp" in str(c.sharding.spec[4]) for c in caches)  # split along the width
    with tracing():
        out, carried = jax.eval_shape(later.fn, later.weights, later.inputs)
    frames = sum(o.shape[2] for o in jax.tree_util.tree_leaves(out))
    assert frames == 4 * later_frames
    assert ("every later latent frame" if later_frames == 1 else
            f"every later chunk of {later_frames} latent frames") in later.describe
    assert [(c.shape, c.dtype) for c in carried] == [(c.shape, c.dtype) for c in caches]


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


def test_meshes_of_eight_devices_split_the_frames(pack, request):
    """The decode and the text encode on 8 simulated devices equal ComfyUI's native run on every mesh; the caches a
    decode carries between chunks stay on the devices split along their width, the text encoder's weights over tp,
    and the decode of three latent frames is two programs (the first chunk, the later one)."""
    version = request.node.callspec.params["pack"]
    proc = subprocess.run([sys.executable, WORKER, "--comfy", version, "auto", "dp=2,sp=2,tp=2"], capture_output=True,
                          text=True, timeout=900, cwd=str(Path(WORKER).parent),
                          env=subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    line = next((l for l in proc.stdout.splitlines() if l.startswith("BRIDGE ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(line[len("BRIDGE "):])
    assert report["devices"] == 8 and report["comfyui"] == version
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
