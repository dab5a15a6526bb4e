"""LTX-2 from ComfyUI's single files: the tiny diffusers model exported to the all-in-one checkpoint, the Gemma 3
text-encoder file and the latent upscaler gives the same frames and waveform as its folder; damaged files and
files of the wrong kind are refused, naming the file, before anything compiles."""

from __future__ import annotations

import pytest
import torch

from tpu_runtime.engine.stages import SampleSettings
from tpu_runtime.errors import InputError, ModelFolderError
from tpu_runtime.families import registry
from comfy_files import export_ltx2_files as export_comfy_files

SIZE = dict(height=64, width=96, num_frames=9)


@pytest.fixture(scope="module", params=["2.0", "2.3"])
def ltx2_files(request, tiny_ltx2, tmp_path_factory):
    folder = tiny_ltx2[request.param]
    files = export_comfy_files(folder, tmp_path_factory.mktemp("ltx2_files"))
    return folder, files


def _generate(model):
    embeds = model.encode("a red ball bounces", "blurry")
    s = SampleSettings(seed=3, steps=2, guidance=3.0, stg_blocks=(1,), **SIZE)
    latents = model.sample(embeds, s)
    return model.decode(latents), model.decode_audio(latents), model.upsample(latents).latents


def test_files_give_the_folders_frames_and_sound(ltx2_files):
    folder, files = ltx2_files
    from_files = registry.open_model(files=files, dtype="float32")
    assert from_files.FAMILY == "ltx2"
    assert from_files.generation == registry.open_model(str(folder)).generation
    for component in ("transformer", "connectors", "vae", "audio_vae", "vocoder"):
        from_folder_config = registry.open_model(str(folder)).configs[component]
        for k, v in from_files.configs[component].items():
            if k in from_folder_config:
                assert list(v) == list(from_folder_config[k]) if isinstance(v, (list, tuple)) \
                    else v == from_folder_config[k], (component, k)
    a = _generate(from_files)
    b = _generate(registry.open_model(str(folder), dtype="float32"))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_tokenizer_from_the_file_or_a_folder(ltx2_files, tmp_path):
    """ComfyUI's Gemma file carries its SentencePiece model: it tokenizes as the folder's tokenizer; a file
    without it takes a tokenizer folder, and without either it is refused, naming the file."""
    from tpu_runtime.families.ltx2.model import LTX2Family

    folder, files = ltx2_files
    texts = ["a red ball bounces", "", "A Red BALL, 42!  héllo"]
    want = LTX2Family(folder).tokenize(texts)
    for got in (LTX2Family(files=files).tokenize(texts),
                LTX2Family(files=dict(files, tokenizer=folder / "tokenizer")).tokenize(texts)):
        for x, y in zip(got, want):
            assert torch.equal(x, y)
    bare = export_comfy_files(folder, tmp_path / "bare", tokenizer=False)
    with pytest.raises(InputError, match="gemma_tiny.*spiece_model"):
        LTX2Family(files=bare)
    assert torch.equal(LTX2Family(files=dict(bare, tokenizer=folder / "tokenizer")).tokenize(texts)[0], want[0])


def test_wrong_and_damaged_files_are_refused(ltx2_files, tmp_path):
    _, files = ltx2_files
    # the Gemma file given as the checkpoint: not recognised as LTX-2 and not loaded
    with pytest.raises((InputError, ModelFolderError), match="gemma_tiny"):
        registry.open_model(files=dict(files, checkpoint=files["text_encoder"]))
    # the checkpoint given as the text encoder
    with pytest.raises(ModelFolderError, match="not a Gemma 3 text encoder"):
        registry.open_model(files=dict(files, text_encoder=files["checkpoint"]))
    # a truncated checkpoint (a download cut short)
    cut = tmp_path / "cut.safetensors"
    data = files["checkpoint"].read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    from tpu_runtime.families.ltx2.model import LTX2Family

    with pytest.raises(ModelFolderError, match="cut.safetensors"):
        LTX2Family(files=dict(files, checkpoint=cut))
    cut_text = tmp_path / "cut_gemma.safetensors"
    data = files["text_encoder"].read_bytes()
    cut_text.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFolderError, match="cut_gemma.safetensors"):
        LTX2Family(files=dict(files, text_encoder=cut_text))
    # a file of another model (a Wan transformer's names) where the checkpoint goes
    from safetensors.torch import save_file

    wan = tmp_path / "wan2.1_t2v.safetensors"
    save_file({"model.diffusion_model.head.modulation": torch.zeros(1, 2, 4),
               "model.diffusion_model.patch_embedding.weight": torch.zeros(4, 16, 1, 2, 2)}, str(wan))
    with pytest.raises(ModelFolderError, match="wan2.1_t2v.safetensors is not an LTX-2 checkpoint"):
        LTX2Family(files=dict(files, checkpoint=wan))
    # a file that is not safetensors at all
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelFolderError, match="junk.safetensors"):
        LTX2Family(files=dict(files, checkpoint=junk))


def test_files_loader_node(ltx2_files, tmp_path, monkeypatch):
    """The LTX-2 ModelFilesLoader node (made from the spec's file roles) lists ComfyUI's folders and loads the
    files as the family does."""
    import shutil

    from nodes import NODE_CLASS_MAPPINGS

    _, files = ltx2_files
    root = tmp_path / "models"
    for role, kind in (("checkpoint", "checkpoints"), ("text_encoder", "text_encoders"),
                       ("latent_upscaler", "latent_upscale_models")):
        (root / kind).mkdir(parents=True)
        shutil.copy(files[role], root / kind / files[role].name)
    monkeypatch.setenv("TPU_VIDEO_MODEL_DIRS", str(root))
    node = NODE_CLASS_MAPPINGS["TPULTX2ModelFilesLoader"]
    inputs = node.INPUT_TYPES()
    assert inputs["required"]["checkpoint"][0] == [files["checkpoint"].name]
    assert inputs["required"]["text_encoder"][0] == [files["text_encoder"].name]
    assert files["latent_upscaler"].name in inputs["optional"]["latent_upscaler"][0]
    (model,) = node().load(files["checkpoint"].name, files["text_encoder"].name, "float32",
                           latent_upscaler=files["latent_upscaler"].name, config=str(files["config"]))
    assert model.FAMILY == "ltx2" and model.upsampler_path.name == files["latent_upscaler"].name
    assert model.configs == registry.open_model(files=files, dtype="float32").configs


def test_fp8_files_give_the_frames_and_sound_of_the_weights_they_hold(tmp_path_factory):
    """LTX-2's fp8 files (the transformer blocks' and Gemma's layers' matrices in float8_e4m3fn, ComfyUI's
    per-layer format: a ``weight_scale`` and ``input_scale`` per layer, the format as ``.comfy_quant`` tensors in
    the checkpoint and as ``_quantization_metadata`` in the Gemma file) are dequantised to weight x scale: the
    frames, waveform and upsampled latents equal the folder whose matrices are those fp8 values. The scales are not
    1, so a loader that dropped them could not pass."""
    from tpu_runtime.engine.weights import read_header
    from tpu_runtime.families.ltx2.tiny import build_tiny_ltx2

    folder = build_tiny_ltx2(tmp_path_factory.mktemp("ltx2_fp8") / "ltx2", "2.0", seed=9, fp8=True)
    files = export_comfy_files(folder, tmp_path_factory.mktemp("ltx2_fp8_files"), dtype="fp8")
    header = read_header(files["checkpoint"])
    block = "model.diffusion_model.transformer_blocks.0.attn1.to_q"
    assert header[f"{block}.weight"][1] == "F8_E4M3" and f"{block}.comfy_quant" in header
    from safetensors import safe_open

    with safe_open(str(files["checkpoint"]), framework="pt") as f:
        scales = {float(f.get_tensor(k)) for k in f.keys() if k.endswith(".weight_scale")}  # noqa: SIM118
    assert len(scales) > 1 and 1.0 not in scales
    with safe_open(str(files["text_encoder"]), framework="pt") as f:
        assert "_quantization_metadata" in f.metadata()
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "F8_E4M3"
    a = _generate(registry.open_model(files=files, dtype="float32"))
    b = _generate(registry.open_model(str(folder), dtype="float32"))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_fp4_mixed_gemma_encodes_as_the_weights_it_holds(ltx2_files, tmp_path):
    """ComfyUI's "fp4_mixed" Gemma file (the one its LTX-2.3 templates load): the feed-forward layers NVFP4, the
    attention fp8, the rest as it was, the layers' formats in ``_quantization_metadata``, encoded by ComfyUI's own
    quantiser. The prompt streams equal those of the folder whose Gemma holds ComfyUI's dequantisation of the same
    layers; they differ from the unquantised model's, so the quantisation is not ignored."""
    import json
    import shutil

    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4, quantize_nvfp4
    from safetensors.torch import load_file, save_file

    from tpu_runtime.engine.tiny import fp8_quantise
    from tpu_runtime.families.ltx2.model import LTX2Family

    folder, files = ltx2_files
    text = load_file(str(files["text_encoder"]))
    mixed, held, layers = {}, {}, {}
    for key, value in text.items():
        layer = key[: -len(".weight")]
        if key.startswith("model.layers.") and ".mlp." in key and key.endswith(".weight"):
            scale = (value.abs().max() / (6.0 * 448.0)).float()
            packed, blocks = quantize_nvfp4(value.float(), scale)
            mixed.update({key: packed, f"{layer}.weight_scale": blocks, f"{layer}.weight_scale_2": scale})
            held[key] = dequantize_nvfp4(packed, scale, blocks, torch.float32)
            layers[layer] = {"format": "nvfp4"}
        elif key.startswith("model.layers.") and ".self_attn." in key and key.endswith("_proj.weight"):
            mixed[key], mixed[f"{layer}.weight_scale"] = fp8_quantise(value)
            held[key] = mixed[key].float() * mixed[f"{layer}.weight_scale"]
            layers[layer] = {"format": "float8_e4m3fn"}
        else:
            mixed[key] = value
    assert {c["format"] for c in layers.values()} == {"nvfp4", "float8_e4m3fn"}
    fp4 = tmp_path / "gemma_3_12B_it_fp4_mixed.safetensors"
    from safetensors import safe_open

    with safe_open(str(files["text_encoder"]), framework="pt") as f:
        metadata = dict(f.metadata() or {})
    save_file(mixed, str(fp4), metadata={**metadata, "_quantization_metadata": json.dumps({"layers": layers})})
    reference = tmp_path / "reference"
    shutil.copytree(folder, reference)
    weights = next((reference / "text_encoder").glob("*.safetensors"))
    state = load_file(str(weights))
    for key, value in held.items():
        name = "language_model.model." + key[len("model."):]
        assert state[name].shape == value.shape
        state[name] = value
    save_file(state, str(weights), metadata={"format": "pt"})
    ours = LTX2Family(files=dict(files, text_encoder=fp4), dtype="float32").encode("a red ball bounces", "blurry")
    want = LTX2Family(reference, dtype="float32").encode("a red ball bounces", "blurry")
    plain = LTX2Family(folder, dtype="float32").encode("a red ball bounces", "blurry")
    for name in ("prompt_embeds", "negative_prompt_embeds", "audio_prompt_embeds", "negative_audio_prompt_embeds"):
        torch.testing.assert_close(getattr(ours, name), getattr(want, name), atol=1e-5, rtol=1e-5)
    assert (ours.prompt_embeds - plain.prompt_embeds).abs().max() > 1e-3


def test_unknown_quantisations_are_refused_when_opened(ltx2_files, tmp_path):
    """A format this pack does not dequantise in ``_quantization_metadata`` (ComfyUI's mxfp8, int8 block-wise) or
    packed integer weights without NVFP4's scales are refused when the model is opened, naming the file, the
    format and the fix."""
    import json

    from safetensors.torch import load_file, save_file

    _, files = ltx2_files
    text = load_file(str(files["text_encoder"]))
    int8 = tmp_path / "gemma_int8.safetensors"
    save_file(text, str(int8), metadata={"_quantization_metadata": json.dumps(
        {"layers": {"model.layers.0.self_attn.q_proj": {"format": "int8_blockwise", "group_size": 128}}})})
    with pytest.raises(ModelFolderError, match="gemma_int8.safetensors is quantised as int8_blockwise.*bf16"):
        registry.open_model(files=dict(files, text_encoder=int8))
    state = load_file(str(files["checkpoint"]))
    layer = "model.diffusion_model.transformer_blocks.0.attn1.to_q"
    state[f"{layer}.weight"] = torch.zeros_like(state[f"{layer}.weight"], dtype=torch.int8)
    state[f"{layer}.weight_scale"] = torch.tensor(0.01)
    packed = tmp_path / "ltx-2-19b-dev-int8.safetensors"
    save_file(state, str(packed))
    with pytest.raises(ModelFolderError, match="ltx-2-19b-dev-int8.safetensors is quantised as packed integers"):
        registry.open_model(files=dict(files, checkpoint=packed))
