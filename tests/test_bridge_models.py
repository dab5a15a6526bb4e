"""ComfyUI 0.33's new native video model classes through the native bridge: HunyuanVideo 1.5 (and its VAE), Kandinsky
5, Wan 2.2 Animate and native CogVideoX, each a tiny random-weight file built with ComfyUI's own class and read by its
own loader, sampled by its own sampler, equal ComfyUI's native CPU run (float32, 1e-4 relative), with the programs
counted. And on both trees: models whose code copies ComfyUI's per-call options (HunyuanVideo's layers, LTX's
arguments) compile one program for all the steps of a run."""

import pytest
import torch
from comfy_native import (
    comfyui_session, load, load_pack, relative, sample, save_diffusion_model, tiny_hunyuan_video, tiny_ltxv,
    versions_param,
)

TOL = 1e-4


@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param):
        yield load_pack()


def tpu(pack, model):
    return pack.NODE_CLASS_MAPPINGS["TPUDiffusionModel"]().apply(model)[0]


def bridged(model):
    return next(v for k, v in model.object_patches.items() if k.startswith("diffusion_model.")).bridged


def texts(width: int, seed: int, length: int = 8, **extra):
    g = torch.Generator().manual_seed(seed)
    return ([[torch.randn(1, length, width, generator=g), dict(extra)]],
            [[torch.randn(1, length, width, generator=g), dict(extra)]])


def equal_native(pack, model, latent, positive, negative, programs=1, **options):
    """Sample natively and through TPU Diffusion Model; the bridged module after the run."""
    options = {"cfg": 4.0, "steps": 3, **options}
    native = sample(model, latent, positive, negative, **options)
    on_tpu = tpu(pack, model)
    assert relative(sample(on_tpu, latent, positive, negative, **options), native) < TOL
    module = bridged(on_tpu)
    assert module.stats.programs == programs and module.stats.calls == options["steps"]
    return module


def test_models_that_copy_the_options_compile_once_per_run(pack, tmp_path):
    """HunyuanVideo's layers copy ``transformer_options`` (``.copy()``) and 0.33's LTX copies all of them into its own
    arguments: the copies keep recording what the model reads, so the sampler's per-call values (the sigma, the
    conds' ids) key no program: one program for every step and for a new seed."""
    hunyuan = load(save_diffusion_model(tiny_hunyuan_video(), tmp_path / "hunyuan_video.safetensors", seed=7))
    positive, negative = texts(64, 1, pooled_output=torch.ones(1, 768), guidance=6.0)
    module = equal_native(pack, hunyuan, torch.zeros(1, 16, 2, 4, 4), positive, negative, steps=2)
    sample(tpu(pack, hunyuan), torch.zeros(1, 16, 2, 4, 4), positive, negative, cfg=4.0, steps=2, seed=9)
    assert module.stats.programs == 1
    ltxv = load(save_diffusion_model(tiny_ltxv(), tmp_path / "ltxv.safetensors", seed=8))
    positive, negative = texts(4096, 2, frame_rate=24, attention_mask=torch.ones(1, 8, dtype=torch.int64))
    equal_native(pack, ltxv, torch.zeros(1, 128, 2, 2, 2), positive, negative, steps=2)


@pytest.mark.comfy_versions("0.33")
def test_hunyuan_video_15_text_glyphs_and_image(pack, tmp_path):
    """HunyuanVideo 1.5's I2V conditioning: Qwen text, ByT5 glyph text, SigLIP image features and the image's latent
    with its mask concatenated to the noise."""
    from comfy.clip_vision import Output

    from tpu_runtime.bridge.tiny import tiny_hunyuan_video_15

    model = load(save_diffusion_model(tiny_hunyuan_video_15(), tmp_path / "hunyuan_video_15.safetensors", seed=4))
    assert type(model.model).__name__ == "HunyuanVideo15"
    g = torch.Generator().manual_seed(5)
    vision = Output()
    vision.last_hidden_state = torch.randn(1, 9, 1152, generator=g)
    positive, negative = texts(64, 3, pooled_output=None, clip_vision_output=vision,
                               conditioning_byt5small=torch.randn(1, 5, 1472, generator=g),
                               concat_latent_image=torch.randn(1, 32, 2, 4, 4, generator=g))
    module = equal_native(pack, model, torch.zeros(1, 32, 2, 4, 4), positive, negative)
    assert module.rules.name == "HunyuanVideo"


@pytest.mark.comfy_versions("0.33")
def test_hunyuan_video_15_vae_decodes_and_encodes(pack):
    import nodes

    from tpu_runtime.bridge.tiny import tiny_hunyuan_video_15_vae
    from tpu_runtime.bridge.vae import bridged_parts

    g = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        vae = tiny_hunyuan_video_15_vae(seed=8)
        on_tpu = pack.NODE_CLASS_MAPPINGS["TPUVAE"]().apply(vae)[0]
        latent = {"samples": torch.randn(1, 32, 2, 1, 2, generator=g)}
        frames = nodes.VAEDecode().decode(on_tpu, latent)[0]
        assert frames.shape == (5, 16, 32, 3)  # 4x in time (the first frame alone), 16x in space
        assert relative(frames, nodes.VAEDecode().decode(vae, latent)[0]) < TOL
        pixels = torch.rand(5, 16, 32, 3, generator=g)
        latents = nodes.VAEEncode().encode(on_tpu, pixels)[0]["samples"]
        assert latents.shape == (1, 32, 2, 1, 2)
        assert relative(latents, nodes.VAEEncode().encode(vae, pixels)[0]["samples"]) < TOL
    parts = bridged_parts(on_tpu)
    assert parts["decoder.forward"].stats.programs == parts["encoder.forward"].stats.programs == 1


@pytest.mark.comfy_versions("0.33")
def test_kandinsky5_pooled_text_and_mask(pack, tmp_path):
    from tpu_runtime.bridge.tiny import tiny_kandinsky5

    model = load(save_diffusion_model(tiny_kandinsky5(), tmp_path / "kandinsky5.safetensors", seed=5))
    assert type(model.model).__name__ == "Kandinsky5"
    g = torch.Generator().manual_seed(7)
    positive, negative = texts(3584, 4, pooled_output=torch.randn(1, 768, generator=g))
    equal_native(pack, model, torch.zeros(1, 16, 2, 4, 4), positive, negative)


@pytest.mark.comfy_versions("0.33")
def test_native_cogvideox(pack, tmp_path):
    from tpu_runtime.bridge.tiny import tiny_cogvideox

    model = load(save_diffusion_model(tiny_cogvideox(), tmp_path / "cogvideox.safetensors", seed=6))
    assert type(model.model).__name__ == "CogVideoX"
    positive, negative = texts(64, 5)
    equal_native(pack, model, torch.zeros(1, 16, 3, 4, 4), positive, negative, sampler="ddim", scheduler="ddim_uniform")


@pytest.mark.comfy_versions("0.33")
def test_wan_animate_pose_and_face(pack, tmp_path):
    """Wan 2.2 Animate: the pose video's latents added after the patch embedding, the face video through the motion
    encoder (512x512 crops, a QR of its direction weights) and the face adapter; attention ComfyUI calls without the
    runtime's override (the face blocks) runs on the runtime too."""
    from comfy.clip_vision import Output

    from tpu_runtime.bridge.tiny import tiny_wan_animate

    model = load(save_diffusion_model(tiny_wan_animate(), tmp_path / "wan_animate.safetensors", seed=7))
    assert type(model.model).__name__ == "WAN22_Animate"
    g = torch.Generator().manual_seed(8)
    vision = Output()
    vision.penultimate_hidden_states = torch.randn(1, 257, 1280, generator=g)
    positive, negative = texts(4096, 6, clip_vision_output=vision,
                               concat_latent_image=torch.randn(1, 16, 2, 4, 4, generator=g),
                               concat_mask=torch.ones(1, 4, 2, 4, 4),
                               pose_video_latent=torch.randn(1, 16, 1, 4, 4, generator=g),
                               face_video_pixels=torch.rand(1, 3, 1, 512, 512, generator=g) * 2 - 1)
    equal_native(pack, model, torch.zeros(1, 16, 2, 4, 4), positive, negative, cfg=1.0, steps=2)


@pytest.mark.comfy_versions("0.33")
def test_seedvr2_sizes_kept_as_tensors(pack, tmp_path):
    """SeedVR2's NaDiT (the video upscaler) flattens the video into one sequence and keeps its sizes as tensors, from
    which it splits, windows and unflattens (``.tolist()``): computed from the shapes while traced they stay
    concrete (``comfy.SIZES_AS_TENSORS``); its variable-length attention calls ComfyUI's attention module. Its own
    conditioning node's text (58 tokens) and the video's latent concatenated with its mask, without CFG as its
    template samples (the template test runs it with CFG's two text lengths too)."""
    import comfy_extras.nodes_seedvr as seedvr

    from tpu_runtime.bridge import tiny

    with tiny.seedvr2_reduced():
        model = load(save_diffusion_model(tiny.tiny_seedvr2(), tmp_path / "seedvr2.safetensors", seed=9))
    assert type(model.model).__name__ == "SeedVR2"
    g = torch.Generator().manual_seed(10)
    positive, negative = seedvr.SeedVR2Conditioning.execute(
        model, {"samples": torch.randn(1, 16, 2, 4, 6, generator=g)}).result[:2]
    equal_native(pack, model, torch.zeros(1, 16, 2, 4, 6), positive, negative, cfg=1.0, steps=1)


@pytest.mark.comfy_versions("0.33")
def test_seedvr2_vae_slices_with_its_caches_on_the_devices(pack, tmp_path):
    """SeedVR2's VAE (it tiles the video itself) encodes and decodes a video longer than one slice, its causal caches
    carried between slices in a dict keyed by its layers: its slicing loop is one program, equal ComfyUI's run,
    through the tiled nodes its template uses."""
    import comfy.sd
    import comfy.utils
    import nodes

    from tpu_runtime.bridge import tiny
    from tpu_runtime.bridge.vae import bridged_parts

    with tiny.seedvr2_reduced():
        vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(tiny.save_seedvr2_vae(tmp_path / "vae.safetensors", 4))))
    assert vae.handles_tiling and vae.first_stage_model.slicing_sample_min_size < 8
    g = torch.Generator().manual_seed(11)
    pixels = torch.rand(9, 32, 48, 3, generator=g)
    with torch.inference_mode():
        on_tpu = pack.NODE_CLASS_MAPPINGS["TPUVAE"]().apply(vae)[0]
        latents = nodes.VAEEncodeTiled().encode(on_tpu, pixels, 512, 128, 64, 8)[0]["samples"]
        assert latents.shape == (1, 16, 3, 4, 6)
        assert relative(latents, nodes.VAEEncodeTiled().encode(vae, pixels, 512, 128, 64, 8)[0]["samples"]) < TOL
        frames = nodes.VAEDecodeTiled().decode(on_tpu, {"samples": latents}, 512, 128, 64, 8)[0]
        assert frames.shape == (9, 32, 48, 3)
        assert relative(frames, nodes.VAEDecodeTiled().decode(vae, {"samples": latents}, 512, 128, 64, 8)[0]) < TOL
    parts = bridged_parts(on_tpu)
    assert set(parts) == {"slicing_encode", "slicing_decode"}
    assert parts["slicing_encode"].stats.programs == parts["slicing_decode"].stats.programs == 1
