"""Bad input fails before anything compiles, with a message naming the input and the fix."""

import json
import shutil

import pytest

from tpu_runtime.families.cogvideox.model import CogVideoXFamily, SampleSettings, inspect_model_folder
from tpu_runtime.errors import InputError, ModelFolderError
from tpu_runtime.engine.runtime import compile_stats


@pytest.fixture
def no_compiles(runtime):
    before, programs = compile_stats(), runtime.program_count
    yield
    assert compile_stats().since(before).backend_compiles == 0, "a bad input reached the compiler"
    assert runtime.program_count == programs


@pytest.mark.parametrize(
    "generation,size,message",
    [
        ("2b", (64, 64, 10), r"frames=10 must be 8\*N\+1 for CogVideoX-2b \(nearest: 9 or 17; 49 is the native"),
        ("5b", (64, 64, 48), r"frames=48 must be 8\*N\+1 .*nearest: 41 or 49;"),
        ("1.5", (64, 64, 57), r"frames=57 must be 16\*N\+1 for CogVideoX-1.5 \(nearest: 49 or 65; 81 is the native"),
        ("2b", (64, 64, 0), r"frames=0 must be 8\*N\+1 .*\(nearest: 1; 49"),
        ("2b", (100, 64, 9), r"height=100 must be a positive multiple of 16 \(nearest: 96 or 112\)"),
        ("2b", (64, 70, 9), r"width=70 must be a positive multiple of 16 \(nearest: 64 or 80\)"),
        ("2b", (8, 64, 9), r"height=8 must be a positive multiple of 16 \(nearest: 16\)"),
    ],
)
def test_bad_sizes(tiny_models, no_compiles, generation, size, message):
    family = CogVideoXFamily(tiny_models[generation], dtype="float32")
    with pytest.raises(InputError, match=message):
        family.validate(*size)
    emb = None
    with pytest.raises(InputError, match=message):
        family.sample(emb, SampleSettings(*size, steps=2))


def test_1_5_refuses_frames_larger_than_its_positions(tiny_models, no_compiles):
    family = CogVideoXFamily(tiny_models["1.5"], dtype="float32")  # tiny: positions for 64x64
    with pytest.raises(InputError, match="height x width = 64x96 exceeds the 64x64 .* use at most 64x64"):
        family.validate(64, 96, 17)


def test_frame_rules_per_generation(tiny_models):
    family = CogVideoXFamily(tiny_models["1.5"], dtype="float32")
    family.validate(64, 64, 81)
    with pytest.raises(InputError, match=r"16\*N\+1"):
        family.validate(64, 64, 41)  # 8N+1, fine for 2b/5b, not for 1.5
    CogVideoXFamily(tiny_models["5b"], dtype="float32").validate(480, 720, 41)


def test_bad_steps_and_empty_prompt(tiny_models, no_compiles):
    family = CogVideoXFamily(tiny_models["2b"], dtype="float32")
    with pytest.raises(InputError, match="prompt is empty"):
        family.encode("  ")


def test_missing_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist: pass the folder that holds model_index.json"):
        inspect_model_folder(tmp_path / "nowhere")


def test_not_a_diffusers_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="model_index.json is missing"):
        inspect_model_folder(tmp_path)


def test_incomplete_folder_lists_missing_files(tiny_models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["2b"], broken)
    shutil.rmtree(broken / "vae")
    for f in (broken / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelFolderError, match=r"missing: transformer/\*.safetensors \(no weights\), vae/ \(folder missing\)"):
        inspect_model_folder(broken)


def test_other_model_families_are_refused(tiny_models, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_models["2b"], other)
    index = json.loads((other / "model_index.json").read_text())
    index["_class_name"] = "WanPipeline"
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match="holds a WanPipeline model, not CogVideoX"):
        CogVideoXFamily(other)
    index["_class_name"] = "CogVideoXVideoToVideoPipeline"  # a CogVideoX pipeline this pack does not run
    (other / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match="this pack runs text-to-video .* and image-to-video"):
        CogVideoXFamily(other)


def test_bad_dtype_and_scheduler(tiny_models, no_compiles):
    with pytest.raises(InputError, match="dtype must be one of"):
        CogVideoXFamily(tiny_models["2b"], dtype="float16")
    family = CogVideoXFamily(tiny_models["2b"], dtype="float32")
    with pytest.raises(InputError, match="scheduler .euler. is not one CogVideoX uses: pick one of"):
        family.scheduler("euler")
