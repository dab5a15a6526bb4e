"""LTX-2: frames and sound equal diffusers' LTX2Pipeline / LTX2ImageToVideoPipeline and its two-stage recipe on the
same tiny weights, prompt, image and seed; every guidance knob moves the output as it moves diffusers'; scales,
seeds and prompts compile nothing; what the model cannot take is refused before anything compiles."""

import numpy as np
import pytest
import torch
from conftest import LTX2_SIZE, NEGATIVE, PROMPT
from oracle import ltx2_outputs, ltx2_two_stages

from tpu_runtime.engine.runtime import compile_stats
from tpu_runtime.engine.stages import SampleSettings
from tpu_runtime.errors import InputError

H, W, F = LTX2_SIZE
STEPS = 3
# The tiny transformers have 2 blocks; STG perturbs block 1 (diffusers' default, block 28, is past their end).
STG = (1,)


@pytest.fixture(scope="module")
def models(tiny_ltx2):
    from tpu_runtime.families.ltx2.model import LTX2Family

    return {g: LTX2Family(path, dtype="float32") for g, path in tiny_ltx2.items()}


@pytest.fixture(scope="module")
def embeddings(models):
    return {g: m.encode(PROMPT, NEGATIVE) for g, m in models.items()}


def _settings(**overrides):
    values = dict(height=H, width=W, num_frames=F, steps=STEPS, guidance=3.0, seed=7, stg_blocks=STG)
    values.update(overrides)
    return SampleSettings(**values)


def _diffusers_call(s: SampleSettings) -> dict:
    """The diffusers arguments of settings ``s`` (ours left unset: diffusers' defaults, which are ours too)."""
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=s.height, width=s.width, num_frames=s.num_frames,
                num_inference_steps=s.steps, guidance_scale=s.guidance,
                spatio_temporal_guidance_blocks=list(s.stg_blocks))
    for ours, theirs in (("audio_guidance", "audio_guidance_scale"), ("stg_scale", "stg_scale"),
                         ("modality_scale", "modality_scale"), ("guidance_rescale", "guidance_rescale"),
                         ("frame_rate", "frame_rate")):
        value = getattr(s, ours)
        if value is not None:
            call[theirs] = value
            # one knob of ours sets both of diffusers' (video and sound); audio guidance is diffusers' own
            if ours in ("stg_scale", "modality_scale", "guidance_rescale"):
                call[f"audio_{theirs}"] = value
    if s.sigmas == "distilled":
        from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

        call["sigmas"] = DISTILLED_SIGMA_VALUES
    return call


def _close(ours, theirs, what, atol=1e-4):
    theirs = torch.as_tensor(np.asarray(theirs)).float()
    assert tuple(ours.shape) == tuple(theirs.shape), (what, tuple(ours.shape), tuple(theirs.shape))
    difference = (ours.float() - theirs).abs().max().item()
    print(what, "max |ours - diffusers|", difference)
    assert difference < atol, (what, difference)


@pytest.mark.parametrize("generation", ["2.0", "2.3"])
def test_text_to_video_with_sound_matches_diffusers(models, embeddings, tiny_ltx2, generation):
    """Default guidance (CFG, STG, modality isolation, rescale): 2.3 perturbs its attention for STG, 2.0 has no
    perturbed attention (its STG pass equals the positive one and is not run here; diffusers still runs it)."""
    family, s = models[generation], _settings()
    latents = family.sample(embeddings[generation], s)
    frames, waveform = family.decode(latents), family.decode_audio(latents)
    want_frames, want_audio = ltx2_outputs(tiny_ltx2[generation], s.seed, **_diffusers_call(s))
    _close(frames, want_frames, f"LTX-{generation} frames")
    _close(waveform, want_audio, f"LTX-{generation} waveform")
    assert waveform.shape[0] == 2 and waveform.abs().max() > 1e-3  # stereo, not silence
    expected_passes = 3 if generation == "2.3" else 2
    assert family.guidance(s)[0].count == expected_passes


def test_single_pass_distilled_schedule_matches_diffusers(models, embeddings, tiny_ltx2):
    """The distilled settings: one transformer pass a step (--guidance 1 --audio-guidance 1 --stg-scale 0
    --modality-scale 1) over the distilled model's 8 sigmas."""
    family = models["2.0"]
    s = _settings(steps=8, guidance=1.0, audio_guidance=1.0, stg_scale=0.0, modality_scale=1.0, sigmas="distilled")
    assert family.guidance(s)[0].count == 1 and not family.guidance(s)[0].cfg
    latents = family.sample(embeddings["2.0"], s)
    want_frames, want_audio = ltx2_outputs(tiny_ltx2["2.0"], s.seed, **_diffusers_call(s))
    _close(family.decode(latents), want_frames, "distilled frames")
    _close(family.decode_audio(latents), want_audio, "distilled waveform")


KNOBS = {"guidance": 1.5, "audio_guidance": 2.0, "stg_scale": 0.5, "modality_scale": 1.5, "guidance_rescale": 0.0,
         "frame_rate": 12.0}


def test_each_knob_moves_the_output_as_it_moves_diffusers(models, embeddings, tiny_ltx2):
    """Every guidance knob, and the frame rate (the positions), changes the video and the sound latents exactly as
    it changes diffusers' (to 2e-5: they agree to about 4e-6); a new scale with the same passes compiles nothing."""
    family, emb = models["2.3"], embeddings["2.3"]
    base = family.sample(emb, _settings())
    tol = 2e-5
    for name, value in KNOBS.items():
        s = _settings(**{name: value})
        before = compile_stats()
        ours = family.sample(emb, s)
        if family.guidance(s)[0] == family.guidance(_settings())[0] and name != "frame_rate":
            assert compile_stats().since(before).backend_compiles == 0, name
        video, audio = ltx2_outputs(tiny_ltx2["2.3"], s.seed, output_type="latent", **_diffusers_call(s))
        _close(ours.latents, video, f"{name}={value} video latents", atol=tol)
        _close(ours.audio, audio, f"{name}={value} sound latents", atol=tol)
        moved_video = (ours.latents - base.latents).abs().max().item()
        if name == "frame_rate":  # the same frames last longer: more sound
            assert ours.audio.shape[2] > base.audio.shape[2]
            assert moved_video > 5 * tol, (name, moved_video)
            continue
        moved_audio = (ours.audio - base.audio).abs().max().item()
        # well past the tolerance the outputs agree to: a dropped pass or an ignored scale cannot pass
        assert moved_audio > 5 * tol, (name, moved_audio)
        if name != "audio_guidance":
            assert moved_video > 5 * tol, (name, moved_video)


def test_image_to_video_matches_diffusers(models, embeddings, tiny_ltx2, images):
    """The picture through the same H.264 round trip and resize, its latent frame held; frames and sound equal."""
    family, s = models["2.0"], _settings()
    image = family.encode_image(images["first"], height=H, width=W, num_frames=F)
    latents = family.sample(embeddings["2.0"], s, image=image)
    want_frames, want_audio = ltx2_outputs(tiny_ltx2["2.0"], s.seed, image=images["first"], **_diffusers_call(s))
    _close(family.decode(latents), want_frames, "image-to-video frames")
    _close(family.decode_audio(latents), want_audio, "image-to-video waveform")
    other = family.sample(embeddings["2.0"], s, image=family.encode_image(images["other"], height=H, width=W,
                                                                          num_frames=F))
    assert (other.latents - latents.latents).abs().max() > 1e-2  # the picture steers the video


def test_two_stages_match_diffusers_chained(models, embeddings, tiny_ltx2):
    """Half size, the latent upsampler (x2), three refine steps with the second stage's distilled sigmas from the
    upsampled latents and fresh noise: diffusers' pipelines chained the same way."""
    family = models["2.0"]
    half = _settings(height=H, width=W)
    first = family.sample(embeddings["2.0"], half)
    upsampled = family.upsample(first)
    assert upsampled.latents.shape[3:] == (first.latents.shape[3] * 2, first.latents.shape[4] * 2)
    assert (upsampled.height, upsampled.width) == (2 * H, 2 * W) and upsampled.audio is first.audio
    refine = _settings(height=2 * H, width=2 * W, steps=3, guidance=1.0, sigmas="stage2")
    final = family.sample(embeddings["2.0"], refine, latents=upsampled)
    want_frames, want_audio = ltx2_two_stages(tiny_ltx2["2.0"], half.seed, PROMPT, NEGATIVE, H, W, F, STEPS,
                                              stage_1={"spatio_temporal_guidance_blocks": list(STG)},
                                              stage_2={"spatio_temporal_guidance_blocks": list(STG),
                                                       "guidance_scale": 1.0})
    _close(family.decode(final), want_frames, "two-stage frames")
    _close(family.decode_audio(final), want_audio, "two-stage waveform")


def test_seed_prompt_and_steps_compile_nothing_new(models, embeddings):
    family = models["2.0"]
    family.sample(embeddings["2.0"], _settings(steps=3))
    before = compile_stats()
    other = family.encode("a cat walks on the grass", "")
    family.sample(other, _settings(steps=6, seed=11))
    family.sample(embeddings["2.0"], _settings(steps=3, guidance=4.5, audio_guidance=5.0, stg_scale=2.0,
                                               modality_scale=2.0, guidance_rescale=0.3))
    assert compile_stats().since(before).backend_compiles == 0


@pytest.mark.parametrize("change, needle", [
    ({"height": 80}, "height=80 must be a positive multiple of 32 for LTX-2 (diffusers' LTX-2 pipelines take "
                     "multiples of 32; this VAE compresses 32x) (nearest: 64 or 96)"),
    ({"num_frames": 13}, "frames=13 must be 8*N+1 for LTX-2 (nearest: 9 or 17; 121 is the native length)"),
    ({"steps": 5, "sigmas": "distilled"}, "the distilled sigma schedule has 8 steps"),
    ({"stg_blocks": (5,)}, "stg_blocks=[5]: this transformer has blocks 0..1"),
    ({"shift": 3.0}, "shift=3.0 is an option of Wan models"),
    ({"scheduler": "unipc"}, "LTX-2 samples with flow-matching Euler only"),
    ({"audio_guidance": 0.0}, "audio_guidance=0.0 must be a number above 0.0"),
    ({"noise_scale": 0.5}, "noise_scale applies when sampling starts from given latents"),
])
def test_what_ltx2_cannot_take_is_refused_before_anything_compiles(models, embeddings, change, needle):
    family = models["2.0"]
    before = compile_stats()
    with pytest.raises(InputError) as refused:
        family.sample(embeddings["2.0"], _settings(**change))
    assert needle in str(refused.value)
    assert compile_stats().since(before).backend_compiles == 0


def test_sizes_are_multiples_of_32_whatever_the_vae_compresses(runtime, tmp_path, capsys):
    """diffusers' LTX-2 pipelines take only multiples of 32 (``check_inputs``), whatever the VAE compresses: an
    LTX-2.0 whose VAE compresses 16x refuses height 48 as diffusers does, naming the rule and the nearest sizes,
    and 13 frames naming 9 and 17, exit 2 before anything compiles; at 64x96 it generates diffusers' frames and
    sound."""
    import diffusers
    from oracle import ltx2_outputs

    from tpu_runtime.families.ltx2.model import LTX2Family
    from tpu_runtime.families.ltx2.tiny import build_tiny_ltx2
    from tpu_runtime.tools.cli import main

    folder = build_tiny_ltx2(tmp_path / "ltx2_vae16", "2.0", seed=3, upsampler=False, spatial=16)
    pipe = diffusers.LTX2Pipeline.from_pretrained(str(folder))
    assert pipe.vae_spatial_compression_ratio == 16
    with pytest.raises(ValueError, match="divisible by 32"):
        pipe(prompt=PROMPT, height=48, width=96, num_frames=9, num_inference_steps=1)

    base = ["generate", "--model", str(folder), "--prompt", PROMPT, "--output-dir", str(tmp_path / "out")]
    before = compile_stats()
    for size, message in (
            (("48", "96", "9"), "height=48 must be a positive multiple of 32 for LTX-2 (diffusers' LTX-2 pipelines "
                                "take multiples of 32; this VAE compresses 16x) (nearest: 32 or 64)"),
            (("64", "80", "13"), "width=80 must be a positive multiple of 32"),
            (("64", "96", "13"), "frames=13 must be 8*N+1 for LTX-2 (nearest: 9 or 17; 121 is the native length)")):
        assert main(base + ["--height", size[0], "--width", size[1], "--frames", size[2]]) == 2, size
        assert message in capsys.readouterr().err, size
    assert compile_stats().since(before).backend_compiles == 0

    family = LTX2Family(folder, dtype="float32")
    one_pass = dict(guidance=1.0, audio_guidance=1.0, stg_scale=0.0, modality_scale=1.0)
    latents = family.sample(family.encode(PROMPT, NEGATIVE), SampleSettings(64, 96, 9, steps=2, seed=3, **one_pass))
    frames, waveform = ltx2_outputs(folder, 3, prompt=PROMPT, negative_prompt=NEGATIVE, height=64, width=96,
                                    num_frames=9, num_inference_steps=2, guidance_scale=1.0, audio_guidance_scale=1.0,
                                    stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)
    _close(family.decode(latents), frames, "16x VAE frames")
    _close(family.decode_audio(latents), waveform, "16x VAE waveform")


def test_ltx2_options_on_another_family_are_refused(tiny_wan):
    from tpu_runtime.families.wan.model import WanFamily

    wan = WanFamily(tiny_wan["2.1"], dtype="float32")
    embeds = wan.encode(PROMPT)
    before = compile_stats()
    for name, value in (("audio_guidance", 2.0), ("stg_scale", 1.0), ("frame_rate", 24.0), ("sigmas", "distilled")):
        with pytest.raises(InputError, match=f"{name}=.* is an option of LTX-2 models"):
            wan.sample(embeds, SampleSettings(64, 64, 9, steps=2, **{name: value}))
    assert compile_stats().since(before).backend_compiles == 0


def test_command_line_stages_write_video_with_its_sound(tiny_ltx2, models, embeddings, tmp_path):
    """`generate` on an LTX-2 folder: the three stages run one at a time give what stage all gives; the sound is
    written as a WAV (the waveform to 16-bit precision) and muxed into the mp4 as AAC; the LTX-2 options reach the
    sampler (diffusers' sound latents for the same settings) and are recorded."""
    import json
    import wave

    from tpu_runtime.tools.cli import main
    from tpu_runtime.tools.stage_files import load_latents
    from tpu_runtime.tools.video import read_mp4

    folder = str(tiny_ltx2["2.0"])
    common = ["--model", folder, "--height", str(H), "--width", str(W), "--frames", str(F), "--steps", "3",
              "--seed", "7", "--dtype", "float32", "--negative-prompt", NEGATIVE, "--audio-guidance", "2.5",
              "--stg-scale", "0", "--frame-rate", "12"]
    whole, staged = tmp_path / "all", tmp_path / "staged"
    assert main(["generate", *common, "--prompt", PROMPT, "--output-dir", str(whole)]) == 0
    assert main(["generate", *common, "--prompt", PROMPT, "--stage", "encode", "--output-dir", str(staged)]) == 0
    assert main(["generate", *common, "--stage", "sample", "--output-dir", str(staged)]) == 0
    # decode alone: the size from the latents, the mp4's rate from what the earlier stages recorded
    assert main(["generate", "--model", folder, "--dtype", "float32", "--stage", "decode",
                 "--output-dir", str(staged)]) == 0
    a, b = load_latents(whole), load_latents(staged)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.audio, b.audio)
    s = _settings(audio_guidance=2.5, stg_scale=0.0, frame_rate=12.0)
    video, audio = ltx2_outputs(tiny_ltx2["2.0"], s.seed, output_type="latent", **_diffusers_call(s))
    _close(a.audio, audio, "command-line sound latents")
    waveform = models["2.0"].decode_audio(a)
    for out in (whole, staged):
        with wave.open(str(out / "output_audio.wav")) as f:
            assert (f.getnchannels(), f.getframerate()) == (waveform.shape[0], models["2.0"].sample_rate)
            pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, f.getnchannels()).T
        assert np.abs(pcm / 32767 - waveform.clamp(-1, 1).numpy()).max() < 1.5 / 32767
        frames, meta = read_mp4(out / "output_video.mp4")
        assert frames.shape == (F, H, W, 3) and meta["audio_codec"] == "aac" and meta["fps"] == 12.0
    config = json.loads((whole / "generation_config.json").read_text())
    assert (config["audio_guidance"], config["stg_scale"], config["frame_rate"]) == (2.5, 0.0, 12.0)


def test_ltx2_command_line_options_elsewhere_are_refused(tiny_wan, tmp_path, capsys):
    from tpu_runtime.tools.cli import main

    base = ["generate", "--model", str(tiny_wan["2.1"]), "--prompt", PROMPT, "--height", "64", "--width", "64",
            "--frames", "9", "--steps", "2", "--output-dir", str(tmp_path)]
    assert main(base + ["--stg-scale", "1"]) == 2
    assert "stg_scale=1.0 is an option of LTX-2 models" in capsys.readouterr().err
    assert main(base + ["--upsampler", str(tmp_path)]) == 2
    assert "--upsampler: not an option of Wan models" in capsys.readouterr().err


# --- plan: the released 19B model compiled for a real TPU slice, no weights ---------------------------------------
def test_plan_compiles_the_ltx2_step_for_v6e8_with_every_guidance_pass():
    """LTX-2 19B (one of its 48 blocks, a small video) for v6e-8: the step with CFG and modality isolation is one
    program of two transformer calls: six splash attentions a block in the CFG call (video and sound self- and
    text attention, both cross-modal ones), four in the isolated one (the cross-modal ones off); Megatron tensor
    parallelism gathers no weight; the weights the compiler counts equal the shapes split over the mesh."""
    from tpu_runtime.tools.plan import ModelSource, open_abstract, parse_topology, plan

    layers = 1
    report = plan(ModelSource("ltx2-19b"), "v6e-8", height=128, width=192, frames=9, mesh="dp=2,sp=1,tp=4",
                  stages=("sample",), layers=layers)
    sample = report.stages["sample"]
    assert sample.compiled, sample.error
    assert sample.mosaic_kernels == (6 + 4) * layers
    assert sample.all_reduces >= 2 * layers and sample.all_gathers == 0
    topo = parse_topology("v6e-8")
    family = open_abstract(ModelSource("ltx2-19b"), topo.devices(), _tmp(), mesh="dp=2,sp=1,tp=4", layers=layers)
    family._component("transformer")
    mesh = dict(family.mesh.shape)
    expected = 0
    for struct in {id(s): s for s in family._states["transformer"].values()}.values():
        spec = struct.sharding.spec
        split = int(np.prod([mesh[a] for a in spec if a is not None])) if spec else 1
        expected += int(np.prod(struct.shape)) * struct.dtype.itemsize // split
    assert sample.weights_bytes_per_chip == expected
    assert report.fits


def test_plan_says_no_for_ltx2_on_one_chip_in_seconds():
    """19B transformer and Gemma 3 12B in bfloat16 do not fit a 16 GiB chip: refused from the weights alone, with
    nothing compiled, and a larger slice suggested."""
    import time

    from tpu_runtime.tools.plan import GIB, ModelSource, plan

    start = time.perf_counter()
    report = plan(ModelSource("ltx2-19b"), "v5e-1", stages=("sample",))
    assert not report.fits and "weights alone" in report.stages["sample"].error
    assert report.stages["sample"].weights_bytes_per_chip > 30 * GIB  # 19B parameters in bfloat16, with Gemma
    assert any(s.startswith("a larger slice") for s in report.suggestions), report.suggestions
    assert time.perf_counter() - start < 120


def _tmp():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp())


LTX2_LORA_TARGETS = (r"transformer_blocks\.\d+\.(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|"
                     r"video_to_audio_attn)\.(to_q|to_k|to_v|to_out\.0)\.weight|"
                     r"transformer_blocks\.\d+\.(ff|audio_ff)\.net\.(0\.proj|2)\.weight")


def test_a_lora_gives_diffusers_frames_and_sound(tiny_ltx2, tmp_path):
    """A LoRA (diffusers/PEFT names, over every attention and feed-forward of both streams) at strength 0.8: the
    video and sound latents equal diffusers' pipeline with the same file loaded (load_lora_weights, scale 0.8)."""
    import diffusers

    from tpu_runtime.engine.lora import LoraSpec
    from tpu_runtime.engine.tiny import write_tiny_lora
    from tpu_runtime.families.ltx2.model import LTX2Family

    folder = tiny_ltx2["2.0"]
    path = write_tiny_lora(folder / "transformer", tmp_path / "ltx2_lora.safetensors", "diffusers",
                           LTX2_LORA_TARGETS, scale=0.3)
    family = LTX2Family(folder, dtype="float32")
    s = _settings(loras=(LoraSpec(str(path), 0.8),))
    ours = family.sample(family.encode(PROMPT, NEGATIVE), s)
    plain = family.sample(family.encode(PROMPT, NEGATIVE), _settings())
    pipe = diffusers.LTX2Pipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(path), adapter_name="tiny")
    pipe.set_adapters(["tiny"], [0.8])
    out = pipe(generator=torch.Generator("cpu").manual_seed(s.seed), output_type="latent", **_diffusers_call(s))
    _close(ours.latents, out.frames, "LoRA video latents")
    _close(ours.audio, out.audio, "LoRA sound latents")
    assert (ours.latents - plain.latents).abs().max() > 1e-2  # the LoRA moves the video


def test_a_lora_in_the_original_names_gives_diffusers_frames_and_sound(tiny_ltx2, tmp_path):
    """A LoRA in the names LTX-2's own trainer and ComfyUI use (``diffusion_model.`` + the original names, lora_A /
    lora_B: the format of Lightricks' distilled LoRA), over every block's attention and feed-forward and the
    modules whose original names differ from diffusers' (patchify projections, the AdaLN and cross-modal
    modulation linears, 2.3's prompt modulation): every key applied, and the latents equal diffusers' pipeline with
    the same file (load_lora_weights converts the names its own way)."""
    import diffusers
    from safetensors import safe_open

    from tpu_runtime.engine.lora import LoraSpec
    from tpu_runtime.families.ltx2.model import LTX2Family
    from tpu_runtime.families.ltx2.tiny import build_tiny_lora

    folder = tiny_ltx2["2.3"]
    path = build_tiny_lora(folder / "transformer", tmp_path / "ltx-2-distilled-lora.safetensors", scale=0.2)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())  # noqa: SIM118
    for original in ("patchify_proj", "adaln_single.linear", "av_ca_a2v_gate_adaln_single.linear",
                     "prompt_adaln_single.linear", "transformer_blocks.0.audio_to_video_attn.to_q"):
        assert f"diffusion_model.{original}.lora_A.weight" in keys
    family = LTX2Family(folder, dtype="float32")
    s = _settings(loras=(LoraSpec(str(path), 0.7),))
    ours = family.sample(family.encode(PROMPT, NEGATIVE), s)
    (merged,) = family._loras["transformer"].files
    assert not merged.unmatched and len(merged.updates) == len(keys) // 2  # every module of the file applied
    pipe = diffusers.LTX2Pipeline.from_pretrained(str(folder), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(path), adapter_name="distilled")
    pipe.set_adapters(["distilled"], [0.7])
    out = pipe(generator=torch.Generator("cpu").manual_seed(s.seed), output_type="latent", **_diffusers_call(s))
    _close(ours.latents, out.frames, "original-names LoRA video latents")
    _close(ours.audio, out.audio, "original-names LoRA sound latents")


def test_command_line_two_stages_equal_diffusers_chained(tiny_ltx2, tmp_path):
    """`generate --two-stage` at 128x192: the first sampling at 64x96, the upsampler, 3 refine steps with the stage-2
    sigmas and one pass a step: diffusers' pipelines chained the same way; frames.safetensors holds the waveform."""
    from safetensors.torch import load_file

    from tpu_runtime.tools.cli import main

    out = tmp_path / "two"
    assert main(["generate", "--model", str(tiny_ltx2["2.0"]), "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
                 "--height", str(2 * H), "--width", str(2 * W), "--frames", str(F), "--steps", str(STEPS),
                 "--seed", "7", "--dtype", "float32", "--two-stage", "--output-dir", str(out)]) == 0
    one_pass = {"guidance_scale": 1.0, "audio_guidance_scale": 1.0, "stg_scale": 0.0, "audio_stg_scale": 0.0,
                "modality_scale": 1.0, "audio_modality_scale": 1.0}
    want_frames, want_audio = ltx2_two_stages(tiny_ltx2["2.0"], 7, PROMPT, NEGATIVE, H, W, F, STEPS,
                                              stage_2=one_pass)
    saved = load_file(str(out / "frames.safetensors"))
    _close(saved["frames"], want_frames, "--two-stage frames")
    _close(saved["audio"], want_audio, "--two-stage waveform")


def test_command_line_two_stages_with_the_distilled_lora_on_the_refine_stage(tiny_ltx2, tmp_path, capsys):
    """LTX-2's own recipe: `--two-stage --lora-2 FILE` merges the LoRA (original names, as Lightricks' distilled
    LoRA) for the refine stage only: diffusers' chain with the LoRA loaded for its second pipeline call. Without
    --two-stage, --lora-2 on LTX-2 is refused before anything runs, naming both ways."""
    from safetensors.torch import load_file

    from tpu_runtime.families.ltx2.tiny import build_tiny_lora
    from tpu_runtime.tools.cli import main

    folder = tiny_ltx2["2.0"]
    lora = build_tiny_lora(folder / "transformer", tmp_path / "ltx-2-19b-distilled-lora-384.safetensors", scale=0.2)
    args = ["generate", "--model", str(folder), "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
            "--height", str(2 * H), "--width", str(2 * W), "--frames", str(F), "--steps", str(STEPS),
            "--seed", "7", "--dtype", "float32"]
    assert main([*args, "--lora-2", f"{lora}:0.9", "--output-dir", str(tmp_path / "one")]) == 2
    assert "--two-stage" in capsys.readouterr().err
    out = tmp_path / "two"
    assert main([*args, "--two-stage", "--lora-2", f"{lora}:0.9", "--output-dir", str(out)]) == 0
    one_pass = {"guidance_scale": 1.0, "audio_guidance_scale": 1.0, "stg_scale": 0.0, "audio_stg_scale": 0.0,
                "modality_scale": 1.0, "audio_modality_scale": 1.0}
    want_frames, want_audio = ltx2_two_stages(folder, 7, PROMPT, NEGATIVE, H, W, F, STEPS, stage_2=one_pass,
                                              stage_2_lora=(lora, 0.9))
    saved = load_file(str(out / "frames.safetensors"))
    _close(saved["frames"], want_frames, "--two-stage --lora-2 frames")
    _close(saved["audio"], want_audio, "--two-stage --lora-2 waveform")
    plain_frames, _ = ltx2_two_stages(folder, 7, PROMPT, NEGATIVE, H, W, F, STEPS, stage_2=one_pass)
    assert (torch.as_tensor(want_frames) - torch.as_tensor(plain_frames)).abs().max() > 1e-2  # the LoRA shows


@pytest.mark.parametrize("args, needle", [
    (["--height", "96", "--width", "96", "--two-stage"], "height and width must be multiples of 64"),
    (["--two-stage", "--stage", "encode"], "--two-stage applies to sampling"),
])
def test_two_stage_mistakes_are_refused_before_anything_runs(runtime, tiny_ltx2, tmp_path, capsys, args, needle):
    from tpu_runtime.tools.cli import main

    before = compile_stats()
    assert main(["generate", "--model", str(tiny_ltx2["2.0"]), "--prompt", PROMPT, "--frames", str(F),
                 "--output-dir", str(tmp_path), *args]) == 2
    assert needle in capsys.readouterr().err
    assert compile_stats().since(before).backend_compiles == 0
