"""LTX-2 (ComfyUI 0.33's ``LTXAV``: video with sound) through the native bridge: the diffusion model's video and audio
latents, its Gemma 3 text encoder (TPU Text Encoder) and its audio VAE (TPU VAE) each equal ComfyUI's native CPU run
on the same tiny random weights (float32, 1e-4 relative), made by ComfyUI's own classes and loaders and run through
its own sampler and nodes. Programs are counted: one per call structure, a new seed or prompt compiles nothing."""

import pytest
import torch
from comfy_native import comfyui_session, load, load_pack, relative, sample, versions_param

from tpu_runtime.bridge.tiny import save_diffusion_model, tiny_ltxav

pytestmark = pytest.mark.comfy_versions("0.33")  # LTX-2 is new in 0.33

TOL = 1e-4
VIDEO, AUDIO = (1, 128, 2, 2, 2), (1, 8, 5, 16)  # 9 frames at 64x64, and their sound (8 channels x 16 bins)


@pytest.fixture(scope="module", params=versions_param())
def pack(request):
    with comfyui_session(request.param):
        yield load_pack()


@pytest.fixture(scope="module")
def ltxav(pack, tmp_path_factory):
    """A tiny LTX-2 file (its header's config, as released files carry it) through Load Diffusion Model."""
    module, metadata = tiny_ltxav()
    path = tmp_path_factory.mktemp("ltxav") / "ltx2.safetensors"
    return load(save_diffusion_model(module, path, seed=11, metadata=metadata))


def av_latent(video=None):
    import comfy.nested_tensor

    video = torch.zeros(VIDEO) if video is None else video
    return comfy.nested_tensor.NestedTensor((video, torch.zeros(AUDIO)))


def conds(seed: int, width: int = 64, length: int = 7):
    """The text encoder's conditioning as LTX-2 takes it: Gemma 3's projected states, to go through the model's own
    text connectors (``unprocessed_ltxav_embeds``)."""
    g = torch.Generator().manual_seed(seed)
    extra = {"frame_rate": 25, "unprocessed_ltxav_embeds": True}
    return ([[torch.randn(1, length, width, generator=g), dict(extra)]],
            [[torch.randn(1, length + 2, width, generator=g), dict(extra)]])


def tpu(pack, model):
    return pack.NODE_CLASS_MAPPINGS["TPUDiffusionModel"]().apply(model)[0]


def bridged(model):
    return next(v for k, v in model.object_patches.items() if k.startswith("diffusion_model.")).bridged


def connectors(model):
    """The bridged text connectors (``preprocess_text_embeds``, run while ComfyUI prepares the conds)."""
    return model.object_patches["diffusion_model.preprocess_text_embeds"].bridged


def xla_compiles():
    from tpu_runtime.engine.runtime import compile_stats

    return compile_stats().xla_compiles


def assert_streams_equal(out, native):
    assert out.is_nested and native.is_nested
    (video, audio), (video_native, audio_native) = out.unbind(), native.unbind()
    assert video.shape == VIDEO and audio.shape == AUDIO
    assert relative(video, video_native) < TOL
    assert relative(audio, audio_native) < TOL


def test_video_and_audio_latents_equal_native(pack, ltxav):
    assert type(ltxav.model).__name__ == "LTXAV"  # ComfyUI's detection read the file as LTX-2
    positive, negative = conds(1)
    native = sample(ltxav, av_latent(), positive, negative, cfg=3.0, steps=3)
    on_tpu = tpu(pack, ltxav)
    assert_streams_equal(sample(on_tpu, av_latent(), positive, negative, cfg=3.0, steps=3), native)
    module = bridged(on_tpu)
    assert module.rules.name == "LTX-2"
    # cond and uncond (their connectors pad both to 1024 tokens) are one batch: one program for every step, although
    # the model copies all of ComfyUI's per-call options (the current sigma among them) into its own arguments
    assert module.stats.programs == 1 and module.stats.calls == 3
    # the text connectors ran on the runtime too, with their own weights only: a program per prompt length (7, 9)
    text = connectors(on_tpu)
    assert text.stats.programs == text.stats.calls == 2
    assert set(text.state) and all("embeddings_connector." in n or "caption_projection." in n for n in text.state)
    before = xla_compiles()
    positive, negative = conds(2)
    native = sample(ltxav, av_latent(), positive, negative, cfg=3.0, steps=4, seed=7)
    assert_streams_equal(sample(on_tpu, av_latent(), positive, negative, cfg=3.0, steps=4, seed=7), native)
    assert module.stats.programs == 1 and text.stats.programs == 2  # new prompts (same lengths), seed, step count
    assert xla_compiles() == before


def test_image_to_video_keeps_the_first_frame(pack, ltxav):
    """LTXV Img To Video's noise mask: the first latent frame kept. The model branches on the mask's values (which
    frames share a timestep): the mask is a constant of the program, one program for the run."""
    import comfy.nested_tensor
    import comfy.sample

    g = torch.Generator().manual_seed(3)
    latent = av_latent(torch.randn(VIDEO, generator=g))
    video_mask = torch.ones(1, 1, *VIDEO[2:])
    video_mask[:, :, 0] = 0.0
    mask = comfy.nested_tensor.NestedTensor((video_mask, torch.ones(1, 1, *AUDIO[2:])))
    positive, negative = conds(4)
    noise = comfy.sample.prepare_noise(latent, 5)

    def run(model):
        return comfy.sample.sample(model, noise, 3, 3.0, "euler", "simple", positive, negative, latent,
                                   noise_mask=mask, seed=5, disable_pbar=True)

    native = run(ltxav)
    on_tpu = tpu(pack, ltxav)
    programs = bridged(on_tpu).stats.programs
    out = run(on_tpu)
    assert_streams_equal(out, native)
    assert relative(out.unbind()[0][:, :, 0], latent.unbind()[0][:, :, 0]) < TOL  # the image's frame kept
    assert bridged(on_tpu).stats.programs == programs + 1


def test_gemma3_text_encoder_equals_native(pack):
    """LTX-2's text encoder (Gemma 3, every hidden state, projected): Gemma runs on the runtime, its prompts padded to
    1024 tokens (one program for every prompt)."""
    import nodes

    from tpu_runtime.bridge.text import bridged_text_models
    from tpu_runtime.bridge.tiny import tiny_ltxav_text_encoder

    with torch.inference_mode():
        clip = tiny_ltxav_text_encoder(seed=5)
        on_tpu = pack.NODE_CLASS_MAPPINGS["TPUTextEncoder"]().apply(clip)[0]
        for text in ("a cat playing the piano", "waves on a beach at sunset, a gull calls"):
            cond, extra = nodes.CLIPTextEncode().encode(clip, text)[0][0]
            cond_tpu, extra_tpu = nodes.CLIPTextEncode().encode(on_tpu, text)[0][0]
            assert cond_tpu.shape == cond.shape and extra_tpu.keys() == extra.keys()
            assert relative(cond_tpu, cond) < TOL, text
    (gemma,) = bridged_text_models(on_tpu).values()
    assert type(gemma.module).__name__ == "Gemma3_12B" and gemma.rules.name == "LLaMA"
    assert gemma.stats.programs == 1 and gemma.stats.calls == 2


def test_audio_vae_decodes_and_encodes_sound(pack):
    """The audio VAE (spectrogram decoder and vocoder) through TPU VAE: the waveform LTXV Audio VAE Decode gives
    equals native; LTXV Audio VAE Encode's latents too (its mel spectrogram on the host, as ComfyUI computes it)."""
    from comfy_extras.nodes_lt_audio import LTXVAudioVAEDecode, LTXVAudioVAEEncode

    from tpu_runtime.bridge.tiny import tiny_audio_vae
    from tpu_runtime.bridge.vae import bridged_parts

    g = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        vae = tiny_audio_vae(seed=7)
        on_tpu = pack.NODE_CLASS_MAPPINGS["TPUVAE"]().apply(vae)[0]
        latent = {"samples": av_latent(torch.zeros(VIDEO)).unbind()[1] + torch.randn(AUDIO, generator=g)}
        native = LTXVAudioVAEDecode.execute(latent, vae).result[0]
        sound = LTXVAudioVAEDecode.execute(latent, on_tpu).result[0]
        assert sound["sample_rate"] == native["sample_rate"] == 16000
        assert sound["waveform"].shape == native["waveform"].shape == (1, 2, 160 * (4 * AUDIO[2] - 3))
        assert relative(sound["waveform"], native["waveform"]) < TOL
        audio = {"waveform": 0.1 * torch.randn(1, 2, 8000, generator=g), "sample_rate": 16000}
        encoded = LTXVAudioVAEEncode.execute(audio, on_tpu).result[0]["samples"]
        assert relative(encoded, LTXVAudioVAEEncode.execute(audio, vae).result[0]["samples"]) < TOL
    parts = bridged_parts(on_tpu)
    assert parts["decode"].stats.programs == parts["decode"].stats.calls == 1
    assert parts["autoencoder.encoder.forward"].stats.programs == 1


def test_ltx23_template_files_equal_native(pack, tmp_path):
    """LTX-2.3 as its templates load it: the checkpoint (transformer with 2.3's options, dual text projection) through
    Load Checkpoint, Gemma 3 12B in its released layout (bfloat16, nvfp4 attention and feed-forward matrices) with the
    checkpoint through Load LTXV Audio Text Encoder. The text encoder equals native within 1e-4 on a prompt padded to
    the template's 1024 tokens (XLA's CPU backend keeps the bfloat16 rounding torch does: Gemma's ``w + 1`` norm scales
    moved its states by 5% before); the transformer's sound stream, whose RoPE positions are latent times in seconds,
    within 5e-6 a step over five seconds of sound (XLA's division by a number and its frequency grid moved it by 4e-5
    a step before, more the longer the sound: ``EXACT_DIVISION`` and ``HOST_FUNCTIONS`` in bridge/comfy.py)."""
    import comfy.nested_tensor
    import comfy.sd
    import nodes

    from tpu_runtime.bridge import tiny

    with tiny.gemma3_12b_reduced():
        checkpoint = tiny.save_ltx23_checkpoint(tmp_path / "ltx-2.3-22b-dev-fp8.safetensors", seed=21)
        gemma = tiny.save_gemma3_12b(tmp_path / "gemma_3_12B_it_fp4_mixed.safetensors", seed=22)
        clip = comfy.sd.load_clip(ckpt_paths=[str(gemma), str(checkpoint)], clip_type=comfy.sd.CLIPType.LTXV)
        with torch.inference_mode():
            on_tpu = pack.NODE_CLASS_MAPPINGS["TPUTextEncoder"]().apply(clip)[0]
            text = "pc game, console game, video game, cartoon, childish, ugly"
            cond, extra = nodes.CLIPTextEncode().encode(clip, text)[0][0]
            cond_tpu, _ = nodes.CLIPTextEncode().encode(on_tpu, text)[0][0]
    width = tiny.LTX23_TINY["cross_attention_dim"] + tiny.LTX23_TINY["audio_cross_attention_dim"]
    assert cond.shape[-1] == width and extra.get("unprocessed_ltxav_embeds")
    assert relative(cond_tpu, cond) < TOL

    model = comfy.sd.load_checkpoint_guess_config(str(checkpoint))[0]
    assert type(model.model.diffusion_model).__name__ == "LTXAVModel"
    g = torch.Generator().manual_seed(23)
    positive = [[torch.randn(1, 9, width, generator=g), {"frame_rate": 25, "unprocessed_ltxav_embeds": True}]]
    negative = [[torch.randn(1, 7, width, generator=g), {"frame_rate": 25, "unprocessed_ltxav_embeds": True}]]

    def latent():
        return comfy.nested_tensor.NestedTensor((torch.zeros(1, 128, 2, 2, 2), torch.zeros(1, 8, 126, 16)))

    native = sample(model, latent(), positive, negative, cfg=1.0, steps=1)
    out = sample(tpu(pack, model), latent(), positive, negative, cfg=1.0, steps=1)
    (video, audio), (video_native, audio_native) = out.unbind(), native.unbind()
    assert relative(video, video_native) < TOL
    assert relative(audio, audio_native) < 5e-6
