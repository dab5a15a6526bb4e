"""Tiny random-weight Wan models (2.1, 2.2 A14B, TI2V-5B; I2V and FLF2V), saved as real diffusers folders, and LoRAs
for them in every format people download (see ``engine/tiny.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...engine.tiny import LORA_FORMATS, exact, finish, train_spiece, write_tiny_lora  # noqa: F401 (LORA_FORMATS: the formats build_tiny_lora writes)

WAN_GENERATIONS = ("2.1", "2.2-A14B", "2.2-TI2V-5B")


@dataclass(frozen=True)
class TinyWanSpec:
    """How large a tiny Wan model is. Heads are 128 wide as in every released Wan (ComfyUI's files do not record
    the head count, so single-file loading assumes it)."""

    heads: int = 2
    layers: int = 2
    ffn: int = 64
    text_dim: int = 32
    vae_base_dim: int = 8


WAN_IMAGE_KINDS = ("", "i2v", "flf2v")


def build_tiny_wan(directory: str | Path, generation: str = "2.1", seed: int = 0,
                   spec: TinyWanSpec | None = None, image: str = "") -> Path:
    """Write a tiny random-weight Wan ``generation`` folder in diffusers format and return its path.

    "2.1": one transformer, Wan 2.1 VAE (z 16); "2.2-A14B": two experts (boundary 0.875); "2.2-TI2V-5B": 48
    latent channels, the Wan 2.2 VAE (2x2 patches, x16) and ``expand_timesteps``. Weights are rounded so copies in
    ComfyUI's formats (fp16, bf16 and scaled fp8) hold exactly the same numbers.

    ``image``: "i2v" makes the image-to-video model of the generation (2.1: with a CLIP vision encoder of the
    real 257-token shape, as Wan2.1-I2V-14B; 2.2-A14B: as Wan2.2-I2V-A14B, boundary 0.9, no image encoder);
    "flf2v" (2.1): Wan2.1-FLF2V-14B (CLIP features of a first and a last image, with their position embedding).
    TI2V-5B takes an image as it is.
    """
    import torch
    from diffusers import UniPCMultistepScheduler

    from .model import DEFAULT_SCHEDULER, DEFAULT_SHIFT

    if generation not in WAN_GENERATIONS:
        raise ValueError(f"generation must be one of {WAN_GENERATIONS}, got {generation!r}")
    if image not in WAN_IMAGE_KINDS or (image and generation == "2.2-TI2V-5B") or \
            (image == "flf2v" and generation != "2.1"):
        raise ValueError(f"image={image!r}: i2v for 2.1 and 2.2-A14B, flf2v for 2.1 (TI2V-5B takes images as is)")
    spec = spec or TinyWanSpec()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    ti2v = generation == "2.2-TI2V-5B"
    _write_text_encoder(directory, spec)
    experts = ["transformer", "transformer_2"] if generation == "2.2-A14B" else ["transformer"]
    clip = generation == "2.1" and image in ("i2v", "flf2v")
    for name in experts:
        _write_transformer(directory / name, spec, 48 if ti2v else 16, image, clip)
    if clip:
        _write_clip_vision(directory)
    _write_vae(directory, spec, ti2v)
    config = {k: v for k, v in DEFAULT_SCHEDULER.items() if not k.startswith("_")}
    UniPCMultistepScheduler(**config, flow_shift=DEFAULT_SHIFT[generation]).save_pretrained(directory / "scheduler")
    model_index = {
        "_class_name": "WanImageToVideoPipeline" if image else "WanPipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"] if len(experts) == 2 else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "boundary_ratio": (0.9 if image else 0.875) if len(experts) == 2 else None,
        "expand_timesteps": ti2v,
    }
    if image:
        model_index["image_encoder"] = ["transformers", "CLIPVisionModel"] if clip else [None, None]
        model_index["image_processor"] = ["transformers", "CLIPImageProcessor"] if clip else [None, None]
    return finish(directory, model_index, f"Wan-{generation}{'-' + image.upper() if image else ''}", seed)


CLIP_WIDTH = 64  # the tiny CLIP vision encoder's hidden size (the transformer's image_dim)


def _randomise(module, fp8=False, std=0.05, stronger=(), strong_std=0.0):
    """Random weights of ``std`` (``strong_std`` for parameters whose names hold one of ``stronger``), rounded so
    fp16, bf16 and (``fp8``) scaled fp8 copies are exact."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = strong_std if any(s in name for s in stronger) else std
            p.copy_(exact(torch.randn_like(p) * scale, fp8))
    return module


def _write_text_encoder(directory: Path, spec: TinyWanSpec) -> None:
    """umT5 and its tokenizer (a SentencePiece model trained here)."""
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    (directory / "tokenizer").mkdir(exist_ok=True)
    train_spiece(directory / "tokenizer" / "spiece.model")
    tokenizer = T5TokenizerFast.from_pretrained(directory / "tokenizer", extra_ids=0)  # converts spiece.model
    tokenizer.save_pretrained(directory / "tokenizer")
    t5 = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=spec.text_dim, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
        dropout_rate=0.0, is_encoder_decoder=False,
    )).eval()
    _randomise(t5, fp8=True, std=0.3)
    t5.save_pretrained(directory / "text_encoder")


def _write_transformer(folder: Path, spec: TinyWanSpec, channels: int, image: str, clip: bool) -> None:
    from diffusers import WanTransformer3DModel

    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.heads, attention_head_dim=128,
        in_channels=channels + (4 + channels if image else 0),  # image-to-video: + mask + image latents
        out_channels=channels, text_dim=spec.text_dim, freq_dim=32, ffn_dim=spec.ffn, num_layers=spec.layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
        image_dim=CLIP_WIDTH if clip else None, added_kv_proj_dim=spec.heads * 128 if clip else None,
        pos_embed_seq_len=2 * 257 if image == "flf2v" else None,
    ).eval()
    # A strong text path (cross-attention, text projection): prompts must visibly change the video, or a
    # test could not tell a wrong text encoding from a right one.
    # Image-to-video: a strong input projection too, so the image's channels visibly steer the video.
    _randomise(transformer, fp8=True, stronger=("attn2.", "text_embedder.", "image_embedder.")
               + (("patch_embedding.",) if image else ()), strong_std=0.25)
    transformer.save_pretrained(folder)


def _write_clip_vision(directory: Path) -> None:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=CLIP_WIDTH, intermediate_size=96, num_hidden_layers=3, num_attention_heads=16,
        image_size=224, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-5, projection_dim=32)).eval()
    _randomise(encoder, std=0.2)
    encoder.save_pretrained(directory / "image_encoder")
    CLIPImageProcessor().save_pretrained(directory / "image_processor")


def _write_vae(directory: Path, spec: TinyWanSpec, ti2v: bool) -> None:
    from diffusers import AutoencoderKLWan

    from .files import WAN21_LATENTS, WAN22_LATENTS

    if ti2v:
        vae = AutoencoderKLWan(base_dim=spec.vae_base_dim, decoder_base_dim=spec.vae_base_dim, z_dim=48,
                               is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                               scale_factor_spatial=16, **WAN22_LATENTS)
    else:
        vae = AutoencoderKLWan(base_dim=spec.vae_base_dim, z_dim=16, **WAN21_LATENTS)
    # The encoder (image-to-video only) stronger, so different pictures give visibly different latents.
    _randomise(vae.eval(), std=0.1, stronger=("encoder.",), strong_std=0.3)
    vae.save_pretrained(directory / "vae")


# Every attention and feed-forward linear of every block, as the distillation LoRAs touch them.
LORA_TARGETS = r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)\.weight|blocks\.\d+\.ffn\.net\.(0\.proj|2)\.weight"


def build_tiny_lora(transformer: str | Path, out: str | Path, fmt: str = "comfy", **options) -> Path:
    """A random-weight LoRA over every attention and feed-forward linear of every block of the Wan transformer folder
    ``transformer``, in format ``fmt`` (``LORA_FORMATS``; the original Wan names for the ComfyUI and musubi ones),
    with ``write_tiny_lora``'s options."""
    from .files import wan_transformer_to_original

    return write_tiny_lora(transformer, out, fmt, LORA_TARGETS, original=wan_transformer_to_original, **options)
