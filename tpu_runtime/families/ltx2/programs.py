"""LTX-2's stage programs: Gemma 3 and the text connectors, the image encode, one denoising step with every guidance
pass, the video decode, the sound decode (audio VAE and vocoder) and the spatial latent upsampler; and the module
replacement they are traced with.

``LTX2Programs`` is mixed into ``LTX2Family`` (``model.py``): each method builds ``StageProgram``s from the loaded
(or, for ``plan``, abstract) components; the family compiles and runs them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ...engine.stages import SampleSettings, StageProgram
from ...engine.streaming import to_frames

TEXT_LEN = 1024  # diffusers' LTX2Pipeline max_sequence_length

# The guidance coefficients a step program takes as one float32 input (so a new scale compiles nothing), computed in
# float64 on the host as diffusers computes them from Python floats: (g - 1), s, (m - 1) and the rescale r, (1 - r),
# for the video and for the sound.
COEFFICIENTS = ("cfg", "audio_cfg", "stg", "audio_stg", "modality", "audio_modality", "rescale", "rescale_keep",
                "audio_rescale", "audio_rescale_keep")


@dataclass(frozen=True)
class Passes:
    """The transformer passes one step runs (fixed per program): the CFG batch [negative, positive] or the positive
    prompt alone, the spatio-temporal guidance pass (self-attention perturbed in ``stg_blocks``) and the
    modality-isolation pass (audio<->video cross-attention off)."""

    cfg: bool
    stg_blocks: tuple[int, ...] = ()  # empty: no STG pass
    modality: bool = False

    @property
    def count(self) -> int:
        return 1 + bool(self.stg_blocks) + self.modality

    def describe(self) -> str:
        names = ["CFG batch 2" if self.cfg else "positive prompt"]
        if self.stg_blocks:
            names.append(f"STG at block{'s' if len(self.stg_blocks) > 1 else ''} "
                         f"{','.join(map(str, self.stg_blocks))}")
        if self.modality:
            names.append("modality isolation")
        return " + ".join(names)


class LTX2Programs:
    """The stage programs of an LTX-2 model (mixed into ``LTX2Family``)."""

    # --- stage 1: text -------------------------------------------------------------------------------------------
    def encode_program(self) -> StageProgram:
        """Gemma 3 over ``[negative, positive]`` (left-padded to 1024 tokens, every layer's hidden states stacked as
        diffusers packs them), then the text connectors: the video and the sound prompt streams."""
        gemma = self.component("text_encoder")
        connectors = self.component("connectors")

        def stacked(module, ids, mask):
            out = module(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
            return torch.stack(out.hidden_states, dim=-1).flatten(2, 3)

        gemma_fn = self.runtime.module_function(gemma, stacked)
        connectors_fn = self.runtime.module_function(
            connectors, lambda module, hidden, mask: module(hidden, mask, padding_side="left")[:2])
        dtype = self.model_dtype()

        def encode_fn(states, ids, mask):
            hidden = gemma_fn(states["text_encoder"], ids, mask).astype(dtype)
            return connectors_fn(states["connectors"], hidden, mask)

        shape = (2, TEXT_LEN)
        states = {"text_encoder": self.state("text_encoder"), "connectors": self.state("connectors")}
        example = (states, self.arg(shape, torch.int32), self.arg(shape, torch.int32))
        return StageProgram("encode", encode_fn, example, shape, f"Gemma 3 and the text connectors for {TEXT_LEN} "
                            "tokens", self.traced(_traced_as_diffusers), ("text_encoder", "connectors"))

    # --- image to video --------------------------------------------------------------------------------------------
    def image_programs(self, height: int, width: int, num_frames: int, images: int = 1) -> list[StageProgram]:
        """The first frame ``[1, 3, 1, H, W]`` through the video VAE's encoder: its posterior's mode, normalised by the
        latent statistics without the scaling factor (as diffusers' image-to-video pipeline does)."""
        import jax.numpy as jnp

        vae = self.component("vae")
        encode = self.runtime.module_function(vae, lambda module, pixels: module.encode(pixels).latent_dist.mode())
        mean, std = (jnp.asarray(t.view(1, -1, 1, 1, 1).numpy()) for t in self._latent_statistics())

        def image_fn(state, pixels):
            return (encode(state, pixels).astype(jnp.float32) - mean) * 1.0 / std

        example = (self.state("vae"), self.arg((1, 3, 1, height, width), self.dtype))
        return [StageProgram("image", image_fn, example, (height, width), f"LTX-2 VAE encode of the image for "
                             f"{width}x{height}", self.traced, ("vae",))]

    # --- stage 2: one denoising step ---------------------------------------------------------------------------
    def sample_program(self, geometry: "Geometry", passes: Passes, image: bool = False) -> StageProgram:
        """One denoising step of the video and the sound together: the transformer passes of ``passes`` (each a
        call of the whole model), the guidance terms combined on the x0 predictions and rescaled against the
        positive one, then Euler steps of both. ``image``: the first latent frame is the image's (timestep 0 on its
        tokens, never stepped)."""
        import jax
        import jax.numpy as jnp

        replicated = self.runtime.sharding(self.mesh)
        batch_sharding = self.runtime.sharding(self.mesh, ("dp",))
        call = _transformer_call(self.runtime.module_function(self.component("transformer")), self.model_dtype(),
                                 geometry, image)
        extra_passes = ([({"stg_blocks": passes.stg_blocks}, 2)] if passes.stg_blocks else []) + \
            ([({"isolate": True}, 4)] if passes.modality else [])

        def step_fn(state, x, xa, video_text, audio_text, t, sigmas, c, video_coords, audio_coords, keep_mask):
            sigma, dt = sigmas[0], sigmas[1] - sigmas[0]
            mask = keep_mask if image else None

            def x0(sample, velocity):
                return sample - velocity * sigma

            if passes.cfg:
                batch = jax.lax.with_sharding_constraint(jnp.concatenate([x, x]), batch_sharding)
                video, audio = call(state, batch, jnp.concatenate([xa, xa]), video_text, audio_text,
                                    jnp.broadcast_to(t, (2,)), jnp.concatenate([video_coords] * 2),
                                    jnp.concatenate([audio_coords] * 2), mask)
                v_uncond, v_cond = jnp.split(video, 2)
                a_uncond, a_cond = jnp.split(audio, 2)
                x_video, x_audio = x0(x, v_cond), x0(xa, a_cond)
                guided_video = x_video + c[0] * (x_video - x0(x, v_uncond))
                guided_audio = x_audio + c[1] * (x_audio - x0(xa, a_uncond))
                video_text, audio_text = video_text[1:], audio_text[1:]
            else:
                video, audio = call(state, x, xa, video_text, audio_text, t, video_coords, audio_coords, mask)
                x_video, x_audio = x0(x, video), x0(xa, audio)
                guided_video, guided_audio = x_video, x_audio
            for how, k in extra_passes:  # STG, then modality isolation: coefficients k (video) and k + 1 (sound)
                video, audio = call(state, x, xa, video_text, audio_text, t, video_coords, audio_coords, mask, **how)
                guided_video = guided_video + c[k] * (x_video - x0(x, video))
                guided_audio = guided_audio + c[k + 1] * (x_audio - x0(xa, audio))
            guided_video = _rescaled(guided_video, x_video, c[6], c[7])
            guided_audio = _rescaled(guided_audio, x_audio, c[8], c[9])
            # back to velocities, then diffusers' Euler step: x + (sigma_next - sigma) * v
            x_next = x + dt * ((x - guided_video) / sigma)
            if image:  # the image's frame is never stepped
                x_next = jnp.where(keep_mask[..., None] > 0, x, x_next)
            xa_next = xa + dt * ((xa - guided_audio) / sigma)
            return (jax.lax.with_sharding_constraint(x_next, replicated),
                    jax.lax.with_sharding_constraint(xa_next, replicated))

        g, arg, f32 = geometry, self.arg, torch.float32
        batch = 2 if passes.cfg else 1
        tokens = g.frames * g.height * g.width
        example = (self.state("transformer"), arg((1, tokens, g.channels), f32),
                   arg((1, g.audio_frames, g.audio_channels), f32),
                   arg((batch, TEXT_LEN, self.video_text_dim), self.dtype, ("dp",) if passes.cfg else ()),
                   arg((batch, TEXT_LEN, self.audio_text_dim), self.dtype, ("dp",) if passes.cfg else ()),
                   arg((1,), f32), arg((2,), f32), arg((len(COEFFICIENTS),), f32),
                   arg((1, 3, tokens, 2), f32), arg((1, 1, g.audio_frames, 2), f32),
                   arg((1, tokens), f32) if image else None)
        return StageProgram("sample", step_fn, example, (g, passes, image, self.attention),
                            f"LTX-2 sampler step for {g.describe()} ({passes.describe()}, mesh {self.mesh_spec}, "
                            f"{self.attention.impl} attention)", self.traced(_traced_as_diffusers), ("transformer",))

    # --- stage 3: decode -------------------------------------------------------------------------------------------
    def decode_programs(self, z_shape: tuple[int, ...]) -> list[StageProgram]:
        """Video latents ``[1, C, F, h, w]`` (de-normalised) through the video VAE's decoder (non-causal: the whole
        video at once, as diffusers decodes it) to frames ``[F', H, W, 3]`` in 0..1."""
        vae = self.component("vae")
        timestep_conditioned = bool(self.vae_config.get("timestep_conditioning", False))

        def decode(module, z):
            # diffusers' default decode_timestep 0 and decode noise 0: the latents unchanged, temb at t = 0
            timestep = torch.zeros((z.shape[0],), dtype=z.dtype) if timestep_conditioned else None
            return module.decode(z, timestep, return_dict=False)[0]

        decode_fn = self.runtime.module_function(vae, decode)
        dtype = self.model_dtype()

        def frames_fn(state, z):
            return to_frames(decode_fn(state, z.astype(dtype)))

        example = (self.state("vae"), self.arg(z_shape, torch.float32, self.vae_input_spec(z_shape)))
        frames = (z_shape[2] - 1) * self.vae_scale_temporal + 1
        what = f"LTX-2 video VAE decode for {frames}x{z_shape[3] * self.vae_scale_spatial}x" \
               f"{z_shape[4] * self.vae_scale_spatial}"
        return [StageProgram("decode", frames_fn, example, (tuple(z_shape), self.vae_sharding), what, self.traced,
                             ("vae",))]

    def decode_audio_programs(self, a_shape: tuple[int, ...]) -> list[StageProgram]:
        """Sound latents ``[1, C, L, M]`` (de-normalised) through the audio VAE's decoder to a mel spectrogram and the
        vocoder to the waveform ``[channels, samples]`` float32."""
        import jax.numpy as jnp

        audio_vae, vocoder = self.component("audio_vae"), self.component("vocoder")
        mel_fn = self.runtime.module_function(audio_vae, lambda module, z: module.decode(z, return_dict=False)[0])
        wave_fn = self.runtime.module_function(vocoder)
        dtype = self.model_dtype()

        def audio_fn(states, z):
            mel = mel_fn(states["audio_vae"], z.astype(dtype))
            return wave_fn(states["vocoder"], mel)[0].astype(jnp.float32)

        states = {"audio_vae": self.state("audio_vae"), "vocoder": self.state("vocoder")}
        example = (states, self.arg(a_shape, torch.float32))
        return [StageProgram("decode", audio_fn, example, (tuple(a_shape),), f"LTX-2 audio VAE decode and vocoder "
                             f"for {a_shape[2]} latent audio frames", self.traced, ("audio_vae", "vocoder"),
                             part="audio")]

    # --- two stages: the spatial latent upsampler ----------------------------------------------------------------
    def upsample_programs(self, z_shape: tuple[int, ...]) -> list[StageProgram]:
        """Video latents ``[1, C, F, h, w]`` (de-normalised, as the sampler returns them) through the spatial latent
        upsampler: ``[1, C, F, 2h, 2w]``, still de-normalised (diffusers' ``LTX2LatentUpsamplePipeline`` with its
        defaults: no AdaIN, no tone mapping)."""
        import jax.numpy as jnp

        upsampler = self.component("latent_upsampler")
        upsample_fn = self.runtime.module_function(upsampler)
        dtype = self.model_dtype()

        def upsample(state, z):
            return upsample_fn(state, z.astype(dtype)).astype(jnp.float32)

        example = (self.state("latent_upsampler"), self.arg(z_shape, torch.float32))
        return [StageProgram("upsample", upsample, example, (tuple(z_shape),),
                             f"LTX-2 spatial latent upsampler for {z_shape[2]}x{z_shape[3]}x{z_shape[4]} latents",
                             self.traced, ("latent_upsampler",))]

    # --- plan ----------------------------------------------------------------------------------------------------
    def plan_programs(self, s: SampleSettings) -> list[StageProgram]:
        """Every program one generation with settings ``s`` runs, for ``plan`` to compile."""
        self.check_settings(s)
        passes, _ = self.guidance(s)
        self.check_cfg_mesh(passes.cfg)
        g = self.geometry(s.height, s.width, s.num_frames, self.frame_rate(s))
        a_shape = (1, int(self.audio_vae_config["latent_channels"]), g.audio_frames,
                   int(self.audio_vae_config["mel_bins"]) // 4)
        return [self.encode_program(), self.sample_program(g, passes),
                *self.decode_programs((1, g.channels, g.frames, g.height, g.width)), *self.decode_audio_programs(a_shape)]


def _transformer_call(transformer_fn, dtype, g: "Geometry", image: bool):
    """One call of the whole transformer inside the step: the video and the sound velocities, float32.
    ``isolate``: modality isolation (cross-modal attention off); ``stg_blocks``: self-attention perturbed there."""
    import jax.numpy as jnp

    def call(state, hidden, audio_hidden, video_text, audio_text, timestep, video_coords, audio_coords, keep_mask,
             isolate=False, stg_blocks=None):
        video_timestep = timestep[:, None] * (1 - keep_mask) if image else timestep
        video, audio = transformer_fn(
            state, hidden_states=hidden.astype(dtype), audio_hidden_states=audio_hidden.astype(dtype),
            encoder_hidden_states=video_text, audio_encoder_hidden_states=audio_text, timestep=video_timestep,
            audio_timestep=timestep, sigma=timestep, encoder_attention_mask=None,
            audio_encoder_attention_mask=None, num_frames=g.frames, height=g.height, width=g.width,
            audio_num_frames=g.audio_frames, video_coords=video_coords, audio_coords=audio_coords,
            isolate_modalities=isolate, spatio_temporal_guidance_blocks=list(stg_blocks) if stg_blocks else None,
            perturbation_mask=None, use_cross_timestep=True, return_dict=False)
        return video.astype(jnp.float32), audio.astype(jnp.float32)

    return call


def _rescaled(guided, positive, r, keep):
    """diffusers' rescale_noise_cfg: the guided prediction's std matched to the positive one's (``r`` 0: off)."""
    import jax.numpy as jnp

    axes = tuple(range(1, guided.ndim))
    ratio = jnp.std(positive, axis=axes, keepdims=True, ddof=1) / jnp.std(guided, axis=axes, keepdims=True, ddof=1)
    return jnp.where(r > 0, r * (guided * ratio) + keep * guided, guided)


@dataclass(frozen=True)
class Geometry:
    """One generation's latent sizes: video ``frames`` x ``height`` x ``width`` latents of ``channels`` (the
    transformer's tokens, patch 1), and ``audio_frames`` sound latents of ``audio_channels`` (channels x mel bins,
    packed)."""

    frames: int
    height: int
    width: int
    channels: int
    audio_frames: int
    audio_channels: int

    def describe(self) -> str:
        return f"{self.frames}x{self.height}x{self.width} video latents and {self.audio_frames} audio latents"


def _split_rope(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """diffusers' ``apply_split_rotary_emb`` (the two halves of each head rotated) written without in-place updates:
    traced through torchax, its ``addcmul_`` on a slice of ``out`` never reached ``out`` (the sine terms were
    dropped: the transformer and the connectors came out 0.3-0.85 off)."""
    cos, sin = freqs
    dtype = x.dtype
    reshaped = x.ndim != 4 and cos.ndim == 4
    if reshaped:  # cos is (b, h, t, r): x to (b, h, t, dim per head)
        b, h, t, _ = cos.shape
        x = x.reshape(b, t, h, -1).swapaxes(1, 2)
    half = x.shape[-1] // 2
    x = x.float()
    first, second = x[..., :half], x[..., half:]
    out = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    if reshaped:
        out = out.swapaxes(1, 2).reshape(b, t, -1)
    return out.to(dtype)


def _rope_frequencies(module, count: int, device) -> torch.Tensor:
    """The RoPE frequency vector ``theta ** linspace(0, 1, count) * pi / 2`` as diffusers computes it, on the host:
    in float64 where the module says ``double_precision`` (LTX-2's released configs do), then rounded to float32.
    Traced, JAX (without x64) would take that power in float32: 2.6e-7 relative error where float64 rounded to
    float32 has 6e-8, which the positions multiply up to theta * pi / 2 (15708 rad at theta 1e4): angles up to
    4e-3 rad off where diffusers' float32 run is at most 1e-3 off, and with attention as sharp as a trained model's
    the prompt streams came out 1.5e-5 (relative) from diffusers' float64 run instead of 5e-7."""
    dtype = torch.float64 if module.double_precision else torch.float32
    powers = torch.pow(module.theta, torch.linspace(0.0, 1.0, steps=count, dtype=dtype, device="cpu"))
    return (powers * torch.pi / 2.0).to(torch.float32).to(device)


def _divided(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` rounded as torch rounds it. XLA turns a division by a constant into a multiplication by its
    reciprocal (by 20, LTX-2's base frame count, a fifth of the quotients come out one bit off, which RoPE then
    multiplies by up to 15708 rad); a divisor of x's own shape, computed from x, keeps it a division."""
    return x / (x * 0 + divisor)


def _rope_tables(freqs: torch.Tensor, dim: int, elems: int, rope_type: str, heads: int):
    """(cos, sin) of the angles ``freqs`` [B, T, n] laid out as LTX-2's attention takes them: "interleaved" (each
    value twice, ones/zeros in front up to ``dim``) or "split" ([B, heads, T, dim / 2 / heads], ones/zeros in front
    up to dim / 2). ``elems``: 2 x the position's dimensions."""
    cos, sin = freqs.cos(), freqs.sin()
    if rope_type == "interleaved":
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        pad = dim % elems
    else:
        pad = dim // 2 - cos.shape[-1]
    if pad:
        cos = torch.cat([torch.ones_like(cos[..., :pad]), cos], dim=-1)
        sin = torch.cat([torch.zeros_like(sin[..., :pad]), sin], dim=-1)
    if rope_type == "interleaved":
        return cos, sin
    b, t = cos.shape[:2]
    return (cos.reshape(b, t, heads, -1).swapaxes(1, 2), sin.reshape(b, t, heads, -1).swapaxes(1, 2))


def _connector_rope(self, batch_size: int, pos: int, device):
    """``LTX2RotaryPosEmbed1d.forward`` (the text connectors' positions: token i at i / base_seq_len) with its
    frequencies from ``_rope_frequencies``."""
    grid = _divided(torch.arange(pos, dtype=torch.float32, device=device), self.base_seq_len).unsqueeze(0)
    grid = grid.repeat(batch_size, 1)
    freqs = (grid.unsqueeze(-1) * 2 - 1) * _rope_frequencies(self, self.dim // 2, device)
    return _rope_tables(freqs, self.dim, 2, self.rope_type, self.num_attention_heads)


def _audio_video_rope(self, coords: torch.Tensor, device=None):
    """``LTX2AudioVideoRotaryPosEmbed.forward`` (the transformer's video, sound and cross-modal positions: patch
    midpoints as fractions of the base size) with its frequencies from ``_rope_frequencies``."""
    device = device or coords.device
    dims = coords.shape[1]
    if coords.ndim == 4:  # [start, end) of each patch: its midpoint
        start, end = coords.chunk(2, dim=-1)
        coords = ((start + end) / 2.0).squeeze(-1)
    base = (self.base_num_frames, self.base_height, self.base_width) if self.modality == "video" \
        else (self.base_num_frames,)
    grid = torch.stack([_divided(coords[:, i], base[i]) for i in range(dims)], dim=-1).to(device)
    freqs = (grid.unsqueeze(-1) * 2 - 1) * _rope_frequencies(self, self.dim // (2 * dims), device)
    freqs = freqs.transpose(-1, -2).flatten(2)
    return _rope_tables(freqs, self.dim, 2 * dims, self.rope_type, self.num_attention_heads)


def _timestep_embedding(timesteps: torch.Tensor, embedding_dim: int, flip_sin_to_cos: bool = False,
                        downscale_freq_shift: float = 1, scale: float = 1, max_period: int = 10000) -> torch.Tensor:
    """diffusers' ``get_timestep_embedding`` (sines and cosines of the timestep times ``exp(-ln(max_period) i /
    (half - shift))``) with those frequencies computed on the host by torch, the rest in the same order. diffusers
    takes them in float32 whatever the model's dtype, so its float32 and float64 runs share them bit for bit;
    XLA's exp differs from torch's in the last bit, which timesteps up to 1000 (LTX-2 scales sigma by 1000) turn
    into embeddings 2.9e-5 off."""
    half = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32, device="cpu")
    frequencies = torch.exp(exponent / (half - downscale_freq_shift)).to(timesteps.device)
    angles = scale * (timesteps[:, None].float() * frequencies[None, :])
    embedding = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    if flip_sin_to_cos:
        embedding = torch.cat([embedding[:, half:], embedding[:, :half]], dim=-1)
    if embedding_dim % 2 == 1:
        embedding = torch.nn.functional.pad(embedding, (0, 1, 0, 0))
    return embedding


@contextlib.contextmanager
def _traced_as_diffusers():
    """While tracing LTX-2's programs: the attention processors (the transformer's and the connectors') rotate with
    ``_split_rope`` (they look the function up in their module at every call), and the position and timestep
    embeddings take their frequencies from the host (``_rope_frequencies``, ``_timestep_embedding``)."""
    from diffusers.models import embeddings
    from diffusers.models.transformers import transformer_ltx2
    from diffusers.pipelines.ltx2 import connectors

    patched = ((transformer_ltx2, "apply_split_rotary_emb", _split_rope),
               (transformer_ltx2.LTX2AudioVideoRotaryPosEmbed, "forward", _audio_video_rope),
               (connectors.LTX2RotaryPosEmbed1d, "forward", _connector_rope),
               (embeddings, "get_timestep_embedding", _timestep_embedding))
    originals = [getattr(owner, name) for owner, name, _ in patched]
    for owner, name, replacement in patched:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for (owner, name, _), original in zip(patched, originals):
            setattr(owner, name, original)
