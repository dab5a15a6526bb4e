"""LTX-2 from ComfyUI's single files: the tiny diffusers model exported to the all-in-one checkpoint, the Gemma 3
text-encoder file and the latent upscaler gives the same frames and waveform as its folder; damaged files and
files of the wrong kind are refused, naming the file, before anything compiles."""

from __future__ import annotations

import pytest
import torch

from tpu_runtime.engine.stages import SampleSettings
from tpu_runtime.errors import InputError, ModelFolderError
from tpu_runtime.families import registry
from tpu_runtime.families.ltx2.tiny import export_comfy_files

SIZE = dict(height=64, width=96, num_frames=9)


@pytest.fixture(scope="module")
def ltx2_files(tiny_ltx2, tmp_path_factory):
    folder = tiny_ltx2["2.0"]
    files = export_comfy_files(folder, tmp_path_factory.mktemp("ltx2_files"))
    return folder, dict(files, tokenizer=folder / "tokenizer")


def _generate(model):
    embeds = model.encode("a red ball bounces", "blurry")
    s = SampleSettings(seed=3, steps=2, guidance=3.0, stg_blocks=(1,), **SIZE)
    latents = model.sample(embeds, s)
    return model.decode(latents), model.decode_audio(latents), model.upsample(latents).latents


def test_files_give_the_folders_frames_and_sound(ltx2_files):
    folder, files = ltx2_files
    from_files = registry.open_model(files=files, dtype="float32")
    assert from_files.FAMILY == "ltx2" and from_files.generation == "2.0"
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


def test_wrong_and_damaged_files_are_refused(ltx2_files, tmp_path):
    folder, files = ltx2_files
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
    # a Wan transformer file where the checkpoint goes
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelFolderError, match="junk.safetensors"):
        LTX2Family(files=dict(files, checkpoint=junk))
