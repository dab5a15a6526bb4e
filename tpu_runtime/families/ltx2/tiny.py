"""Tiny random-weight LTX-2 models (2.0 and 2.3), saved as real diffusers folders with every component
``LTX2Pipeline`` loads (Gemma 3 and its tokenizer included), and the spatial latent upsampler beside them.

The blocks are laid out as in the released models (the video VAE compresses 32x in space and 8x in time, the
audio VAE 4x, the vocoders upsample to their sample rates; 2.3's gated and perturbed attention, per-modality text
projections and band-extending vocoder), only narrow and two layers deep, so every code path of the real models
runs here in seconds.
"""

from __future__ import annotations

import math
import string
from pathlib import Path

from ...engine.tiny import exact, finish, write_tiny_lora

LTX2_GENERATIONS = ("2.0", "2.3")

GEMMA = dict(hidden=48, layers=2, vocab=320, heads=2, kv_heads=1, head_dim=16)
VIDEO_HEADS, VIDEO_HEAD_DIM, AUDIO_HEADS, AUDIO_HEAD_DIM = 2, 16, 2, 8
LATENT, AUDIO_LATENT, MEL_BINS, REGISTERS = 8, 4, 16, 8


def gemma_config(layers: int = GEMMA["layers"]) -> dict:
    """A Gemma 3 (``Gemma3ForConditionalGeneration``) config: a tiny text model with the 12B's layer pattern (a
    sliding-window layer, then a full one with linear RoPE scaling) and a one-layer vision tower, which LTX-2 never
    runs but the class has."""
    return dict(
        text_config=dict(
            vocab_size=GEMMA["vocab"], hidden_size=GEMMA["hidden"], intermediate_size=96, num_hidden_layers=layers,
            num_attention_heads=GEMMA["heads"], num_key_value_heads=GEMMA["kv_heads"], head_dim=GEMMA["head_dim"],
            query_pre_attn_scalar=GEMMA["head_dim"], sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
            max_position_embeddings=2048, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=GEMMA["vocab"] - 1, boi_token_index=GEMMA["vocab"] - 3,
        eoi_token_index=GEMMA["vocab"] - 2)


def transformer_config(generation: str, layers: int = 2, spatial: int = 32) -> dict:
    v23 = generation == "2.3"
    return dict(
        in_channels=LATENT, out_channels=LATENT, patch_size=1, patch_size_t=1, num_attention_heads=VIDEO_HEADS,
        attention_head_dim=VIDEO_HEAD_DIM, cross_attention_dim=VIDEO_HEADS * VIDEO_HEAD_DIM,
        vae_scale_factors=(8, spatial, spatial),
        audio_in_channels=AUDIO_LATENT * MEL_BINS // 4, audio_out_channels=AUDIO_LATENT * MEL_BINS // 4,
        audio_num_attention_heads=AUDIO_HEADS, audio_attention_head_dim=AUDIO_HEAD_DIM,
        audio_cross_attention_dim=AUDIO_HEADS * AUDIO_HEAD_DIM, num_layers=layers, caption_channels=GEMMA["hidden"],
        rope_type="split", rope_double_precision=True, gated_attn=v23, cross_attn_mod=v23, audio_gated_attn=v23,
        audio_cross_attn_mod=v23, use_prompt_embeddings=not v23, perturbed_attn=v23)


def connectors_config(generation: str) -> dict:
    common = dict(caption_channels=GEMMA["hidden"], text_proj_in_factor=GEMMA["layers"] + 1,
                  video_connector_num_layers=1, audio_connector_num_layers=1, rope_type="split",
                  video_connector_num_learnable_registers=REGISTERS, audio_connector_num_learnable_registers=REGISTERS,
                  rope_double_precision=True)
    if generation == "2.0":  # both connectors as wide as Gemma, one projection shared
        return dict(common, video_connector_num_attention_heads=3, video_connector_attention_head_dim=16,
                    audio_connector_num_attention_heads=3, audio_connector_attention_head_dim=16,
                    per_modality_projections=False, proj_bias=False)
    return dict(common, video_connector_num_attention_heads=VIDEO_HEADS, video_connector_attention_head_dim=VIDEO_HEAD_DIM,
                audio_connector_num_attention_heads=AUDIO_HEADS, audio_connector_attention_head_dim=AUDIO_HEAD_DIM,
                video_gated_attn=True, audio_gated_attn=True, per_modality_projections=True,
                video_hidden_dim=VIDEO_HEADS * VIDEO_HEAD_DIM, audio_hidden_dim=AUDIO_HEADS * AUDIO_HEAD_DIM, proj_bias=True)


def vae_config(generation: str, spatial: int = 32) -> dict:
    """The video VAE: 8x in time, ``spatial`` (32 as released, or 16) in space, its patchify taking the
    difference."""
    if spatial not in (16, 32):
        raise ValueError(f"spatial compression {spatial}: the tiny VAE compresses 16x or 32x")
    config = dict(
        in_channels=3, out_channels=3, latent_channels=LATENT, block_out_channels=(8, 16, 32, 64),
        decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"), upsample_residual=(True, True, True),
        upsample_factor=(2, 2, 2), timestep_conditioning=False, patch_size=4, patch_size_t=1, encoder_causal=True,
        decoder_causal=False, encoder_spatial_padding_mode="zeros", decoder_spatial_padding_mode="reflect",
        spatial_compression_ratio=32, temporal_compression_ratio=8)
    config.update(patch_size=spatial // 8, spatial_compression_ratio=spatial)
    if generation == "2.3":
        config.update(block_out_channels=(8, 16, 32, 32), decoder_block_out_channels=(16, 32, 32, 64),
                      decoder_layers_per_block=(1, 1, 1, 1, 1), decoder_spatio_temporal_scaling=(True, True, True, True),
                      decoder_inject_noise=(False,) * 5, upsample_type=("spatiotemporal", "spatiotemporal", "temporal",
                                                                        "spatial"),
                      upsample_residual=(False,) * 4, upsample_factor=(2, 2, 1, 2), decoder_spatial_padding_mode="zeros")
    return config


AUDIO_VAE = dict(base_channels=AUDIO_LATENT * MEL_BINS // 4, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1,
                 attn_resolutions=None, in_channels=2, resolution=32, latent_channels=AUDIO_LATENT, norm_type="pixel",
                 causality_axis="height", dropout=0.0, mid_block_add_attention=False, sample_rate=16000,
                 mel_hop_length=160, is_causal=True, mel_bins=MEL_BINS, double_z=True)
VOCODER_20 = dict(in_channels=2 * MEL_BINS, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4],
                  upsample_factors=[2, 2], resnet_kernel_sizes=[3, 5], resnet_dilations=[[1, 3], [1, 3]],
                  act_fn="leaky_relu", leaky_relu_negative_slope=0.1, antialias=False, final_act_fn="tanh",
                  final_bias=True, output_sampling_rate=24000)
VOCODER_23 = dict(in_channels=2 * MEL_BINS, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4],
                  upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]], act_fn="snakebeta",
                  antialias=True, antialias_ratio=2, antialias_kernel_size=12, final_act_fn=None, final_bias=False,
                  bwe_in_channels=16, bwe_hidden_channels=16, bwe_out_channels=2, bwe_upsample_kernel_sizes=[5, 4, 4],
                  bwe_upsample_factors=[3, 2, 2], bwe_resnet_kernel_sizes=[3], bwe_resnet_dilations=[[1, 3]],
                  bwe_act_fn="snakebeta", bwe_antialias=True, bwe_final_act_fn=None, bwe_final_bias=False,
                  filter_length=16, hop_length=4, window_length=16, num_mel_channels=8, input_sampling_rate=16000,
                  output_sampling_rate=48000)
UPSAMPLER = dict(in_channels=LATENT, mid_channels=32, num_blocks_per_stage=1, dims=3, spatial_upsample=True,
                 temporal_upsample=False, rational_spatial_scale=2.0, use_rational_resampler=True)
# The released schedulers (diffusers' LTX-2 conversion script): dynamic shifting from the video token count.
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                 base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1, time_shift_type="exponential")


def build_tokenizer(directory: Path) -> None:
    """A Gemma tokenizer as LTX-2 uses it (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2 prepended), over bytes and letters:
    every prompt tokenizes, one piece per character."""
    from transformers import GemmaTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁" + string.ascii_lowercase:
        vocab[ch] = len(vocab)
    tokenizer = GemmaTokenizerFast(vocab=vocab, merges=[], add_bos_token=True, add_eos_token=False)
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(directory)


def _fill_bwe_buffers(vocoder) -> None:
    """The band-extension's STFT and mel buffers are zeros until a checkpoint fills them: a Hann-windowed DFT basis
    and a random non-negative filterbank, so the branch sees real spectra."""
    import torch

    stft = vocoder.mel_stft.stft_fn
    n_fft = stft.forward_basis.shape[-1]
    t = torch.arange(n_fft, dtype=torch.float64)
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)[:, None]
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
    real, imag = torch.cos(2 * math.pi * k * t / n_fft) * window, -torch.sin(2 * math.pi * k * t / n_fft) * window
    with torch.no_grad():
        stft.forward_basis.copy_(torch.cat([real, imag], 0)[:, None, :].float())
        vocoder.mel_stft.mel_basis.copy_(exact(torch.rand_like(vocoder.mel_stft.mel_basis), False))


def build_tiny_ltx2(directory: str | Path, generation: str = "2.0", seed: int = 0, layers: int = 2,
                    upsampler: bool = True, fp8: bool = False, spatial: int = 32) -> Path:
    """Write a tiny random-weight LTX-``generation`` folder in diffusers format (``LTX2Pipeline``'s components)
    and return its path; with ``upsampler`` also its spatial latent upsampler in ``latent_upsampler/`` (as
    ``LTX2LatentUpsamplePipeline`` loads it). Weights are rounded so that bf16 and fp16 files hold them exactly; with
    ``fp8`` every matrix is also an fp8 value times a power of two, so the fp8 export holds it exactly. ``spatial``:
    the video VAE's compression in space (32 as released; 16 for a model whose sizes diffusers still takes only
    in multiples of 32)."""
    import torch
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    if generation not in LTX2_GENERATIONS:
        raise ValueError(f"generation must be one of {LTX2_GENERATIONS}, got {generation!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)

    def randomise(module, std=0.05, stronger=(), strong_std=0.0):
        with torch.no_grad():
            for name, p in module.named_parameters():
                scale = strong_std if any(s in name for s in stronger) else std
                noise = torch.randn_like(p) * scale
                # The attention's q/k RMS-norm gains around 1, as a trained model's are: near 0 every score is
                # near 0, the attention near uniform and blind to the positions (a RoPE 4e-3 rad off passed).
                if name.endswith(("norm_q.weight", "norm_k.weight")):
                    noise = 1.0 + noise
                p.copy_(exact(noise, fp8))
        return module.eval()

    build_tokenizer(directory / "tokenizer")
    gemma = Gemma3ForConditionalGeneration(Gemma3Config(**gemma_config(layers=GEMMA["layers"])))
    randomise(gemma, std=0.2).save_pretrained(directory / "text_encoder")
    # A strong text path (the connectors' projection, the transformer's cross-attention and caption projection): a
    # prompt must visibly change the video and the sound, or a test could not tell a wrong encoding from a right one.
    randomise(LTX2TextConnectors(**connectors_config(generation)), std=0.1, stronger=("proj_in",),
              strong_std=0.2).save_pretrained(directory / "connectors")
    randomise(LTX2VideoTransformer3DModel(**transformer_config(generation, layers, spatial)), std=0.05,
              stronger=("attn2.", "audio_attn2.", "caption_projection", "proj_in", "audio_proj_in", "to_gate_logits",
                        "audio_to_video_attn", "video_to_audio_attn"), strong_std=0.2).save_pretrained(
        directory / "transformer")
    vae = randomise(AutoencoderKLLTX2Video(**vae_config(generation, spatial)), std=0.1, stronger=("encoder.",), strong_std=0.2)
    with torch.no_grad():  # latent statistics away from (0, 1), so a missed normalisation shows
        vae.latents_mean.copy_(exact(torch.randn(LATENT) * 0.3, False))
        vae.latents_std.copy_(exact(0.5 + torch.rand(LATENT), False))
    vae.save_pretrained(directory / "vae")
    audio_vae = randomise(AutoencoderKLLTX2Audio(**AUDIO_VAE), std=0.1)
    with torch.no_grad():
        audio_vae.latents_mean.copy_(exact(torch.randn(AUDIO_VAE["base_channels"]) * 0.3, False))
        audio_vae.latents_std.copy_(exact(0.5 + torch.rand(AUDIO_VAE["base_channels"]), False))
    audio_vae.save_pretrained(directory / "audio_vae")
    if generation == "2.3":
        vocoder = randomise(LTX2VocoderWithBWE(**VOCODER_23), std=0.1)
        _fill_bwe_buffers(vocoder)
    else:
        vocoder = randomise(LTX2Vocoder(**VOCODER_20), std=0.1)
    vocoder.save_pretrained(directory / "vocoder")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(directory / "scheduler")
    if upsampler:
        randomise(LTX2LatentUpsamplerModel(**dict(UPSAMPLER, use_rational_resampler=generation == "2.0")),
                  std=0.05).save_pretrained(directory / "latent_upsampler")
    model_index = {
        "_class_name": "LTX2Pipeline", "_diffusers_version": "0.42.1",
        "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"], "connectors": ["ltx2", "LTX2TextConnectors"],
        "duration_head": [None, None], "processor": [None, None], "prompt_enhancer": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
        "tokenizer": ["transformers", "GemmaTokenizer"],
        "transformer": ["diffusers", "LTX2VideoTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLLTX2Video"],
        "vocoder": ["ltx2", "LTX2VocoderWithBWE" if generation == "2.3" else "LTX2Vocoder"],
    }
    return finish(directory, model_index, f"LTX-{generation}", seed)


# Every linear a LoRA for LTX-2 may reach: both streams' attention (self, text, cross-modal) and feed-forward in
# every block, and the ones whose original names differ from diffusers' (patchify projections, the AdaLN and
# cross-modal modulation linears, 2.3's prompt modulation, the output projections).
LORA_TARGETS = (r"transformer_blocks\.\d+\.(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|"
                r"video_to_audio_attn)\.(to_q|to_k|to_v|to_out\.0)\.weight|"
                r"transformer_blocks\.\d+\.(ff|audio_ff)\.net\.(0\.proj|2)\.weight|"
                r"(audio_)?proj_(in|out)\.weight|"
                r"(time_embed|audio_time_embed|av_cross_attn_\w+|prompt_adaln|audio_prompt_adaln)\.linear\.weight")


def build_tiny_lora(transformer: str | Path, out: str | Path, fmt: str = "comfy_ab", **options) -> Path:
    """A random-weight LoRA over ``LORA_TARGETS`` of the LTX-2 transformer folder ``transformer``, in format
    ``fmt`` (``LORA_FORMATS``; ``comfy_ab`` is the original names under ``diffusion_model.`` with lora_A/lora_B,
    as Lightricks' LoRAs are written), with ``write_tiny_lora``'s options."""
    from .files import transformer_to_original

    return write_tiny_lora(transformer, out, fmt, LORA_TARGETS, original=transformer_to_original, **options)
