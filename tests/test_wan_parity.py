"""`generate` reproduces diffusers' WanPipeline frames on tiny random-weight Wan models of every generation:
same folder (or the same weights as ComfyUI single files), prompt and seed, float32, within 1e-4."""

import numpy as np
import pytest
import torch
from conftest import NEGATIVE, PROMPT, WAN_SIZE
from oracle import wan_frames

from tpu_runtime.tools import stage_files
from tpu_runtime.tools.generate import GenerateRequest, generate
from comfy_files import export_wan_files as export_comfy_files

TOL = 1e-4
H, W, F = WAN_SIZE


def _ours(tmp_path, model=None, files=None, **kw):
    settings = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, frames=F, steps=3, guidance=5.0,
                    seed=42, dtype="float32")
    settings.update(kw)
    generate(GenerateRequest(model=str(model) if model else None, output_dir=str(tmp_path),
                             files={k: str(v) for k, v in (files or {}).items()}, **settings))
    return stage_files.load_frames(tmp_path).numpy()


def _ref(folder, **kw):
    settings = dict(prompt=PROMPT, negative=NEGATIVE, height=H, width=W, frames=F, steps=3, guidance=5.0, seed=42)
    settings.update(kw)
    return wan_frames(folder, **settings)


def _close(ours, ref):
    assert ours.shape == ref.shape == (F, H, W, 3)
    assert ref.std() > 0.01, "oracle frames are flat: the test would not see a difference"
    assert np.abs(ours - ref).max() < TOL


@pytest.mark.parametrize("generation", ["2.1", "2.2-A14B", "2.2-TI2V-5B"])
@pytest.mark.parametrize("scheduler", ["unipc", "euler"])
def test_generate_matches_diffusers(tiny_wan, tmp_path, generation, scheduler):
    folder = tiny_wan[generation]
    _close(_ours(tmp_path, folder, scheduler=scheduler), _ref(folder, scheduler=scheduler))


def test_no_cfg_and_overridden_shift_match_diffusers(tiny_wan, tmp_path):
    """guidance <= 1 runs one branch (batch 1: the RoPE path without CFG); shift replaces the model's."""
    folder = tiny_wan["2.1"]
    _close(_ours(tmp_path / "nocfg", folder, guidance=1.0, steps=4), _ref(folder, guidance=1.0, steps=4))
    _close(_ours(tmp_path / "shift", folder, shift=7.5, steps=4), _ref(folder, shift=7.5, steps=4))
    _close(_ours(tmp_path / "euler_shift", folder, shift=2.0, scheduler="euler"),
           _ref(folder, shift=2.0, scheduler="euler"))


def test_two_experts_switch_like_diffusers(tiny_wan, tmp_path):
    """Wan 2.2 A14B: transformer above the boundary, transformer_2 below, each with its own guidance."""
    from tpu_runtime.families.wan.model import WanFamily

    folder = tiny_wan["2.2-A14B"]
    family = WanFamily(folder, dtype="float32")
    scheduler = family.scheduler(None, None)
    scheduler.set_timesteps(5)
    boundary = 0.875 * 1000
    above = [float(t) >= boundary for t in scheduler.timesteps]
    assert any(above) and not all(above), "the test's steps must use both experts"
    kw = dict(steps=5, guidance=4.0, guidance_2=2.0)
    ours = _ours(tmp_path / "a", folder, **kw)
    _close(ours, _ref(folder, **kw))
    # guidance_2 really reaches the low-noise steps (seen in the latents; the VAE shrinks differences).
    _ours(tmp_path / "b", folder, steps=5, guidance=4.0, guidance_2=4.0)
    latents = [stage_files.load_latents(tmp_path / d).latents for d in "ab"]
    assert (latents[0] - latents[1]).abs().max() > 1e-2
    assert np.abs(ours - _ours(tmp_path / "b", folder, steps=5, guidance=4.0, guidance_2=4.0)).max() > TOL
    _close(_ours(tmp_path / "c", folder, boundary=0.95, **kw), _ref(folder, boundary=0.95, **kw))


@pytest.mark.parametrize("generation,fmt,prefix", [
    ("2.1", "fp16", "model.diffusion_model."),
    ("2.2-A14B", "fp8_scaled", "model.diffusion_model."),
    ("2.2-TI2V-5B", "bf16", ""),
])
def test_comfyui_single_files_match_diffusers(tiny_wan, tmp_path, generation, fmt, prefix):
    """ComfyUI's single files (original Wan names, fp16 / scaled fp8 / bf16, umT5 with its tokenizer inside, also
    in scaled fp8, the 2.1 or 2.2 VAE) load with the architecture read from the shapes and give diffusers'
    frames."""
    from safetensors import safe_open

    folder = tiny_wan[generation]
    files = export_comfy_files(folder, tmp_path / "files", fmt, prefix=prefix)
    assert (generation == "2.2-A14B") == ("transformer_2" in files)
    if fmt == "fp8_scaled":  # really quantised: fp8 matrices with their scales, in both the transformer and umT5
        for key in ("transformer", "text_encoder"):
            with safe_open(str(files[key]), "pt") as f:
                names = list(f.keys())
                assert "scaled_fp8" in names and any(n.endswith(".scale_weight") for n in names)
                assert any(f.get_tensor(n).dtype == torch.float8_e4m3fn for n in names if n.endswith(".weight"))
    _close(_ours(tmp_path / "out", files=files), _ref(folder))


def test_seed_and_prompt_change_the_video(tiny_wan, tmp_path):
    folder = tiny_wan["2.1"]
    a = _ours(tmp_path / "a", folder, steps=2, seed=1)
    b = _ours(tmp_path / "b", folder, steps=2, seed=2)
    c = _ours(tmp_path / "c", folder, steps=2, seed=1, prompt="a red car drives along a coastal road")
    assert np.abs(a - b).max() > 1e-3 and np.abs(a - c).max() > 1e-3


@pytest.mark.parametrize("generation", ["2.1", "2.2-TI2V-5B"])
def test_bfloat16_runs_close_to_float32(tiny_wan, tmp_path, generation):
    """The TPU dtype traces through every stage (both VAEs) and stays near the float32 frames."""
    folder = tiny_wan[generation]
    bf16 = _ours(tmp_path / "bf16", folder, dtype="bfloat16")
    fp32 = _ours(tmp_path / "fp32", folder)
    assert np.isfinite(bf16).all() and np.abs(bf16 - fp32).max() < 3e-2


@pytest.mark.parametrize("generation", ["2.1", "2.2-TI2V-5B"])
def test_frame_by_frame_vae_decode_matches_diffusers(tiny_wan, generation):
    """The memory-bounded decode (the default on TPU and GPU: the first two latent frames in one program, then
    one call per later frame with the causal caches kept on the devices) gives diffusers' ``vae.decode`` frames,
    for the Wan 2.1 VAE and the 2.2 VAE (patchified, other upsamplers); two programs per size, whatever the frame
    count."""
    from diffusers import AutoencoderKLWan

    from tpu_runtime.engine.stages import VideoLatents
    from tpu_runtime.engine.runtime import compile_stats
    from tpu_runtime.families.wan.model import WanFamily

    family = WanFamily(tiny_wan[generation], dtype="float32")
    family.decode_loop = "frames"
    vae = AutoencoderKLWan.from_pretrained(tiny_wan[generation] / "vae").float().eval()
    mean, std_inv = family._latent_statistics()
    spatial = family.vae_scale_spatial
    for latent_frames in (5, 7):  # 2 frames in the first program, then 3 (5) calls of the second
        z = torch.randn(1, family.vae_config["z_dim"], latent_frames, 64 // spatial, 64 // spatial,
                        generator=torch.Generator().manual_seed(latent_frames))
        frames = (latent_frames - 1) * family.vae_scale_temporal + 1
        before = compile_stats()
        ours = family.decode(VideoLatents(z, 64, 64, frames, family.signature)).numpy()
        compiled = compile_stats().since(before).backend_compiles
        with torch.no_grad():
            ref = vae.decode(z / std_inv + mean, return_dict=False)[0]
        ref = (ref * 0.5 + 0.5).clamp(0, 1)[0].permute(1, 2, 3, 0).numpy()
        assert ours.shape == ref.shape == (frames, 64, 64, 3)
        assert ref.std() > 0.01
        assert np.abs(ours - ref).max() < 1e-5
        assert [p.part for p in family.decode_programs(tuple(z.shape))] == ["start", "frame"]
        assert compiled == 2
