"""MiniMax H3 (ComfyUI 0.33, the most used local video templates) through the native bridge: its diffusion model, its
Qwen3-VL text encoder with images, its video VAE (which tiles and chunks the video itself) and its audio VAE, each a
tiny random-weight file in the layout its templates' files use (int8 ConvRot diffusion model and video decoder,
nvfp4 text encoder with AWQ smoothing scales), read by ComfyUI's own loaders, equal to ComfyUI's native CPU run
(float32, 1e-4 relative), with the programs counted.

MiniMax H3's forward computes from host values at every call (the per-token timesteps, the prompt's modality tags, the
condition rows' noise from the run's seed): the bridge computes them on the host as ComfyUI does and compiles the
rest once per layout (``bridge/minimax.py``): every step, a new seed and a new prompt of the same length reuse it."""

import pytest
import torch
from comfy_native import comfyui_session, load, load_pack, relative, sample

TOL = 1e-4
pytestmark = pytest.mark.comfy_versions("0.33")
TEXT = 64  # the tiny Qwen3-VL's width (the DiT's condition projection reads it)


@pytest.fixture(scope="module", params=["0.33.0"])
def pack(request):
    with comfyui_session(request.param):
        yield load_pack()


@pytest.fixture(scope="module")
def files(pack, tmp_path_factory):
    """The DiT in both of its forms (a time embedder; the precomputed adaLN curve of the pruned files) in float32, the
    first also with its blocks int8 ConvRot as the templates' files have them, and a LoRA of its blocks."""
    from safetensors.torch import save_file

    from tpu_runtime.bridge.tiny import minimax_h3_lora, minimax_h3_state, save_quantized, tiny_minimax_h3

    base = tmp_path_factory.mktemp("minimax_h3")
    out = {}
    for form, curve in (("embedder", False), ("curve", True)):
        module = tiny_minimax_h3(curve=curve, text_dim=TEXT)
        state = minimax_h3_state(module, seed=3 + curve)
        out[form] = base / f"minimax_h3_{form}.safetensors"
        save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, str(out[form]))
        if not curve:
            def chosen(key):
                return ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 16}) if key.startswith(
                    "blocks.") and (".attn." in key or ".mlp." in key) else None

            out["int8"] = save_quantized(state, base / "minimax_h3_int8_convrot.safetensors", chosen,
                                         prefix="model.diffusion_model.")
            save_file(minimax_h3_lora(module, seed=9), str(base / "lora.safetensors"))
            out["lora"] = base / "lora.safetensors"
    return out


def tpu(pack, model):
    return pack.NODE_CLASS_MAPPINGS["TPUDiffusionModel"]().apply(model)[0]


def forward(model, key="diffusion_model._forward"):
    return model.object_patches[key].bridged


def av_latent(frames=3, size=4, audio=6):
    import comfy.nested_tensor

    return comfy.nested_tensor.NestedTensor((torch.zeros(1, 24, frames, size, size), torch.zeros(1, 32, 2, audio)))


def conds(seed, length=9, **extra):
    """Qwen3-VL states with modality tags (a vision block in the middle of the prompt: tags 0), positive and
    negative (MiniMax H3 runs cond and uncond as separate calls: batch 1)."""
    g = torch.Generator().manual_seed(seed)
    tags = torch.ones(length, dtype=torch.long)
    tags[2:5] = 0
    return ([[torch.randn(1, length, TEXT, generator=g), {"minimax_token_tags": tags, **extra}]],
            [[torch.randn(1, length, TEXT, generator=g), {"minimax_token_tags": torch.ones(length, dtype=torch.long),
                                                          **extra}]])


def streams_close(out, native):
    for a, b in zip(out.unbind(), native.unbind()):
        assert a.shape == b.shape and relative(a, b) < TOL, (a.shape, relative(a, b))


def conditions(seed: int) -> dict:
    """The three kinds of run MiniMax H3's templates make: text only; first and last frames (keyframes, the last
    with its audio); reference images and audio (reference to video)."""
    g = torch.Generator().manual_seed(seed)
    keyframes = [{"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 4, 4, generator=g)},
                 {"resolved_frame_index": 8, "latent": torch.randn(1, 24, 1, 4, 4, generator=g),
                  "audio_latent": torch.randn(1, 32, 2, 3, generator=g)}]
    refs = [{"kind": "image", "latent_h": 2, "latent_w": 4, "latent": torch.randn(1, 24, 1, 2, 4, generator=g)},
            {"kind": "audio", "ref_audio_t": 4, "audio_latent": torch.randn(1, 32, 2, 4, generator=g)}]
    return {"t2v": {}, "keyframes": {"minimax_keyframes": keyframes}, "refs": {"minimax_refs": refs}}


@pytest.mark.parametrize("form", ["embedder", "curve"])
def test_the_diffusion_model_equals_native_in_one_program_per_layout(pack, files, form):
    """Text to video, first and last frames, references: each equals the native run, each its own layout (one
    program for all its steps, cond and uncond); a new seed (new condition noise) and a new prompt of the same
    length compile nothing; the int8 weights stay packed on the devices; the token refiner runs as a program of its
    own, once per sampling run's prompts."""
    model = load(files[form])
    assert type(model.model.diffusion_model).__name__ == "MiniMaxH3Model"
    on_tpu = tpu(pack, model)
    bridged = forward(on_tpu)
    for programs, (kind, extra) in enumerate(conditions(seed=1).items(), start=1):
        positive, negative = conds(2, **extra)
        native = sample(model, av_latent(), positive, negative, steps=3, cfg=3.0)
        calls = bridged.stats.calls
        streams_close(sample(on_tpu, av_latent(), positive, negative, steps=3, cfg=3.0), native)
        assert bridged.stats.programs == programs and bridged.stats.calls - calls == 6, kind
        positive, negative = conds(5, **extra)  # another prompt of the same length, another seed
        streams_close(sample(on_tpu, av_latent(), positive, negative, steps=3, cfg=3.0, seed=77),
                      sample(model, av_latent(), positive, negative, steps=3, cfg=3.0, seed=77))
        assert bridged.stats.programs == programs, kind
    refiner = forward(on_tpu, "diffusion_model.preprocess_text_embeds")
    assert refiner.stats.programs == 1 and refiner.stats.calls == 12


def test_int8_blocks_stay_packed_and_run_w8a8_as_comfyui_does(pack, files):
    """The templates' int8 ConvRot DiT: its blocks' weights stay int8 on the devices and run W8A8 as ComfyUI's do (each
    layer's input quantized per row, int8 x int8 accumulated in int32); with the node's defaults on this machine's CPU
    backend (ComfyUI's own float32, ``compute_dtype`` auto) the run equals ComfyUI's, next to the 2e-3 by which
    ComfyUI's own result with the same weights dequantized differs."""
    model = load(files["int8"])
    layers = [m for m in model.model.diffusion_model.modules()
              if type(getattr(m, "weight", None)).__name__ == "QuantizedTensor"]
    assert len(layers) == 8
    positive, negative = conds(8)
    native = sample(model, av_latent(), positive, negative, steps=3, cfg=3.0)
    for layer in layers:
        layer.weight_function = [lambda w: w]  # ComfyUI's own on-the-fly patch path dequantizes the weight
    dequantized = sample(model, av_latent(), positive, negative, steps=3, cfg=3.0)
    for layer in layers:
        layer.weight_function = []
    on_tpu = tpu(pack, model)
    out = sample(on_tpu, av_latent(), positive, negative, steps=3, cfg=3.0)
    streams_close(out, native)
    assert all(relative(c, b) > 1e-3 for c, b in zip(dequantized.unbind(), native.unbind()))  # W8A8 on both sides
    placed = forward(on_tpu).quantized
    assert len(placed) == 8 and all(spec.layout == "TensorWiseINT8Layout" for spec in placed.values())


def test_masked_rows_run_at_their_own_strength(pack, files):
    """A noise mask (kept first frame, part of the audio at 0.3): ComfyUI gives masked rows their own timesteps,
    several levels in one segment; equal to native, one program for the run."""
    import comfy.nested_tensor
    import comfy.sample

    model = load(files["embedder"])
    g = torch.Generator().manual_seed(4)
    latent = comfy.nested_tensor.NestedTensor((torch.randn(1, 24, 3, 4, 4, generator=g),
                                               torch.randn(1, 32, 2, 6, generator=g)))
    video_mask = torch.ones(1, 24, 3, 4, 4)
    video_mask[:, :, 0] = 0.0
    audio_mask = torch.ones(1, 32, 2, 6)
    audio_mask[..., :2] = 0.3
    mask = comfy.nested_tensor.NestedTensor((video_mask, audio_mask))
    positive, negative = conds(6)

    def run(patcher):
        noise = comfy.sample.prepare_noise(latent, 5)
        return comfy.sample.sample(patcher, noise, 3, 3.0, "euler", "simple", positive, negative, latent,
                                   noise_mask=mask, seed=5, disable_pbar=True)

    native = run(model)
    on_tpu = tpu(pack, model)
    streams_close(run(on_tpu), native)
    assert forward(on_tpu).stats.programs == 1


def test_a_lora_before_the_node_reaches_the_devices(pack, files):
    """The templates' turbo LoRA (LoraLoaderModelOnly before the sampler): equal to native at two strengths, on int8
    weights, nothing compiled again for the second strength."""
    import comfy.sd
    import comfy.utils

    model = load(files["embedder"])
    lora = comfy.utils.load_torch_file(str(files["lora"]))
    positive, negative = conds(7)
    programs = None
    for strength in (1.0, 0.5):
        patched, _ = comfy.sd.load_lora_for_models(model, None, lora, strength, 0)
        native = sample(patched, av_latent(), positive, negative, steps=2, cfg=3.0)
        on_tpu = tpu(pack, patched)
        streams_close(sample(on_tpu, av_latent(), positive, negative, steps=2, cfg=3.0), native)
        programs = programs or forward(on_tpu).stats.programs
        assert forward(on_tpu).stats.programs == programs


def test_a_fresh_load_loads_the_saved_program_of_its_layout_only(pack, files, runtime, tmp_path, monkeypatch, caplog):
    """Warm starts (``bridge/saved.py``) of the host-prepared forward: the same file loaded again (a new device copy,
    as a restarted server's) loads the saved core and token refiner, traces and compiles nothing and gives the same
    bits; a run of another layout (first and last frames) is not given the text-to-video program: it is built,
    the log says the call's structure differs, and it equals the native run."""
    import logging

    from tpu_runtime.engine.program_store import ProgramStore
    from tpu_runtime.engine.runtime import compile_stats

    monkeypatch.setattr(runtime, "_saved_store", ProgramStore(tmp_path / "programs", limit_bytes=10 ** 9))
    positive, negative = conds(3)
    cold = sample(tpu(pack, load(files["embedder"])), av_latent(), positive, negative, steps=2, cfg=3.0)
    on_tpu = tpu(pack, load(files["embedder"]))
    before = compile_stats()
    warm = sample(on_tpu, av_latent(), positive, negative, steps=2, cfg=3.0)
    delta = compile_stats().since(before)
    assert (delta.traces, delta.xla_compiles, delta.programs_loaded) == (0, 0, 2)
    assert all(torch.equal(a, b) for a, b in zip(warm.unbind(), cold.unbind()))
    assert forward(on_tpu).stats.programs_loaded == 1
    caplog.set_level(logging.INFO, logger="tpu_runtime")
    positive, negative = conds(3, **conditions(seed=1)["keyframes"])
    before = compile_stats()
    streams_close(sample(on_tpu, av_latent(), positive, negative, steps=2, cfg=3.0),
                  sample(load(files["embedder"]), av_latent(), positive, negative, steps=2, cfg=3.0))
    assert compile_stats().since(before).traces >= 1 and forward(on_tpu).stats.programs_loaded == 1
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("no saved program fits MiniMaxH3")]
    assert said and "program.call" in said[0], said


@pytest.fixture(scope="module")
def te_file(pack, tmp_path_factory):
    from tpu_runtime.bridge.tiny import minimax_h3_reduced, save_minimax_h3_text_encoder

    path = tmp_path_factory.mktemp("minimax_te") / "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
    with minimax_h3_reduced():
        save_minimax_h3_text_encoder(path, seed=3)
    return path


def test_the_text_encoder_equals_native_with_and_without_images(pack, te_file):
    """Qwen3-VL 32B (cut to 50 layers; nvfp4 with AWQ scales, packed on the devices), as Load CLIP (type minimax)
    loads it: a prompt alone, a picture before another prompt (MiniMax H3's image to video: the vision tower,
    DeepStack's features and the multimodal positions), another picture of the same size (nothing compiled again):
    embeddings and the tokens' modality tags equal ComfyUI's own (the tags recorded for each encode, not left from
    the one before). Then a warm start: the file loaded again (a restarted server's new device copies), whose first
    encode has a picture, loads the language model's program (its image mask a constant of it) and the vision
    tower's (its patch grid one) saved above after another prompt's tags were recorded on the model, traces and
    compiles nothing, and gives the same bits and tags."""
    import comfy.sd

    from tpu_runtime.bridge.text import bridged_text_models
    from tpu_runtime.bridge.tiny import minimax_h3_reduced
    from tpu_runtime.engine.runtime import compile_stats

    with minimax_h3_reduced(), torch.inference_mode():
        clip = comfy.sd.load_clip([str(te_file)], clip_type=comfy.sd.CLIPType.MINIMAX)
        on_tpu = pack.NODE_CLASS_MAPPINGS["TPUTextEncoder"]().apply(clip)[0]
        g = torch.Generator().manual_seed(0)
        pictures = [torch.rand(1, 64, 96, 3, generator=g) for _ in range(2)]
        outputs = {}
        for prompt, images in (("a cat playing the piano", []), ("a dog", pictures[:1]), ("a dog", pictures[1:])):
            tokens = clip.tokenize(prompt, images=images)
            native, out = clip.encode_from_tokens_scheduled(tokens), on_tpu.encode_from_tokens_scheduled(tokens)
            assert relative(out[0][0], native[0][0]) < TOL, prompt
            assert torch.equal(out[0][1]["minimax_token_tags"], native[0][1]["minimax_token_tags"]), prompt
            outputs.setdefault((prompt, len(images)), out)  # the first of each kind
        models = bridged_text_models(on_tpu)
        restarted = comfy.sd.load_clip([str(te_file)], clip_type=comfy.sd.CLIPType.MINIMAX)
        again = pack.NODE_CLASS_MAPPINGS["TPUTextEncoder"]().apply(restarted)[0]
        before = compile_stats()
        warm = again.encode_from_tokens_scheduled(restarted.tokenize("a dog", images=pictures[:1]))
        delta = compile_stats().since(before)
    language, vision = models["qwen3vl_32b.transformer.forward"], models["qwen3vl_32b.transformer.visual.forward"]
    assert language.quantized and all(spec.layout == "TensorCoreNVFP4Layout" for spec in language.quantized.values())
    assert language.stats.programs == 2 and vision.stats.programs == 1 and vision.stats.calls == 2
    assert not any(n.startswith("visual.") for n in language.state), "the vision tower's weights are its own program's"
    assert (delta.traces, delta.xla_compiles, delta.programs_loaded) == (0, 0, 2)
    cold = outputs["a dog", 1]
    assert torch.equal(warm[0][0], cold[0][0])
    assert torch.equal(warm[0][1]["minimax_token_tags"], cold[0][1]["minimax_token_tags"])


def test_the_video_and_audio_vaes_equal_native(pack, tmp_path):
    """The video VAE (int8 ConvRot ViT decoder, its own spatial tiles and temporal chunks: the tiles run as programs,
    one per tile shape) decodes and encodes a 22-frame video of two by two tiles as ComfyUI does; the audio VAE
    (a 32 kHz vocoder) decodes and encodes stereo."""
    import comfy.sd
    import comfy.utils
    import nodes

    from tpu_runtime.bridge.tiny import minimax_h3_reduced, save_minimax_h3_audio_vae, save_minimax_h3_video_vae
    from tpu_runtime.bridge.vae import bridged_parts

    with minimax_h3_reduced():
        video_file = save_minimax_h3_video_vae(tmp_path / "minimax_h3_video_vae_int8_convrot.safetensors", 3)
        audio_file = save_minimax_h3_audio_vae(tmp_path / "minimax_h3_audio_vae_fp32.safetensors", 4)
    with minimax_h3_reduced(), torch.inference_mode():  # ComfyUI runs its loaders and nodes in inference mode
        state, metadata = comfy.utils.load_torch_file(str(video_file), return_metadata=True)
        vae = comfy.sd.VAE(sd=state, metadata=metadata)
        audio_vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(audio_file)))
        assert vae.handles_tiling
        on_tpu = pack.NODE_CLASS_MAPPINGS["TPUVAE"]().apply(vae)[0]
        g = torch.Generator().manual_seed(0)
        pixels = torch.rand(22, 80, 80, 3, generator=g)
        native_latents = nodes.VAEEncode().encode(vae, pixels)[0]["samples"]
        assert relative(nodes.VAEEncode().encode(on_tpu, pixels)[0]["samples"], native_latents) < TOL
        native = nodes.VAEDecode().decode(vae, {"samples": native_latents})[0]
        assert relative(nodes.VAEDecode().decode(on_tpu, {"samples": native_latents})[0], native) < TOL
        parts = bridged_parts(on_tpu)
        assert parts["decoder.forward"].quantized, "int8 decoder placed packed"
        assert all(p.stats.calls > p.stats.programs for p in parts.values())  # tiles share programs
        audio_on_tpu = pack.NODE_CLASS_MAPPINGS["TPUVAE"]().apply(audio_vae)[0]
        z = torch.randn(1, 32, 2, 10, generator=g)
        assert relative(audio_on_tpu.decode(z), audio_vae.decode(z)) < TOL
        waveform = (torch.rand(1, 8000, 2, generator=g) * 2 - 1)
        assert relative(audio_on_tpu.encode(waveform), audio_vae.encode(waveform)) < TOL
