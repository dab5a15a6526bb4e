"""`generate` reproduces diffusers' CogVideoXPipeline frames: same folder, prompt and seed, float32, 1e-4."""

import numpy as np
import pytest
import torch
from conftest import NEGATIVE, PROMPT, SIZES
from oracle import diffusers_frames

from tpu_runtime.tools import stage_files
from tpu_runtime.tools.cli import GenerateRequest, generate

TOL = 1e-4


@pytest.mark.parametrize("generation", ["2b", "5b", "1.5"])
@pytest.mark.parametrize("scheduler", ["ddim", "dpm"])
@pytest.mark.parametrize("dynamic_cfg", [False, True])
def test_generate_matches_diffusers(tiny_models, tmp_path, generation, scheduler, dynamic_cfg):
    height, width, frames = SIZES[generation]
    folder = tiny_models[generation]
    req = GenerateRequest(
        model=str(folder), output_dir=str(tmp_path), prompt=PROMPT, negative_prompt=NEGATIVE, height=height,
        width=width, frames=frames, steps=3, guidance=6.0, seed=42, scheduler=scheduler, dynamic_cfg=dynamic_cfg,
        dtype="float32",
    )
    generate(req)
    ours = stage_files.load_frames(tmp_path).numpy()
    ref = diffusers_frames(folder, PROMPT, NEGATIVE, height, width, frames, 3, 6.0, 42, scheduler, dynamic_cfg)
    assert ours.shape == ref.shape == (frames, height, width, 3)
    assert ref.std() > 0.01, "oracle frames are flat: the test would not see a difference"
    assert np.abs(ours - ref).max() < TOL


def test_no_cfg_matches_diffusers(tiny_models, tmp_path):
    """guidance <= 1 turns CFG off (batch 1, no negative prompt), as in diffusers."""
    height, width, frames = SIZES["5b"]
    req = GenerateRequest(model=str(tiny_models["5b"]), output_dir=str(tmp_path), prompt=PROMPT, height=height,
                          width=width, frames=frames, steps=2, guidance=1.0, seed=3, dtype="float32")
    generate(req)
    ours = stage_files.load_frames(tmp_path).numpy()
    ref = diffusers_frames(tiny_models["5b"], PROMPT, "", height, width, frames, 2, 1.0, 3)
    assert np.abs(ours - ref).max() < TOL


def test_seed_changes_video(tiny_models, tmp_path):
    """Different seeds give different videos (the seed really reaches the noise)."""
    height, width, frames = SIZES["2b"]
    outs = []
    for seed in (1, 2):
        out = tmp_path / str(seed)
        generate(GenerateRequest(model=str(tiny_models["2b"]), output_dir=str(out), prompt=PROMPT, height=height,
                                 width=width, frames=frames, steps=2, seed=seed, dtype="float32"))
        outs.append(stage_files.load_frames(out).numpy())
    assert np.abs(outs[0] - outs[1]).max() > 0.01


@pytest.mark.parametrize("group_norm, tiling", [("stock", False), ("stock", True), ("jnp_var", False)])
def test_decode_options_match_diffusers(tiny_models, tmp_path, group_norm, tiling):
    """Both GroupNorm lowerings, and spatial tiling, decode like diffusers (tiling against diffusers' tiling). The
    tiled decode is the slowest compile of this file (about 30 s here); its GroupNorm is the one the untiled
    decode checks, so tiling runs with the stock lowering only."""
    height, width, frames = 64, 96, 9
    generate(GenerateRequest(model=str(tiny_models["2b"]), output_dir=str(tmp_path), prompt=PROMPT, height=height,
                             width=width, frames=frames, steps=2, seed=5, dtype="float32", vae_tiling=tiling,
                             group_norm=group_norm))
    ours = stage_files.load_frames(tmp_path).numpy()
    ref = diffusers_frames(tiny_models["2b"], PROMPT, "", height, width, frames, 2, 6.0, 5, tiling=tiling)
    assert np.abs(ours - ref).max() < TOL


def test_decode_by_latent_batches_matches_diffusers(tiny_models):
    """CogVideoX's default decode (the first two latent batches, then one call per later batch of two with the
    causal caches kept on the devices) gives diffusers' ``vae.decode`` frames, with and without the odd latent
    frame the first batch takes; two programs per size, whatever the frame count."""
    from diffusers import AutoencoderKLCogVideoX

    from tpu_runtime.families.cogvideox.model import CogVideoXFamily
    from tpu_runtime.engine.stages import VideoLatents
    from tpu_runtime.engine.runtime import compile_stats

    family = CogVideoXFamily(tiny_models["2b"], dtype="float32")
    assert family.decode_loop == "batches"
    vae = AutoencoderKLCogVideoX.from_pretrained(tiny_models["2b"] / "vae").float().eval()
    scaling = vae.config.scaling_factor
    # The first two batches in one program (2 + 2 latent frames, or 3 + 2), then two calls of the second program.
    for latent_frames, later in ((8, [4, 6]), (9, [5, 7])):
        z = torch.randn(1, vae.config.latent_channels, latent_frames, 8, 12,
                        generator=torch.Generator().manual_seed(latent_frames))
        # 4T-3 frames from an odd T (the first batch's odd frame stays one frame), 4T from an even T
        frames = 4 * latent_frames - 3 * (latent_frames % 2)
        before = compile_stats()
        ours = family.decode(VideoLatents(z, 64, 96, frames, family.signature)).numpy()
        compiled = compile_stats().since(before).backend_compiles
        with torch.no_grad():
            ref = vae.decode(z / scaling, return_dict=False)[0]
        ref = (ref * 0.5 + 0.5).clamp(0, 1)[0].permute(1, 2, 3, 0).numpy()
        assert ours.shape == ref.shape == (frames, 64, 96, 3)
        assert ref.std() > 0.01
        assert np.abs(ours - ref).max() < 1e-5
        assert family._later_batches(latent_frames) == later
        assert [p.part for p in family.decode_programs(tuple(z.shape))] == ["start", "batch"]
        assert compiled == 2
