"""Tiny random-weight CogVideoX models (every generation, text and image to video), saved as real diffusers
folders, and LoRAs for them (see ``engine/tiny.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...engine.tiny import build_t5_tokenizer, finish, write_tiny_lora

@dataclass(frozen=True)
class TinySpec:
    """Which CogVideoX generation a tiny model imitates and how large it is."""

    generation: str  # "2b", "5b" or "1.5"
    text_len: int = 16
    heads: int = 2
    head_dim: int = 16  # RoPE splits it 4:6:6 over (t, h, w), so a multiple of 16
    layers: int = 1
    sample_size: int = 64  # pixels; the native size the positional embeddings are built for


GENERATIONS = ("2b", "5b", "1.5")


def build_tiny_cogvideox(directory: str | Path, generation: str = "2b", seed: int = 0, spec: TinySpec | None = None,
                         image_to_video: bool = False) -> Path:
    """Write a tiny random-weight CogVideoX ``generation`` folder in diffusers format and return its path.
    ``image_to_video`` (5b, 1.5): the I2V model of that generation (image latents concatenated on channels;
    5b-I2V's learned positions, 1.5-I2V's ``ofs`` embedding and inverted latent scaling)."""
    import torch
    from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    if generation not in GENERATIONS:
        raise ValueError(f"generation must be one of {GENERATIONS}, got {generation!r}")
    if image_to_video and generation == "2b":
        raise ValueError("CogVideoX has image-to-video models for 5b and 1.5 only")
    spec = spec or TinySpec(generation)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)

    build_t5_tokenizer(directory / "tokenizer")
    vocab = len(AutoTokenizer.from_pretrained(directory / "tokenizer"))
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=vocab, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu", dropout_rate=0.0,
        )
    ).eval()
    t5.save_pretrained(directory / "text_encoder")
    _write_transformer(directory / "transformer", generation, spec, image_to_video)
    _write_vae(directory / "vae", generation, spec)

    snr_shift = 3.0 if generation == "2b" else 1.0
    scheduler_kwargs = dict(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
        num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
        set_alpha_to_one=True, snr_shift_scale=snr_shift, steps_offset=0, timestep_spacing="trailing",
    )
    scheduler_cls = CogVideoXDDIMScheduler if generation == "2b" else CogVideoXDPMScheduler
    scheduler_cls(**scheduler_kwargs).save_pretrained(directory / "scheduler")

    model_index = {
        "_class_name": "CogVideoXImageToVideoPipeline" if image_to_video else "CogVideoXPipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", scheduler_cls.__name__],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "CogVideoXTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLCogVideoX"],
    }
    return finish(directory, model_index, f"CogVideoX-{generation}{'-I2V' if image_to_video else ''}", seed)


def _write_transformer(folder: Path, generation: str, spec: TinySpec, image_to_video: bool) -> None:
    import torch
    from diffusers import CogVideoXTransformer3DModel

    latent_size = spec.sample_size // 8
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=spec.heads,
        attention_head_dim=spec.head_dim,
        in_channels=8 if image_to_video else 4,
        out_channels=4,
        time_embed_dim=8,
        ofs_embed_dim=8 if image_to_video and generation == "1.5" else None,
        text_embed_dim=32,
        num_layers=spec.layers,
        sample_width=latent_size,
        sample_height=latent_size,
        sample_frames=9 if generation != "1.5" else 17,
        patch_size=2,
        patch_size_t=2 if generation == "1.5" else None,
        temporal_compression_ratio=4,
        max_text_seq_length=spec.text_len,
        use_rotary_positional_embeddings=generation in ("5b", "1.5"),
        use_learned_positional_embeddings=image_to_video and generation == "5b",
        patch_bias=generation != "1.5",
    ).eval()
    # Random init leaves some projections at zero; give every weight a visible value so tests can't pass trivially.
    with torch.no_grad():
        for p in transformer.parameters():
            p.normal_(0.0, 0.2)
    transformer.save_pretrained(folder)


def _write_vae(folder: Path, generation: str, spec: TinySpec) -> None:
    from diffusers import AutoencoderKLCogVideoX

    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
        sample_height=spec.sample_size,
        sample_width=spec.sample_size,
        scaling_factor=1.15258426 if generation == "2b" else 0.7,
        invert_scale_latents=generation == "1.5",
    ).eval()
    vae.save_pretrained(folder)


LORA_TARGETS = (r"transformer_blocks\.\d+\.attn1\.(to_q|to_k|to_v|to_out\.0)\.weight|"
                r"transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)\.weight")


def build_tiny_lora(transformer: str | Path, out: str | Path, fmt: str = "diffusers", **options) -> Path:
    """A random-weight LoRA over every attention and feed-forward linear of every block of the CogVideoX transformer
    folder ``transformer``, in the diffusers/PEFT format CogVideoX LoRAs ship in (``write_tiny_lora``'s options)."""
    if fmt != "diffusers":
        raise ValueError("CogVideoX LoRAs are written in the diffusers format")
    return write_tiny_lora(transformer, out, fmt, LORA_TARGETS, **options)
