"""Wan's stage programs: the umT5 encode, the image encode (the conditioning video through the VAE, chunk by
chunk, and CLIP vision), one denoising step, the frame-by-frame VAE decode; and the module replacements they are
traced with (attention with RoPE by interleaving, the VAE's upsampling in its input's dtype).

``WanPrograms`` is mixed into ``WanFamily`` (``model.py``): each method builds ``StageProgram``s from the loaded
(or, for ``plan``, abstract) components; the family compiles and runs them.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...engine.compiled import forwards_replaced
from ...engine.runtime import Runtime
from ...engine.schedulers import linear_plan
from ...engine.stages import SampleSettings, StageProgram
from ...engine.streaming import streamed_programs, to_frames
from ...errors import InputError

TEXT_LEN = 512  # diffusers' WanPipeline max_sequence_length


class WanPrograms:
    """The stage programs of a Wan model (mixed into ``WanFamily``)."""

    def encode_program(self) -> StageProgram:
        """umT5 over ``[negative, positive]`` with the attention mask; rows past each prompt set to zeros."""
        import jax.numpy as jnp

        encoder_fn = self.runtime.module_function(self.component("text_encoder"))
        dtype = self.model_dtype()

        def encode_fn(state, ids, mask):
            hidden = encoder_fn(state, ids, attention_mask=mask)[0]
            # Rows from the real length on become exact zeros (diffusers cuts each row at its length and pads).
            return jnp.where(mask[..., None] > 0, hidden, 0).astype(dtype)

        shape = (2, TEXT_LEN)
        example = (self.state("text_encoder"), self.arg(shape, torch.int32), self.arg(shape, torch.int32))
        return StageProgram("encode", encode_fn, example, shape, f"umT5 text encoder for {TEXT_LEN} tokens",
                            self.traced, ("text_encoder",))

    def image_programs(self, height: int, width: int, num_frames: int, images: int = 1) -> list[StageProgram]:
        """The VAE encode of the conditioning video (the first frame, zeros, and the last frame if given; TI2V-5B:
        the first frame alone), normalised by the latent statistics, chunk by chunk as diffusers encodes it (the
        first frame, then 4 frames at a time, the causal caches carried between: the streamed programs of
        ``engine/streaming.py``; ``decode_loop = "unrolled"``: one program over every frame). Then CLIP vision over
        ``images`` pictures (its second-to-last hidden states) where the model attends to them."""
        import jax.numpy as jnp

        vae = self.component("vae")
        mean, std_inv = (jnp.asarray(t.numpy()) for t in self._latent_statistics())
        frames = 1 if self.expand_timesteps else num_frames
        t = self.vae_scale_temporal
        chunks = 1 + (frames - 1) // t

        def normalised(latents):
            return (latents.astype(jnp.float32) - mean) * std_inv

        def later_chunk(index, last=None):
            """Pixel frames [1, 3, 4, H, W] of chunk ``index`` >= 1 (a Python int, or traced): zeros, with the last
            picture at the video's end."""
            zeros = jnp.zeros((1, 3, t, height, width), self.model_dtype())
            if last is None:
                return zeros
            final = jnp.where(index == chunks - 1, last, jnp.zeros_like(last))
            return jnp.concatenate([zeros[:, :, :t - 1], final], axis=2)

        scope = self.traced(lambda: _wan_vae_for_xla(vae))
        pixel = self.arg((1, 3, 1, height, width), self.dtype)
        example = (self.state("vae"), pixel, *([pixel] if images == 2 else []))
        what = f"Wan VAE encode of the image(s) for {num_frames}x{height}x{width}"
        key = (height, width, frames, images, self._resolved_decode_loop())
        if self._resolved_decode_loop() == "unrolled" or chunks == 1:
            encode_fn = self.runtime.module_function(vae, lambda module, video: module.encode(video).latent_dist.mode())

            def condition_fn(state, first, *last):
                video = first
                if frames > 1:
                    gap = frames - 1 - len(last)
                    video = jnp.concatenate([first, jnp.zeros(first.shape[:2] + (gap,) + first.shape[3:],
                                                              first.dtype), *last], axis=2)
                return normalised(encode_fn(state, video))

            programs = [StageProgram("image", condition_fn, example, key, what, scope, ("vae",))]
        else:
            step = _encode_function(self.runtime, vae)

            def chunk(state, pictures, index, caches):
                first, *last = pictures
                pixels = first if isinstance(index, int) and index == 0 else later_chunk(index, *last)
                return step(state, pixels, caches)

            programs = streamed_programs(self, stage="image", what=what, key=key, scope=scope, components=("vae",),
                                         example=example, chunks=chunks, prepare=lambda state, *pictures: pictures,
                                         chunk=chunk, finish=normalised,
                                         later=("chunk", f"each later chunk of {t} frames"))
        if self.uses_clip:
            clip = self.component("image_encoder")
            size = int(self.image_encoder_config.get("image_size", 224))

            def features(module, pixels):
                return module(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]

            clip_fn = self.runtime.module_function(clip, features)
            example = (self.state("image_encoder"), self.arg((images, 3, size, size), torch.float32))
            programs.append(StageProgram("image", clip_fn, example, (images, size), f"CLIP vision over {images} "
                                         "image(s)", self.traced, ("image_encoder",), part="clip"))
        return programs

    def sample_program(self, height: int, width: int, num_frames: int, cfg: bool, plan, image: str = "",
                       images: int = 0) -> StageProgram:
        """One denoising step for the scheduler ``plan`` (a ``LinearStepPlan``): CFG batch, transformer, guidance
        and the update as a small coefficient matrix. Wan 2.2's experts share it: same architecture and shapes,
        only the weights passed differ. ``image`` (see ``_image_mode``): how the image's condition enters;
        ``images``: how many pictures' CLIP features the transformer attends to (0: none)."""
        import jax
        import jax.numpy as jnp

        shape = self.latent_shape(height, width, num_frames)
        transformer_fn = self.runtime.module_function(self.component("transformer"))
        model_dtype = self.model_dtype()
        batch_sharding = self.runtime.sharding(self.mesh, ("dp",))
        replicated = self.runtime.sharding(self.mesh)
        kept, round_result = plan.kept, plan.round_to_model_dtype
        patch = tuple(int(p) for p in self.transformer_config["patch_size"])

        frame_tokens = (shape[3] // patch[1]) * (shape[4] // patch[2])
        tokens = (shape[2] // patch[0]) * frame_tokens

        def step_fn(state, x, kept_arrays, embeds, timestep, matrix, g, condition, image_embeds):
            if image == "concat":  # diffusers: cat([latents, mask + condition], dim=1) in the model's dtype
                xin = jnp.concatenate([x, condition], axis=1).astype(model_dtype)
            elif image == "first":  # the first latent frame is the image's
                xin = jnp.concatenate([condition[:, :, :1], x[:, :, 1:]], axis=2).astype(model_dtype)
            else:
                xin = x.astype(model_dtype)
            batch = jnp.concatenate([xin, xin]) if cfg else xin
            batch = jax.lax.with_sharding_constraint(batch, batch_sharding)  # CFG's two halves on dp
            if image == "first":  # per-token timesteps, 0 on the image frame's tokens
                t = jnp.concatenate([jnp.zeros((frame_tokens,), jnp.float32),
                                     jnp.broadcast_to(timestep, (tokens - frame_tokens,))])
                t = jnp.broadcast_to(t[None], (batch.shape[0], tokens))
            else:
                t = jnp.broadcast_to(timestep, (batch.shape[0],))
            out = transformer_fn(state, batch, t, embeds, encoder_hidden_states_image=image_embeds,
                                 return_dict=False)[0]
            if cfg:
                uncond, cond = jnp.split(out.astype(jnp.float32), 2)
                out = (uncond + g[0] * (cond - uncond)).astype(model_dtype)
            inputs = [x, out.astype(jnp.float32), *kept_arrays]
            rows = [sum(matrix[r, c] * inputs[c] for c in range(len(inputs))) for r in range(1 + kept)]
            if round_result:  # the scheduler casts its result to the model output's dtype
                rows[0] = rows[0].astype(model_dtype).astype(jnp.float32)
            # Outputs come back as the next step's inputs: keep them where the inputs are (replicated).
            return (jax.lax.with_sharding_constraint(rows[0], replicated),
                    tuple(jax.lax.with_sharding_constraint(r, replicated) for r in rows[1:]))

        embeds_shape = (2 if cfg else 1, TEXT_LEN, int(self.transformer_config["text_dim"]))
        arg, f32 = self.arg, torch.float32
        condition = None
        if image == "concat":
            condition = arg((1, self.vae_scale_temporal + shape[1]) + shape[2:], f32)
        elif image == "first":
            condition = arg((1, shape[1], 1) + shape[3:], f32)
        image_embeds = None
        if images:
            c = self.image_encoder_config
            patches = (int(c.get("image_size", 224)) // int(c["patch_size"])) ** 2 + 1
            image_embeds = arg(((2 if cfg else 1) * images, patches, int(c["hidden_size"])), self.dtype, ("dp",))
        example = (self.state("transformer"), arg(shape, f32), tuple(arg(shape, f32) for _ in range(kept)),
                   arg(embeds_shape, self.dtype, ("dp",)), arg((1,), f32), arg(plan.matrices[0].shape, f32),
                   arg((1,), f32), condition, image_embeds)
        key = (shape, embeds_shape, cfg, kept, round_result, image, images, self.attention)
        return StageProgram("sample", step_fn, example, key,
                            f"Wan sampler step for {num_frames}x{height}x{width} ({'CFG batch 2' if cfg else 'no CFG'}"
                            f", mesh {self.mesh_spec}, {self.attention.impl} attention)", self.traced,
                            tuple(["transformer"] + (["transformer_2"] if self.two_experts else [])))

    def plan_programs(self, s: SampleSettings) -> list[StageProgram]:
        """Every program one generation with settings ``s`` runs, for ``plan`` to compile."""
        self.check_settings(s)
        cfg = self.uses_cfg(s)
        self.check_cfg_mesh(cfg)
        plan = linear_plan(self.scheduler(s.scheduler, s.options.get("shift")), s.steps)
        images, mode, pictures = [], "", 0
        if self.image_input == "required":  # image-to-video: its image encode and the conditioned step
            pictures = 2 if self.last_image_input else 1
            images = self.image_programs(s.height, s.width, s.num_frames, pictures)
            mode, pictures = ("concat" if self.concat_condition else "first"), pictures if self.uses_clip else 0
        return [self.encode_program(), *images,
                self.sample_program(s.height, s.width, s.num_frames, cfg, plan, mode, pictures),
                *self.decode_programs(self.latent_shape(s.height, s.width, s.num_frames))]

    #: How diffusers' per-frame causal decode runs. "frames" (the default): the streamed programs of
    #: ``engine/streaming.py``, the first two latent frames and one later frame called once per frame. "unrolled":
    #: one program holding a copy of the decoder per latent frame; its compile grows with the frames, and the TPU
    #: compiler keeps far more than one frame's activations live (the Wan 2.1 VAE at 480x832x81 needed 32 GB a
    #: chip). The image encode of the conditioning video follows the same choice (chunks of 4 frames in place of
    #: latent frames).
    decode_loop = "frames"

    def _resolved_decode_loop(self, loop: str | None = None) -> str:
        loop = loop or self.decode_loop
        if loop not in ("unrolled", "frames"):
            raise InputError(f"decode_loop {loop!r} is not one of frames, unrolled")
        return loop

    def decode_programs(self, z_shape: tuple[int, ...], loop: str | None = None) -> list[StageProgram]:
        """The programs that de-normalise latents ``[1, C, T, h, w]`` and decode them, one latent frame at a time
        as diffusers does, to frames ``[F, H, W, 3]`` in 0..1: one program (``loop`` "unrolled"), or the first two
        frames' program and, for T > 2, the later frames' program ("frames"; None: ``decode_loop``)."""
        import jax

        vae = self.component("vae")
        loop = self._resolved_decode_loop(loop)
        dtype = self.model_dtype()
        scope = self.traced(lambda: _wan_vae_for_xla(vae))
        stats = (1, z_shape[1], 1, 1, 1)
        f32 = torch.float32
        example = (self.state("vae"), self.arg(z_shape, f32, self.vae_input_spec(z_shape)), self.arg(stats, f32),
                   self.arg(stats, f32))
        frames = (z_shape[2] - 1) * self.vae_scale_temporal + 1
        height, width = z_shape[3] * self.vae_scale_spatial, z_shape[4] * self.vae_scale_spatial
        what = f"Wan VAE decode for {frames}x{height}x{width}"
        key = (tuple(z_shape), self.vae_sharding, loop)
        if loop == "unrolled":
            decode_fn = self.runtime.module_function(vae, "decode")

            def frames_fn(state, z, mean, std_inv):
                z = (z / std_inv + mean).astype(dtype)  # diffusers: latents / (1 / std) + mean
                return to_frames(decode_fn(state, z, return_dict=False)[0])

            return [StageProgram("decode", frames_fn, example, key, what, scope, ("vae",))]

        post_quant, step = _frame_functions(self.runtime, vae)
        steady = min(z_shape[2], 2) - 1  # after this frame every cache must be a tensor

        def prepare(state, z, mean, std_inv):
            return post_quant(state, (z / std_inv + mean).astype(dtype))  # diffusers: latents / (1 / std) + mean

        def chunk(state, x, index, caches):
            if not isinstance(index, int):
                return step(state, jax.lax.dynamic_slice_in_dim(x, index, 1, axis=2), caches, False)
            out, caches = step(state, x[:, :, index:index + 1], caches, index == 0)
            if index == steady and not all(c is None or isinstance(c, jax.Array) for c in caches):
                raise RuntimeError("the Wan VAE's causal caches are not all tensors after two frames: decode it "
                                   "unrolled (decode_loop = 'unrolled')")
            return out, caches

        return streamed_programs(self, stage="decode", what=what, key=key, scope=scope, components=("vae",),
                                 example=example, chunks=z_shape[2], prepare=prepare, chunk=chunk, finish=to_frames,
                                 later=("frame", "each later latent frame"))


def _frame_functions(runtime: Runtime, vae: torch.nn.Module) -> tuple[Callable, Callable]:
    """Over jax values: ``post_quant(state, z)`` and ``step(state, x_frame, caches, first_chunk) -> (pixels,
    caches)``, one latent frame of diffusers' causal decode (``vae._decode``'s loop body) with its conv caches as
    explicit values (``None`` before the first frame)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify

    cache_count = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())

    def frame(module, x, caches, first_chunk):
        feat = list(caches) if caches is not None else [None] * cache_count
        out = module.decoder(x, feat_cache=feat, feat_idx=[0], first_chunk=first_chunk)
        if module.config.patch_size is not None:
            out = unpatchify(out, patch_size=module.config.patch_size)
        return torch.clamp(out, min=-1.0, max=1.0), feat

    post_quant = runtime.module_function(vae, lambda module, z: module.post_quant_conv(z))
    return post_quant, runtime.module_function(vae, frame)


def _encode_function(runtime: Runtime, vae: torch.nn.Module) -> Callable:
    """Over jax values: ``step(state, pixels, caches) -> (latents, caches)``, one chunk of diffusers' causal
    encode (``vae._encode``'s loop body: the first frame, or 4 frames) with its conv caches as explicit values
    (``None`` before the first chunk), then ``quant_conv`` (1x1x1, so per chunk is the same) and the posterior's
    mode (its mean)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, patchify

    cache_count = sum(isinstance(m, WanCausalConv3d) for m in vae.encoder.modules())

    def chunk(module, pixels, caches):
        feat = list(caches) if caches is not None else [None] * cache_count
        if module.config.patch_size is not None:
            pixels = patchify(pixels, patch_size=module.config.patch_size)
        out = module.quant_conv(module.encoder(pixels, feat_cache=feat, feat_idx=[0]))
        return out[:, :out.shape[1] // 2], feat

    return runtime.module_function(vae, chunk)


def _wan_vae_for_xla(vae: torch.nn.Module):
    """While tracing the Wan VAE: its nearest-neighbour upsampling runs in the input's dtype. diffusers upsamples
    in float32 and casts back, which is the same numbers (nearest only copies values); traced through torchax in
    bfloat16, the cast-back tensor reached the next convolution as float32 and stopped the trace."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanUpsample

    def replacement(module):
        return torch.nn.Upsample.forward.__get__(module) if isinstance(module, WanUpsample) else None

    return forwards_replaced(vae, replacement)


# --- transformer attention -------------------------------------------------------------------------------------
class WanFunctionalAttnProcessor:
    """Wan attention as diffusers' ``WanAttnProcessor`` computes it, with RoPE applied by interleaving (stack)
    instead of strided writes into ``empty_like`` (XLA:CPU miscompiled the in-place form of the same pattern
    in CogVideoX; this form is exact and writes no large activation in place), and attention through
    ``F.scaled_dot_product_attention``, which the runtime overrides."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        import torch.nn.functional as F

        image_states = None
        if attn.add_k_proj is not None and encoder_hidden_states is not None:
            image_len = encoder_hidden_states.shape[1] - TEXT_LEN  # diffusers hard-codes 512 text tokens too
            image_states = encoder_hidden_states[:, :image_len]
            encoder_hidden_states = encoder_hidden_states[:, image_len:]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))  # [B, L, H, D]
        if rotary_emb is not None:
            q, k = _rope(q, *rotary_emb), _rope(k, *rotary_emb)

        def sdpa(q, k, v):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
            return out.transpose(1, 2).flatten(2, 3).type_as(q)

        out = sdpa(q, k, v)
        if image_states is not None:
            k_img = attn.norm_added_k(attn.add_k_proj(image_states)).unflatten(2, (attn.heads, -1))
            v_img = attn.add_v_proj(image_states).unflatten(2, (attn.heads, -1))
            out = out + sdpa(q, k_img, v_img)
        return attn.to_out[1](attn.to_out[0](out))


def _rope(x, cos, sin):
    """diffusers' Wan RoPE (pairs (x[2i], x[2i+1]) rotated) written as one stack instead of strided stores."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)
