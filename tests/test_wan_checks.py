"""Wan: compile once (N steps, both experts, new seeds and prompts), and bad input refused before any compile
with a message naming the input and the fix."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import WAN_SIZE, subprocess_env

from tpu_runtime.errors import InputError, ModelFolderError
from tpu_runtime.engine.stages import SampleSettings
from tpu_runtime.tools.generate import GenerateRequest, generate, open_model
from tpu_runtime.engine.runtime import compile_stats
from comfy_files import export_wan_files as export_comfy_files
from tpu_runtime.families.wan.model import WanFamily

H, W, F = WAN_SIZE


def _cli(model, out, cache_dir, steps, **env):
    cmd = [sys.executable, "-m", "tpu_runtime", "generate", "--model", str(model), "--prompt", "a cat",
           "--height", "32", "--width", "64", "--frames", "5", "--steps", str(steps), "--dtype", "float32",
           "--output-dir", str(out), "--cache-dir", str(cache_dir)]
    proc = subprocess.run(cmd, env=subprocess_env(**env), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "generation_config.json").read_text())["timings"]["all"]


def test_two_expert_sampler_compiles_the_same_for_3_and_6_steps(tiny_wan, tmp_path):
    """A fresh cache compiles everything for 3 steps; a second process with 6 steps (the experts switch at another
    step) on that cache needs exactly those programs, every one loaded from the persistent XLA cache, none compiled
    (saved programs off: the XLA cache alone; test_compiles_and_cache.py has them on)."""
    off = {"TPU_VIDEO_PROGRAM_CACHE_GB": 0}
    three = _cli(tiny_wan["2.2-A14B"], tmp_path / "three", tmp_path / "cache", 3, **off)
    six = _cli(tiny_wan["2.2-A14B"], tmp_path / "six", tmp_path / "cache", 6, **off)
    assert three["persistent_cache_hits_total"] == 0 and three["xla_compiles"]["sample"] >= 1  # a fresh cache
    assert six["xla_compiles_total"] == 0
    assert six["persistent_cache_hits"]["sample"] == three["xla_compiles"]["sample"]
    assert six["persistent_cache_hits_total"] == three["xla_compiles_total"]


def test_both_experts_share_one_step_program_and_new_seeds_compile_nothing(tiny_wan, tmp_path):
    family = WanFamily(tiny_wan["2.2-A14B"], dtype="float32")
    emb = family.encode("a cat")
    before = family.runtime.program_count
    family.sample(emb, SampleSettings(48, 48, 5, steps=4, guidance=4.0, guidance_2=3.0, seed=1))
    assert family.runtime.program_count == before + 1, "the two experts must share the step program"
    stats = compile_stats()
    emb2 = family.encode("a dog on the moon", "blurry")
    family.sample(emb2, SampleSettings(48, 48, 5, steps=6, guidance=5.0, guidance_2=2.0, seed=9,
                                       scheduler="unipc", shift=8.0))
    assert compile_stats().since(stats).backend_compiles == 0
    assert family.runtime.program_count == before + 1


def test_new_seed_prompt_and_scheduler_settings_compile_nothing(tiny_wan, tmp_path):
    family = WanFamily(tiny_wan["2.1"], dtype="float32")
    base = dict(model=None, height=H, width=W, frames=F, steps=2)
    generate(GenerateRequest(output_dir=str(tmp_path / "a"), prompt="a cat", seed=1, **base), family=family)
    before = compile_stats()
    generate(GenerateRequest(output_dir=str(tmp_path / "b"), prompt="a dog", negative_prompt="ugly", seed=5,
                             shift=6.0, **{**base, "steps": 5}), family=family)
    assert compile_stats().since(before).backend_compiles == 0


# --- validation ------------------------------------------------------------------------------------------------
def _refused(fn, *needles):
    before = compile_stats()
    with pytest.raises(InputError) as err:
        fn()
    assert compile_stats().since(before).backend_compiles == 0, "refused only after compiling"
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"
    return str(err.value)


@pytest.fixture(scope="module")
def wan21(tiny_wan):
    return WanFamily(tiny_wan["2.1"], dtype="float32")


@pytest.fixture(scope="module")
def embeds(wan21):
    return wan21.encode("a cat")


def test_sizes_and_frames_are_checked(wan21, embeds, tiny_wan):
    _refused(lambda: wan21.validate(64, 64, 10), "frames=10", "4*N+1", "nearest: 9 or 13")
    _refused(lambda: wan21.validate(72, 64, 9), "height=72", "multiple of 16")
    ti2v = WanFamily(tiny_wan["2.2-TI2V-5B"], dtype="float32")
    _refused(lambda: ti2v.validate(48, 64, 9), "height=48", "multiple of 32", "TI2V-5B")
    _refused(lambda: wan21.sample(embeds, SampleSettings(64, 64, 8, steps=2)), "frames=8")


def test_options_of_another_model_are_refused(wan21, embeds, tiny_models):
    s = dict(height=64, width=64, num_frames=9, steps=2)
    _refused(lambda: wan21.sample(embeds, SampleSettings(**s, guidance_2=3.0)), "guidance_2", "two-expert")
    _refused(lambda: wan21.sample(embeds, SampleSettings(**s, boundary=0.9)), "boundary", "two-expert")
    _refused(lambda: wan21.sample(embeds, SampleSettings(**s, scheduler="ddim")), "ddim", "unipc")
    _refused(lambda: wan21.sample(embeds, SampleSettings(**s, dynamic_cfg=True)), "dynamic_cfg")
    _refused(lambda: wan21.sample(embeds, SampleSettings(**s, shift=0.0)), "shift=0.0")
    _refused(lambda: wan21.decode(None, tiling=True), "tiling")
    from tpu_runtime.families.cogvideox.model import CogVideoXFamily

    cog = CogVideoXFamily(tiny_models["2b"], dtype="float32")
    cog_embeds = cog.encode("a cat")
    _refused(lambda: cog.sample(cog_embeds, SampleSettings(64, 96, 9, steps=2, shift=5.0)), "shift", "Wan")
    _refused(lambda: cog.sample(cog_embeds, SampleSettings(64, 96, 9, steps=2, scheduler="unipc")), "unipc", "ddim")


def test_two_expert_boundary_is_checked(tiny_wan):
    family = WanFamily(tiny_wan["2.2-A14B"], dtype="float32")
    emb = family.encode("a cat")
    _refused(lambda: family.sample(emb, SampleSettings(64, 64, 9, steps=2, boundary=1.5)), "boundary=1.5")


def test_embeddings_of_another_model_are_refused(wan21, tiny_wan):
    other = WanFamily(tiny_wan["2.2-TI2V-5B"], dtype="float32")
    _refused(lambda: other.sample(wan21.encode("a cat"), SampleSettings(64, 64, 9, steps=2)), "different model")


def test_folders_that_are_not_wan_or_incomplete(tiny_wan, tiny_models, tmp_path):
    _refused(lambda: WanFamily(tiny_models["2b"]), "CogVideoX", "not Wan")
    _refused(lambda: WanFamily(tmp_path / "nowhere"), "does not exist")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_wan["2.1"], broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(ModelFolderError):  # the error type the nodes and the CLI report
        WanFamily(broken)
    _refused(lambda: WanFamily(broken), "incomplete", "vae/ (folder missing)")
    vace = tmp_path / "vace"
    shutil.copytree(tiny_wan["2.1"], vace)
    index = json.loads((vace / "model_index.json").read_text())
    (vace / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanVACEPipeline"}))
    _refused(lambda: WanFamily(vace), "WanVACEPipeline", "WanImageToVideoPipeline")
    # An image-to-video folder whose transformer attends to CLIP features but which lacks its image encoder.
    i2v = tmp_path / "i2v_without_encoder"
    shutil.copytree(tiny_wan["2.1"], i2v)
    config = json.loads((i2v / "transformer" / "config.json").read_text())
    config.update(in_channels=36, image_dim=64, added_kv_proj_dim=256)
    (i2v / "transformer" / "config.json").write_text(json.dumps(config))
    (i2v / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanImageToVideoPipeline"}))
    _refused(lambda: WanFamily(i2v), "no image_encoder", "image_processor")


def test_single_files_are_checked(tiny_wan, tmp_path):
    files = export_comfy_files(tiny_wan["2.1"], tmp_path / "a", "fp16")
    ti2v = export_comfy_files(tiny_wan["2.2-TI2V-5B"], tmp_path / "b", "fp16")
    base = dict(output_dir=str(tmp_path / "out"), prompt="a cat")

    def open_files(**kw):
        return lambda: open_model(GenerateRequest(model=None, **base, files={k: str(v) for k, v in kw.items()}))

    _refused(open_files(transformer=files["vae"], text_encoder=files["text_encoder"], vae=files["vae"]),
             "not a Wan diffusion model", "diffusion_models")
    _refused(open_files(transformer=files["transformer"], text_encoder=files["vae"], vae=files["vae"]),
             "not a umT5 text encoder")
    _refused(open_files(transformer=files["transformer"], text_encoder=files["text_encoder"],
                        vae=files["transformer"]), "not a Wan VAE")
    _refused(open_files(transformer=ti2v["transformer"], text_encoder=files["text_encoder"], vae=files["vae"]),
             "48", "wan2.2_vae")
    _refused(open_files(transformer=files["transformer"], vae=files["vae"]), "--text-encoder")
    _refused(open_files(transformer=tmp_path / "missing.safetensors", text_encoder=files["text_encoder"],
                        vae=files["vae"]), "does not exist")
    _refused(lambda: open_model(GenerateRequest(model=str(tiny_wan["2.1"]), files={"transformer": str(files["transformer"])},
                                                **base)), "not both")
    # A diffusers-format transformer file is recognised and pointed to the folder route.
    diffusers_file = tiny_wan["2.1"] / "transformer" / "diffusion_pytorch_model.safetensors"
    _refused(open_files(transformer=diffusers_file, text_encoder=files["text_encoder"], vae=files["vae"]),
             "diffusers-format", "--model")


def test_fp8_e4m3fn_without_scales_loads_dequantised(tmp_path):
    """ComfyUI's plain fp8_e4m3fn files (no scales) are upcast to the run dtype on load."""
    from safetensors.torch import save_file

    from tpu_runtime.engine.weights import TensorSource

    w = torch.randn(8, 8) * 0.1
    save_file({"a.weight": w.to(torch.float8_e4m3fn), "b.weight": w.to(torch.float16)}, str(tmp_path / "f.st"))
    source = TensorSource([tmp_path / "f.st"])
    assert source.get("a.weight", torch.float32).dtype == torch.float32
    assert torch.equal(source.get("a.weight", torch.float32), w.to(torch.float8_e4m3fn).float())
    assert torch.equal(source.get("b.weight", torch.bfloat16), w.to(torch.float16).to(torch.bfloat16))


def test_vae_names_agree_with_diffusers_converter_on_the_released_2_1_layout():
    """Our Wan VAE key map (general over stage and block counts) gives the same names as diffusers'
    convert_wan_vae_to_diffusers (written for the released Wan 2.1 VAE) on that VAE's full key set."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from comfy_files import wan_vae_to_original
    with torch.device("meta"):
        vae = AutoencoderKLWan()  # the released 2.1 configuration
    ours_original = {wan_vae_to_original(k, 2, False): k for k in vae.state_dict()}
    theirs = convert_wan_vae_to_diffusers({k: k for k in ours_original})
    assert {new: old for new, old in theirs.items()} == {v: k for k, v in ours_original.items()}


def test_vae_config_is_read_from_the_file(tiny_wan, tmp_path):
    from tpu_runtime.families.wan.files import vae_names

    for generation in ("2.1", "2.2-TI2V-5B"):
        files = export_comfy_files(tiny_wan[generation], tmp_path / generation, "fp16")
        config, _ = vae_names(files["vae"])
        saved = json.loads((tiny_wan[generation] / "vae" / "config.json").read_text())
        for key in ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "temperal_downsample", "is_residual",
                    "in_channels", "out_channels", "patch_size", "scale_factor_spatial", "latents_mean"):
            assert config[key] == saved[key], key
