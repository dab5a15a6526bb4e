"""CogVideoX's stage programs: the T5 encode, the first frame's VAE encode, one denoising step, the batched VAE
decode; and the module replacements they are traced with (attention with RoPE by concatenation, plain
convolutions in the VAE, an optional ``jnp.var`` GroupNorm).

``CogVideoXPrograms`` is mixed into ``CogVideoXFamily`` (``model.py``): each method builds ``StageProgram``s from
the loaded (or, for ``plan``, abstract) components; the family compiles and runs them.
"""

from __future__ import annotations

import torch

from ...engine.compiled import forwards_replaced
from ...engine.stages import SampleSettings, StageProgram
from ...engine.streaming import streamed_programs, to_frames
from ...errors import InputError
from .schedule import COGVIDEOX_COEFFS
_C_SAMPLE, _C_MODEL, _C_DIV, _A, _M1, _P, _Q, _D, _GUIDANCE = range(len(COGVIDEOX_COEFFS))


class CogVideoXPrograms:
    """The stage programs of a CogVideoX model (mixed into ``CogVideoXFamily``)."""

    def encode_program(self) -> StageProgram:
        """T5 over token ids ``[negative, positive]`` padded to the transformer's text length."""
        encoder_fn = self.runtime.module_function(self.component("text_encoder"))
        dtype = self.model_dtype()

        def encode_fn(state, ids):
            return encoder_fn(state, ids)[0].astype(dtype)

        shape = (2, self.text_len)
        return StageProgram("encode", encode_fn, (self.state("text_encoder"), self.arg(shape, torch.int32)),
                            (self.dtype_name, shape), f"T5 text encoder for {self.text_len} tokens", self.traced,
                            ("text_encoder",))

    def image_programs(self, height: int, width: int, num_frames: int, images: int = 1) -> list[StageProgram]:
        """The VAE encoder over the first frame ``[1, 3, 1, H, W]``: the posterior's mean and std
        ``[1, C, 1, h, w]``."""
        vae = self.component("vae")
        vae.use_tiling = False

        def posterior(module, pixels):
            dist = module.encode(pixels).latent_dist
            return dist.mean, dist.std

        encode_fn = self.runtime.module_function(vae, posterior)
        example = (self.state("vae"), self.arg((1, 3, 1, height, width), self.dtype))
        return [StageProgram("image", encode_fn, example, (self.dtype_name, height, width),
                             f"VAE encode of the first frame at {width}x{height}",
                             self.traced(lambda: _vae_for_xla(vae, "stock")), ("vae",))]

    def sample_program(self, height: int, width: int, num_frames: int, cfg: bool) -> StageProgram:
        """One denoising step: CFG batch, transformer, guidance and the scheduler update, coefficients as arrays.
        Image-to-video: the image latents concatenated on channels (and CogVideoX1.5's ``ofs``)."""
        import jax
        import jax.numpy as jnp

        shape, _ = self.latent_shape(height, width, num_frames)
        transformer_fn = self.runtime.module_function(self.component("transformer"))
        model_dtype = self.model_dtype()
        batch_sharding = self.runtime.sharding(self.mesh, ("dp",))
        replicated = self.runtime.sharding(self.mesh)

        def step_fn(state, latents, embeds, timestep, coeffs, noise, old_x0, rope, image_latents, ofs):
            x = latents if image_latents is None else jnp.concatenate([latents, image_latents], axis=2)
            x = jnp.concatenate([x, x]) if cfg else x
            x = jax.lax.with_sharding_constraint(x, batch_sharding)  # CFG's two halves on dp
            t = jnp.broadcast_to(timestep, (x.shape[0],))
            out = transformer_fn(state, x, embeds, t, ofs=ofs, image_rotary_emb=rope, return_dict=False)[0]
            out = out.astype(jnp.float32)
            if cfg:
                uncond, text = jnp.split(out, 2)
                out = uncond + coeffs[_GUIDANCE] * (text - uncond)
            x0 = (coeffs[_C_SAMPLE] * latents - coeffs[_C_MODEL] * out) / coeffs[_C_DIV]
            prev = coeffs[_A] * latents - coeffs[_M1] * (coeffs[_P] * x0 - coeffs[_Q] * old_x0)
            prev = prev + coeffs[_D] * noise
            # Outputs come back as the next step's inputs: keep them where the inputs are (replicated).
            return (jax.lax.with_sharding_constraint(prev.astype(model_dtype), replicated),
                    jax.lax.with_sharding_constraint(x0, replicated))

        embeds_shape = (2 if cfg else 1, self.text_len, int(self.transformer_config["text_embed_dim"]))
        rope = self._rotary_embeddings(height, width, shape[1])
        arg = self.arg
        example = (self.state("transformer"), arg(shape, self.dtype), arg(embeds_shape, self.dtype, ("dp",)),
                   arg((1,), torch.int32), arg((len(COGVIDEOX_COEFFS),), torch.float32), arg(shape, self.dtype),
                   arg(shape, torch.float32), tuple(arg(t.shape, t.dtype) for t in rope) if rope else None,
                   arg(shape, self.dtype) if self.image_input != "none" else None,
                   arg((1,), self.dtype) if self._has_ofs() else None)
        key = (self.generation, self.dtype_name, cfg, shape, embeds_shape, self.image_input, self.attention)
        return StageProgram("sample", step_fn, example, key,
                            f"sampler step for {num_frames}x{height}x{width} ({'CFG batch 2' if cfg else 'no CFG'},"
                            f" mesh {self.mesh_spec}, {self.attention.impl} attention)", self.traced,
                            ("transformer",))

    def plan_programs(self, s: SampleSettings) -> list[StageProgram]:
        """Every program one generation with settings ``s`` runs, for ``plan`` to compile."""
        self.check_settings(s)
        cfg = self.uses_cfg(s)
        self.check_cfg_mesh(cfg)
        shape, pad = self.latent_shape(s.height, s.width, s.num_frames)
        z_shape = (1, self.latent_channels(), shape[1] - pad, shape[3], shape[4])
        image = self.image_programs(s.height, s.width, s.num_frames) if self.image_input != "none" else []
        return [self.encode_program(), *image, self.sample_program(s.height, s.width, s.num_frames, cfg),
                *self.decode_programs(z_shape)]

    #: How diffusers' batched decode runs (``vae._decode``: two latent frames at a time, the first batch taking the
    #: odd frame too, the causal convolutions' caches carried from batch to batch). "batches" (the default): the
    #: streamed programs of ``engine/streaming.py``, the first two batches and one later batch called once per
    #: batch. "unrolled": one program holding a copy of the decoder per batch. VAE tiling (diffusers' tiled
    #: decode, its own loop over tiles and batches) is always one program.
    decode_loop = "batches"

    def decode_programs(self, z_shape: tuple[int, ...], tiling: bool = False, group_norm: str = "stock",
                        loop: str | None = None) -> list[StageProgram]:
        """The programs that decode latents ``[1, C, T, h, w]`` to frames ``[F, H, W, 3]`` in 0..1: one program
        (tiling, ``loop`` "unrolled" or up to two batches), or the first two batches' program and the later
        batches' program (``loop`` "batches"; None: ``decode_loop``)."""
        import jax

        loop = loop or self.decode_loop
        if loop not in ("unrolled", "batches"):
            raise InputError(f"decode_loop {loop!r} is not one of batches, unrolled")
        vae = self.component("vae")
        vae.use_tiling = bool(tiling)
        scaling = float(self.vae_config.get("scaling_factor", 1.15258426))
        frames = (z_shape[2] - 1) * self.vae_scale_temporal + 1
        height, width = z_shape[3] * self.vae_scale_spatial, z_shape[4] * self.vae_scale_spatial
        what = f"VAE decode for {frames}x{height}x{width}"
        example = (self.state("vae"), self.arg(z_shape, self.dtype, self.vae_input_spec(z_shape)))
        key = (self.dtype_name, tuple(z_shape), bool(tiling), group_norm, self.vae_sharding)
        scope = self.traced(lambda: _vae_for_xla(vae, group_norm))
        starts = self._batch_starts(z_shape[2])
        if tiling or loop == "unrolled" or len(starts) <= 2:
            decode_fn = self.runtime.module_function(vae, "decode")

            def frames_fn(state, z):
                return to_frames(decode_fn(state, (1 / scaling) * z, return_dict=False)[0])

            return [StageProgram("decode", frames_fn, example, key, what, scope, ("vae",))]

        batch = self.runtime.module_function(vae, _decode_batch)
        size = int(vae.num_latent_frames_batch_size)
        bounds = list(zip(starts[:2], (starts + [z_shape[2]])[1:3]))  # the first two batches

        def chunk(state, z, index, caches):
            if isinstance(index, int):  # one of the first two batches (the first takes the odd frame)
                begin, end = bounds[index]
                return batch(state, z[:, :, begin:end], caches)
            return batch(state, jax.lax.dynamic_slice_in_dim(z, index, size, axis=2), caches)

        return streamed_programs(self, stage="decode", what=what, key=key, scope=scope, components=("vae",),
                                 example=example, chunks=len(starts), prepare=lambda state, z: (1 / scaling) * z,
                                 chunk=chunk, finish=to_frames,
                                 later=("batch", f"each later batch of {size} latent frames"))


def _decode_batch(module, z, conv_cache):
    """One batch of diffusers' ``AutoencoderKLCogVideoX._decode`` loop: latents (already divided by the scaling
    factor) to pixels in -1..1, with the causal convolutions' caches in and out (``None`` before the first)."""
    if module.post_quant_conv is not None:
        z = module.post_quant_conv(z)
    return module.decoder(z, conv_cache=conv_cache)


# --- transformer attention -------------------------------------------------------------------------------------
class CogVideoXFunctionalAttnProcessor:
    """CogVideoX joint text+video attention, as diffusers' CogVideoXAttnProcessor2_0 computes it, but with RoPE
    applied by concatenation instead of writing into a slice of q/k in place.

    Why: XLA:CPU (jaxlib 0.10.2) miscompiles the in-place form (a scatter or dynamic-update-slice into the
    layer-normed, head-transposed q) followed by attention at batch 1, i.e. sampling without CFG: errors of
    order 1 while the same program run op by op is exact. The concatenated form is exact and, on TPU, avoids an
    in-place update of a large activation.
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        import torch.nn.functional as F
        from diffusers.models.embeddings import apply_rotary_emb

        text_len = encoder_hidden_states.size(1)
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch, length, _ = x.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, length, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        head_dim = k.shape[-1] // attn.heads
        q, k, v = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None:
            q = torch.cat([q[:, :, :text_len], apply_rotary_emb(q[:, :, text_len:], image_rotary_emb)], dim=2)
            if not attn.is_cross_attention:
                k = torch.cat([k[:, :, :text_len], apply_rotary_emb(k[:, :, text_len:], image_rotary_emb)], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)
        out = attn.to_out[1](attn.to_out[0](out))
        return out[:, text_len:], out[:, :text_len]


# --- VAE adjustments for XLA -----------------------------------------------------------------------------------
def _vae_for_xla(vae: torch.nn.Module, group_norm: str):
    """While tracing the VAE: plain Conv3d instead of CogVideoXSafeConv3d's cuDNN splitting, and optionally a
    vectorised ``jnp.var`` GroupNorm instead of torchax's stock lowering."""
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXSafeConv3d

    def replacement(module):
        if isinstance(module, CogVideoXSafeConv3d):
            return torch.nn.Conv3d.forward.__get__(module)
        if isinstance(module, torch.nn.GroupNorm) and group_norm == "jnp_var":
            return _var_group_norm_forward(module)
        return None

    return forwards_replaced(vae, replacement)


def group_norm_jnp_var(x, weight, bias, groups: int, eps: float):
    """GroupNorm over ``[B, C, ...]`` as one vectorised ``jnp.mean``/``jnp.var`` reduction (``group_norm
    jnp_var``: measured against torchax's own lowering by ``bench``)."""
    import jax.numpy as jnp

    b, c = x.shape[:2]
    grouped = x.reshape((b, groups, -1))
    mean = jnp.mean(grouped, axis=-1, keepdims=True)
    var = jnp.var(grouped, axis=-1, keepdims=True)
    out = ((grouped - mean) / jnp.sqrt(var + eps)).reshape(x.shape)
    affine = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(affine)
    if bias is not None:
        out = out + bias.reshape(affine)
    return out


def _var_group_norm_forward(module: torch.nn.GroupNorm):
    from torchax.interop import call_jax

    def forward(x):
        return call_jax(group_norm_jnp_var, x, module.weight, module.bias, module.num_groups, module.eps)

    return forward
