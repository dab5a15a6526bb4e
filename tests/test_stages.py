"""Each stage alone, from the saved files, gives the frames of --stage all; stage files refuse a wrong model or
shape; the mp4 plays back with the right frame count and size."""

import json

import numpy as np
import pytest
from conftest import PROMPT, SIZES

from tpu_runtime.tools import stage_files as sf
from tpu_runtime.tools.cli import GenerateRequest, generate
from tpu_runtime.errors import StageFileError
from tpu_runtime.tools.video import read_mp4


def _req(model, out, **kw):
    h, w, f = SIZES["1.5"]
    base = dict(model=str(model), output_dir=str(out), prompt=PROMPT, negative_prompt="ugly", height=h, width=w,
                frames=f, steps=3, seed=11, dtype="float32")
    base.update(kw)
    return GenerateRequest(**base)


def test_stages_alone_equal_stage_all(tiny_models, tmp_path):
    model = tiny_models["1.5"]
    generate(_req(model, tmp_path / "all"))
    staged = tmp_path / "staged"
    for stage in ("encode", "sample", "decode"):
        generate(_req(model, staged, stage=stage, **({"prompt": None} if stage != "encode" else {})))
    whole = sf.load_frames(tmp_path / "all")
    assert np.array_equal(sf.load_frames(staged).numpy(), whole.numpy())
    assert sf.load_latents(staged).latents.shape == (1, 4, 5, 8, 8)  # 17 frames -> 5 latent frames, pad dropped
    config = json.loads((staged / sf.CONFIG_FILE).read_text())
    assert set(config["timings"]) == {"encode", "sample", "decode"} and config["prompt"] == PROMPT

    frames, meta = read_mp4(staged / sf.VIDEO_FILE)
    assert frames.shape == (17, 64, 64, 3)
    assert meta["fps"] == 16  # the model's own: CogVideoX1.5 is made at 16 fps
    # H.264 is lossy; the decoded video still follows the frames closely.
    assert np.abs(frames.astype(np.float32) / 255 - whole.numpy()).mean() < 0.08


def test_sample_stage_needs_stage1_file(tiny_models, tmp_path):
    with pytest.raises(StageFileError, match="stage1_embeddings.safetensors not found.*--stage encode"):
        generate(_req(tiny_models["2b"], tmp_path, stage="sample", height=64, width=96, frames=9))


def test_stage_files_from_another_model_are_refused(tiny_models, tmp_path):
    generate(_req(tiny_models["5b"], tmp_path, stage="encode", height=64, width=96, frames=9))
    with pytest.raises(StageFileError, match="different model"):
        generate(_req(tiny_models["2b"], tmp_path, stage="sample", height=64, width=96, frames=9))
    generate(_req(tiny_models["5b"], tmp_path, stage="sample", height=64, width=96, frames=9))
    with pytest.raises(StageFileError, match="different model"):
        generate(_req(tiny_models["2b"], tmp_path, stage="decode"))


def test_decode_refuses_a_different_shape(tiny_models, tmp_path):
    generate(_req(tiny_models["2b"], tmp_path, stage="encode", height=64, width=96, frames=9))
    generate(_req(tiny_models["2b"], tmp_path, stage="sample", height=64, width=96, frames=9))
    with pytest.raises(StageFileError, match="--height 128 differs from the 64"):
        generate(_req(tiny_models["2b"], tmp_path, stage="decode", height=128, width=None, frames=None))


def test_garbage_stage_file_is_refused(tiny_models, tmp_path):
    (tmp_path / sf.LATENTS_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(StageFileError, match="not a readable latents file"):
        generate(_req(tiny_models["2b"], tmp_path, stage="decode", height=None, width=None, frames=None))
