"""LTX-2 is as exact as diffusers is: at every stage boundary (the prompt streams, the video and sound latents, the
frames, the waveform) and for each decoder alone, our float32 output differs from diffusers' float64 run of the
same pipeline (same weights, prompt, image and seed) by at most twice what diffusers' own float32 run differs from
it (RMS error relative to the float64 output's RMS; the largest error, relative to its largest value, within
three times).

Where the tiny models' attention is as sharp as a trained model's (their q/k norm gains around 1), a RoPE computed
in float32 where diffusers takes its frequencies in float64 put the prompt streams 27 times and the latents 70
times further from the float64 run than diffusers' float32 run is. Those frequencies, and the timestep
embedding's (which diffusers computes in float32 whatever the model's dtype), are checked alone at the released
models' sizes."""

import numpy as np
import pytest
import torch
from conftest import LTX2_SIZE, NEGATIVE, PROMPT

from tpu_runtime.engine.stages import SampleSettings, VideoLatents

H, W, F = LTX2_SIZE
STEPS = 3
STG = (1,)  # the tiny transformers have 2 blocks
DTYPES = (torch.float32, torch.float64)


@pytest.fixture(scope="module")
def models(tiny_ltx2):
    from tpu_runtime.families.ltx2.model import LTX2Family

    return {g: LTX2Family(path, dtype="float32") for g, path in tiny_ltx2.items()}


@pytest.fixture(scope="module")
def pipelines(tiny_ltx2):
    """``pipelines(generation, dtype, image)``: diffusers' LTX2Pipeline (LTX2ImageToVideoPipeline with ``image``) of a
    tiny model in ``dtype``, loaded once."""
    import functools

    import diffusers

    @functools.lru_cache(maxsize=None)
    def load(generation, dtype, image=False):
        cls = "LTX2ImageToVideoPipeline" if image else "LTX2Pipeline"
        pipe = getattr(diffusers, cls).from_pretrained(str(tiny_ltx2[generation]), dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return load


def _errors(ours, reference) -> tuple[float, float]:
    """(largest difference relative to the reference's largest value, RMS difference relative to its RMS)."""
    ours, reference = (torch.as_tensor(np.asarray(t)).double() for t in (ours, reference))
    assert ours.shape == reference.shape, (tuple(ours.shape), tuple(reference.shape))
    difference = ours - reference
    return ((difference.abs().max() / reference.abs().max()).item(),
            (difference.square().mean().sqrt() / reference.square().mean().sqrt()).item())


def _as_exact(what, ours, float32, float64):
    """Ours is as far from diffusers' float64 output as diffusers' float32 output is, within twice its RMS error
    and three times its largest error (and that error is not zero: the comparison would then say nothing). At the
    floor both errors are rounding noise: the largest of them moves by 2x between settings (XLA:CPU's matrix
    products and convolutions round 1.5-4x more than torch's), their RMS stays within 1.5x."""
    theirs, mine = _errors(float32, float64), _errors(ours, float64)
    print(f"{what}: largest ours {mine[0]:.2e} diffusers {theirs[0]:.2e} ({mine[0] / theirs[0]:.2f}x); "
          f"rms ours {mine[1]:.2e} diffusers {theirs[1]:.2e} ({mine[1] / theirs[1]:.2f}x)")
    assert theirs[0] > 0 and theirs[1] > 0, what
    assert mine[1] <= 2 * theirs[1] and mine[0] <= 3 * theirs[0], (what, mine, theirs)


def _traced(fn, *args):
    """``fn(*args)`` (torch tensors in, a tuple of tensors out) traced through the runtime as LTX-2's programs are."""
    import jax

    from tpu_runtime.engine.runtime import get_runtime
    from tpu_runtime.families.ltx2.programs import _traced_as_diffusers

    env = get_runtime().env

    def run(*arrays):
        with env:
            return env.t2j_iso(fn(*env.j2t_iso(arrays)))

    with _traced_as_diffusers():
        out = jax.jit(run)(*(a.numpy() for a in args))
    return [torch.from_numpy(np.asarray(o).copy()) for o in out]


@pytest.mark.parametrize("rope_type", ["split", "interleaved"])
def test_rope_tables_are_diffusers_at_the_released_sizes(rope_type):
    """The connectors' 1D RoPE (LTX-2.3's 32 heads of 128 and of 64, 1024 tokens) and the transformer's video and
    sound RoPE (frames, rows and columns of a 121x512x768 video; 126 sound frames) equal diffusers' tables: the
    angles reach theta x pi / 2 = 15708 rad, where frequencies taken in float32 instead of float64 put them up to
    4e-3 rad off."""
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed
    from diffusers.pipelines.ltx2.connectors import LTX2RotaryPosEmbed1d

    for dim in (4096, 2048):
        rope = LTX2RotaryPosEmbed1d(dim, base_seq_len=4096, rope_type=rope_type, num_attention_heads=32)
        ours = _traced(lambda: rope(2, 1024, "jax"))
        for mine, theirs in zip(ours, rope(2, 1024, "cpu")):
            assert (mine - theirs).abs().max() < 2e-6, (dim, (mine - theirs).abs().max())
    video = LTX2AudioVideoRotaryPosEmbed(4096, rope_type=rope_type, num_attention_heads=32)
    audio = LTX2AudioVideoRotaryPosEmbed(2048, modality="audio", rope_type=rope_type, num_attention_heads=32)
    coords = (video.prepare_video_coords(1, 16, 16, 24, torch.device("cpu"), fps=24.0),
              audio.prepare_audio_coords(1, 126, torch.device("cpu")))
    for module, where in zip((video, audio), coords):
        ours = _traced(lambda c: module(c), where)
        for mine, theirs in zip(ours, module(where)):
            assert (mine - theirs).abs().max() < 2e-6, (module.modality, (mine - theirs).abs().max())


def test_timestep_embedding_is_diffusers():
    """diffusers takes the timestep embedding's frequencies in float32 in its float32 and its float64 runs alike:
    traced, ours equal them (LTX-2 embeds sigma x 1000, where an exp one bit off moves the sines by 3e-5)."""
    from diffusers.models.embeddings import Timesteps

    timesteps = torch.tensor([1000.0, 999.5, 917.3, 500.25, 13.7, 0.0])
    for dim, flip, shift in ((256, True, 0), (256, False, 1), (33, True, 0)):
        embed = Timesteps(dim, flip_sin_to_cos=flip, downscale_freq_shift=shift)
        mine, = _traced(lambda t: (embed(t),), timesteps)
        assert (mine - embed(timesteps)).abs().max() < 2e-6, (dim, (mine - embed(timesteps)).abs().max())


def _streams(pipe):
    """diffusers' prompt streams (video, sound) of [negative, positive], as its pipeline makes them."""
    with torch.no_grad():
        positive, positive_mask, negative, negative_mask = pipe.encode_prompt(
            PROMPT, NEGATIVE, do_classifier_free_guidance=True, max_sequence_length=1024, device="cpu")
        video, audio, _ = pipe.connectors(torch.cat([negative, positive]), torch.cat([negative_mask, positive_mask]),
                                          padding_side="left")
    return video, audio


def _call(s: SampleSettings) -> dict:
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_frames=F, num_inference_steps=STEPS,
                guidance_scale=s.guidance, spatio_temporal_guidance_blocks=list(STG))
    if s.audio_guidance is not None:
        call["audio_guidance_scale"] = s.audio_guidance
    for name in ("stg_scale", "modality_scale", "guidance_rescale"):
        value = getattr(s, name)
        if value is not None:
            call[name] = call[f"audio_{name}"] = value
    return call


def _diffusers(pipelines, generation, dtype, s, image):
    """diffusers' latents (video, sound) in ``dtype``, and its frames and waveform: those latents through the same
    pipeline's decoders as its ``output_type="np"`` path decodes them (one denoising run serves both)."""
    from PIL import Image

    pipe = pipelines(generation, dtype, image is not None)
    extra = {"image": Image.open(image)} if image is not None else {}
    with torch.no_grad():
        out = pipe(generator=torch.Generator("cpu").manual_seed(s.seed), output_type="latent", **extra, **_call(s))
    return (out.frames, out.audio) + _decoded(pipe, out.frames, out.audio, dtype)


def _decoded(pipe, video, audio, dtype):
    """(frames [F, H, W, 3] in 0..1, waveform) of de-normalised latents through ``pipe``'s decoders in ``dtype``."""
    with torch.no_grad():
        pixels = pipe.vae.decode(video.to(dtype), None, return_dict=False)[0]
        waveform = pipe.vocoder(pipe.audio_vae.decode(audio.to(dtype), return_dict=False)[0])[0]
    return (pixels[0].permute(1, 2, 3, 0) / 2 + 0.5).clamp(0, 1), waveform


@pytest.mark.parametrize("generation", ["2.3", "2.0"])
def test_text_encode_is_as_exact_as_diffusers(models, pipelines, generation):
    """Gemma 3 and the text connectors: both prompt streams of [negative, positive]."""
    embeddings = models[generation].encode(PROMPT, NEGATIVE)
    streams = {dtype: _streams(pipelines(generation, dtype)) for dtype in DTYPES}
    video = torch.cat([embeddings.negative_prompt_embeds, embeddings.prompt_embeds])
    audio = torch.cat([embeddings.negative_audio_prompt_embeds, embeddings.audio_prompt_embeds])
    _as_exact(f"LTX-{generation} video prompt stream", video, *(streams[d][0] for d in DTYPES))
    _as_exact(f"LTX-{generation} sound prompt stream", audio, *(streams[d][1] for d in DTYPES))


CASES = {
    "2.3 default guidance": ("2.3", {}, None),
    "2.3 other guidance": ("2.3", dict(guidance=4.5, audio_guidance=2.5, stg_scale=0.6, modality_scale=2.0,
                                       guidance_rescale=0.3), None),
    "2.0 image to video": ("2.0", dict(guidance=2.0, audio_guidance=5.0), "first"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_and_decoding_are_as_exact_as_diffusers(models, pipelines, images, case):
    """Sampling (text encode included: end to end to the latents), each decoder alone from diffusers' float64
    latents, and the frames and waveform end to end."""
    generation, overrides, image_name = CASES[case]
    family = models[generation]
    s = SampleSettings(height=H, width=W, num_frames=F, steps=STEPS, seed=7, stg_blocks=STG,
                       **{"guidance": 3.0, **overrides})
    image = images[image_name] if image_name else None
    conditioning = family.encode_image(image, height=H, width=W, num_frames=F) if image else None
    latents = family.sample(family.encode(PROMPT, NEGATIVE), s, image=conditioning)
    theirs = {dtype: _diffusers(pipelines, generation, dtype, s, image) for dtype in DTYPES}
    _as_exact(f"{case}: video latents", latents.latents, *(theirs[d][0] for d in DTYPES))
    _as_exact(f"{case}: sound latents", latents.audio, *(theirs[d][1] for d in DTYPES))

    z, a = theirs[torch.float64][:2]  # the decoders alone, from the same (float64) latents
    given = VideoLatents(z.float(), H, W, F, family.signature, audio=a.float())
    decoded = {dtype: _decoded(pipelines(generation, dtype), z, a, dtype) for dtype in DTYPES}
    _as_exact(f"{case}: video decode", family.decode(given), *(decoded[d][0] for d in DTYPES))
    _as_exact(f"{case}: sound decode", family.decode_audio(given), *(decoded[d][1] for d in DTYPES))

    _as_exact(f"{case}: frames", family.decode(latents), *(theirs[d][2] for d in DTYPES))
    _as_exact(f"{case}: waveform", family.decode_audio(latents), *(theirs[d][3] for d in DTYPES))
