"""Image-to-video: `generate --image` reproduces diffusers' image-to-video pipelines on tiny random-weight models
of every kind (CogVideoX-5b-I2V and 1.5-I2V with DDIM and DPM, Wan 2.1 I2V with CLIP vision, FLF2V's first and
last frame, Wan 2.2 I2V-A14B's two experts, TI2V-5B with an image), from the same folder (or ComfyUI's single
files), image file, prompt and seed, in float32 within 1e-4; the image encode stage compiles once per size; bad
input is refused before anything compiles."""

import numpy as np
import pytest
import torch
from conftest import I2V_SIZES, NEGATIVE, PROMPT
from oracle import cogvideox_i2v_frames, wan_i2v_frames

from tpu_runtime.tools import stage_files
from tpu_runtime.errors import InputError
from tpu_runtime.tools.generate import GenerateRequest, generate
from tpu_runtime.engine.runtime import compile_stats
from comfy_files import export_wan_files as export_comfy_files

TOL = 1e-4


SIZES = I2V_SIZES
WAN = I2V_SIZES["wan-i2v"]


def _ours(out, model=None, files=None, **kw):
    settings = dict(prompt=PROMPT, negative_prompt=NEGATIVE, steps=3, seed=42, dtype="float32")
    settings.update(kw)
    generate(GenerateRequest(model=str(model) if model else None, output_dir=str(out),
                             files={k: str(v) for k, v in (files or {}).items()}, **settings))
    return stage_files.load_frames(out).numpy()


def _latent_change(a, b) -> float:
    return float((stage_files.load_latents(a).latents - stage_files.load_latents(b).latents).abs().max())


def _close(ours, ref, size):
    h, w, f = size
    assert ours.shape == ref.shape == (f, h, w, 3)
    assert ref.std() > 0.01, "oracle frames are flat: the test would not see a difference"
    assert np.abs(ours - ref).max() < TOL


@pytest.mark.parametrize("kind,scheduler", [("cog-5b", "dpm"), ("cog-1.5", "ddim")])
def test_cogvideox_i2v_matches_diffusers(i2v_models, images, tmp_path, kind, scheduler):
    """The image's posterior sample is the first draw from the seed (then the noise, then DPM's per-step noise);
    1.5-I2V adds its ofs embedding, the padding frame and the inverted latent scaling."""
    h, w, f = SIZES[kind]
    folder = i2v_models[kind]
    ours = _ours(tmp_path, folder, image=images["first"], height=h, width=w, frames=f, guidance=6.0,
                 scheduler=scheduler)
    ref = cogvideox_i2v_frames(folder, images["first"], PROMPT, NEGATIVE, h, w, f, steps=3, guidance=6.0, seed=42,
                               scheduler=scheduler)
    _close(ours, ref, (h, w, f))


@pytest.mark.parametrize("kind", ["wan-i2v", "wan-a14b"])
def test_wan_i2v_matches_diffusers(i2v_models, images, tmp_path, kind):
    """Wan 2.1 I2V (VAE condition with its frame mask + CLIP vision features) and Wan 2.2 I2V-A14B (no image
    encoder; the steps cross the 0.9 boundary, so both experts run)."""
    h, w, f = WAN
    folder = i2v_models[kind]
    ours = _ours(tmp_path, folder, image=images["first"], height=h, width=w, frames=f, guidance=5.0, steps=4)
    ref = wan_i2v_frames(folder, images["first"], None, PROMPT, NEGATIVE, h, w, f, steps=4, guidance=5.0, seed=42)
    _close(ours, ref, WAN)
    if kind == "wan-a14b":
        from tpu_runtime.families.wan.model import WanFamily

        family = WanFamily(folder, dtype="float32")
        scheduler = family.scheduler()
        scheduler.set_timesteps(4)
        boundary = family.boundary_ratio * 1000
        assert family.boundary_ratio == 0.9
        t = scheduler.timesteps
        assert (t >= boundary).any() and (t < boundary).any(), t


def test_flf2v_first_and_last_frame_match_diffusers(i2v_models, images, tmp_path):
    h, w, f = WAN
    folder = i2v_models["wan-flf2v"]
    ours = _ours(tmp_path, folder, image=images["first"], last_image=images["last"], height=h, width=w, frames=f,
                 guidance=5.0)
    ref = wan_i2v_frames(folder, images["first"], images["last"], PROMPT, NEGATIVE, h, w, f, steps=3, guidance=5.0,
                         seed=42)
    _close(ours, ref, WAN)
    # The last image steers the video: another last frame gives other latents (the tiny VAE's decode flattens
    # differences, so they are compared before it).
    _ours(tmp_path / "other", folder, image=images["first"], last_image=images["other"], height=h, width=w,
          frames=f, guidance=5.0)
    assert _latent_change(tmp_path, tmp_path / "other") > 1e-2


def test_wan_vae_encode_runs_chunk_by_chunk_equal_to_diffusers(i2v_models, images):
    """The conditioning video is encoded as diffusers' causal loop runs (the first frame, then 4 frames at a time):
    one program for the first two chunks, one called for each later chunk with the caches on the devices, so a
    long video's compile does not grow with its frames. Equal to diffusers' one ``vae.encode`` over every frame,
    with the last picture in the final chunk (FLF2V) and without."""
    from diffusers import AutoencoderKLWan

    from tpu_runtime.engine.images import load_image, video_image
    from tpu_runtime.families.wan.model import WanFamily

    h, w, f = 32, 32, 13  # four latent frames: the start program, then the chunk program twice
    first, last = (video_image(load_image(images[k]), h, w)[:, :, None] for k in ("first", "last"))
    for kind, pictures in (("wan-i2v", [first]), ("wan-flf2v", [first, last])):
        family = WanFamily(i2v_models[kind], dtype="float32")
        assert [p.part for p in family.image_programs(h, w, f, len(pictures))] == ["start", "chunk", "clip"]
        assert [p.part for p in family.image_programs(h, w, 5, len(pictures))] == ["start", "clip"]
        ours = family.encode_image(images["first"], images["last"] if len(pictures) == 2 else None,
                                   height=h, width=w, num_frames=f).latents[:, family.vae_scale_temporal:]
        vae = AutoencoderKLWan.from_pretrained(i2v_models[kind] / "vae").eval()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        gap = torch.zeros(1, 3, f - len(pictures), h, w)
        video = torch.cat([pictures[0], gap, *pictures[1:]], dim=2)
        with torch.no_grad():
            ref = (vae.encode(video).latent_dist.mode() - mean) / std
        assert ours.shape == ref.shape == (1, mean.shape[1], 4, h // 8, w // 8)
        assert ref.std() > 0.01
        assert (ours - ref).abs().max() < 1e-4, (ours - ref).abs().max()


def test_ti2v_with_an_image_matches_diffusers(tiny_wan, images, tmp_path):
    """TI2V-5B holds its first latent frame at the image's, with timestep 0 on those tokens (expand_timesteps);
    without an image it is text-to-video."""
    h, w, f = WAN
    folder = tiny_wan["2.2-TI2V-5B"]
    ours = _ours(tmp_path, folder, image=images["first"], height=h, width=w, frames=f, guidance=5.0)
    ref = wan_i2v_frames(folder, images["first"], None, PROMPT, NEGATIVE, h, w, f, steps=3, guidance=5.0, seed=42)
    _close(ours, ref, WAN)
    _ours(tmp_path / "t2v", folder, height=h, width=w, frames=f, guidance=5.0)
    assert _latent_change(tmp_path, tmp_path / "t2v") > 1e-2


@pytest.mark.parametrize("kind", ["wan-i2v", "wan-flf2v"])
def test_single_files_match_the_folder(i2v_models, images, tmp_path, kind):
    """ComfyUI's files: the I2V / FLF2V diffusion model (its image embedder, image key/value projections and
    FLF2V's image positions in the original names), umT5, the VAE and clip_vision_h (--clip-vision)."""
    h, w, f = WAN
    folder = i2v_models[kind]
    files = export_comfy_files(folder, tmp_path / "files", "fp16")
    assert set(files) == {"transformer", "text_encoder", "vae", "clip_vision"}
    last = dict(last_image=images["last"]) if kind == "wan-flf2v" else {}
    ours = _ours(tmp_path / "files_run", files=files, image=images["first"], height=h, width=w, frames=f,
                 guidance=5.0, steps=4, **last)
    ref = _ours(tmp_path / "folder_run", folder, image=images["first"], height=h, width=w, frames=f, guidance=5.0,
                steps=4, **last)
    assert np.abs(ours - ref).max() < TOL
    if kind != "wan-i2v":
        return
    without = {k: v for k, v in files.items() if k != "clip_vision"}
    with pytest.raises(InputError, match="--clip-vision"):
        _ours(tmp_path / "no_clip", files=without, image=images["first"], height=h, width=w, frames=f)


def test_stages_one_at_a_time_give_the_same_video(i2v_models, images, tmp_path):
    """encode writes the image's encoding (VAE latents, CLIP features) as a stage file; sample reads it back."""
    h, w, f = WAN
    folder = i2v_models["wan-i2v"]
    common = dict(height=h, width=w, frames=f, guidance=5.0)
    whole = _ours(tmp_path / "all", folder, image=images["first"], **common)
    staged = tmp_path / "staged"
    generate(GenerateRequest(model=str(folder), output_dir=str(staged), prompt=PROMPT, negative_prompt=NEGATIVE,
                             image=str(images["first"]), stage="encode", dtype="float32", steps=3, seed=42, **common))
    saved = stage_files.load_image(staged)
    assert saved.image_embeds is not None and saved.latents.shape[1] == 4 + 16
    for stage in ("sample", "decode"):
        generate(GenerateRequest(model=str(folder), output_dir=str(staged), stage=stage, dtype="float32", steps=3,
                                 seed=42, **common))
    assert np.array_equal(stage_files.load_frames(staged).numpy(), whole)


def test_another_image_of_the_same_size_compiles_nothing(i2v_models, images, tmp_path):
    """The image encode stage is one program per size: a second video from another picture compiles no XLA
    program in any stage, and the picture changes the video."""
    from tpu_runtime.families.cogvideox.model import CogVideoXFamily
    from tpu_runtime.engine.stages import SampleSettings

    h, w, f = SIZES["cog-5b"]
    family = CogVideoXFamily(i2v_models["cog-5b"], dtype="float32")
    embeds = family.encode(PROMPT, NEGATIVE)
    settings = SampleSettings(h, w, f, steps=2, guidance=6.0, seed=1)
    latents = []
    for name in ("first", "other"):
        before = compile_stats()
        image = family.encode_image(images[name], height=h, width=w, num_frames=f)
        latents.append(family.sample(embeds, settings, image=image))
        family.decode(latents[-1])
        compiled = compile_stats().since(before).backend_compiles
    assert compiled == 0, f"the second image compiled {compiled} XLA program(s)"
    assert "image" in family.timings.run
    assert (latents[0].latents - latents[1].latents).abs().max() > 1e-2


def test_bad_image_input_is_refused_before_any_compile(tiny_models, i2v_models, images, tmp_path):
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("this is text, not a picture")
    h, w, f = WAN
    cases = [
        (dict(model=tiny_models["5b"], image=images["first"]), "text-to-video model and takes no image"),
        (dict(model=i2v_models["cog-5b"]), "image-to-video model: give the first frame with --image"),
        (dict(model=i2v_models["wan-i2v"], image=images["first"], last_image=images["last"]),
         "takes only a first image: drop --last-image"),
        (dict(model=i2v_models["wan-flf2v"], image=images["first"]), "give --last-image too"),
        (dict(model=i2v_models["wan-i2v"], image=not_an_image), "is not an image"),
        (dict(model=i2v_models["wan-i2v"], image=tmp_path / "missing.png"), "does not exist"),
        (dict(model=i2v_models["cog-5b"], image=images["first"], height=48, width=64),
         "learned positions for 64x64 only"),
    ]
    for kw, message in cases:
        model = kw.pop("model")
        kw.setdefault("height", h)
        kw.setdefault("width", w)
        before = compile_stats()
        with pytest.raises(InputError, match=message):
            generate(GenerateRequest(model=str(model), output_dir=str(tmp_path / "out"), prompt=PROMPT, frames=f,
                                     steps=2, dtype="float32", **{k: str(v) if k.endswith("image") else v
                                                                 for k, v in kw.items()}))
        assert compile_stats().since(before).backend_compiles == 0, message


def test_sampling_refuses_an_image_encoded_for_another_size(i2v_models, images):
    from tpu_runtime.engine.stages import SampleSettings
    from tpu_runtime.families.wan.model import WanFamily

    family = WanFamily(i2v_models["wan-i2v"], dtype="float32")
    image = family.encode_image(images["first"], height=64, width=64, num_frames=9)
    embeds = family.encode(PROMPT, NEGATIVE)
    with pytest.raises(InputError, match="encoded for 9 frames of 64x64"):
        family.sample(embeds, SampleSettings(64, 64, 13, steps=2, guidance=5.0), image=image)
    with pytest.raises(InputError, match="image-to-video model: encode the first frame"):
        family.sample(embeds, SampleSettings(64, 64, 9, steps=2, guidance=5.0))
    # ComfyUI hands images over as float tensors [B, H, W, 3]: the same picture gives the same encoding.
    from PIL import Image

    pixels = torch.from_numpy(np.asarray(Image.open(images["first"]).convert("RGB")).copy()).float()[None] / 255
    again = family.encode_image(pixels, height=64, width=64, num_frames=9)
    assert torch.equal(again.latents, image.latents) and torch.equal(again.image_embeds, image.image_embeds)


def test_wan22_i2v_single_files_switch_experts_at_09(i2v_models, tmp_path):
    """The files of Wan 2.2 I2V-A14B do not record the boundary: it is the I2V model's 0.9 (T2V-A14B: 0.875),
    read from the transformer taking image channels; the files give the folder's weights."""
    from tpu_runtime.families.wan.model import WanFamily, WanFiles

    files = export_comfy_files(i2v_models["wan-a14b"], tmp_path / "files", "fp16")
    family = WanFamily(files=WanFiles(files["transformer"], files["text_encoder"], files["vae"],
                                      files["transformer_2"]), dtype="float32")
    assert family.boundary_ratio == 0.9 and family.two_experts and family.image_input == "required"
    assert not family.uses_clip


def test_wan21_i2v_native_size_follows_the_model_name(tmp_path):
    """Wan 2.1 I2V 480P and 720P have one architecture: the default size (no --height/--width) is read from the
    folder's or file's name, 480x832 unless it says 720 (FLF2V is 720P)."""
    import jax

    from tpu_runtime.families.registry import write_architecture
    from tpu_runtime.families.wan.model import WanFamily

    sizes = {name: WanFamily(write_architecture(name, tmp_path), target_devices=jax.devices()).native_size()
             for name in ("wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p", "wan2.1-flf2v-14b-720p")}
    assert sizes == {"wan2.1-i2v-14b-480p": (480, 832, 81), "wan2.1-i2v-14b-720p": (720, 1280, 81),
                     "wan2.1-flf2v-14b-720p": (720, 1280, 81)}

