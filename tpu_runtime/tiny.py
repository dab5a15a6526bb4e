"""Tiny random-weight CogVideoX models, saved as real diffusers folders.

Used by ``python -m tpu_runtime demo`` and by the tests: no model hub is needed, and the folders go through the
same loaders as real downloads. The weights are random, so the video is noise; these models exist to exercise
code paths, never to judge output quality.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TINY_MARKER = "tiny_random_weights.txt"

# Words for training the tiny tokenizer: enough for prompts in tests and the demo to tokenize into pieces.
_CORPUS = [
    "a panda playing a guitar in a bamboo forest at sunset",
    "a cat walks on the grass, realistic style, high quality video",
    "a red car drives along a coastal road while waves crash on the rocks",
    "an astronaut rides a horse on the moon, cinematic lighting",
    "slow motion of a glass of water falling on the table",
    "low quality, blurry, distorted, ugly, bad anatomy, watermark, text",
    "the quick brown fox jumps over the lazy dog 0 1 2 3 4 5 6 7 8 9",
]


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


def _build_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import T5TokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=120, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    fast = T5TokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0)
    fast.save_pretrained(directory)


def build_tiny_cogvideox(directory: str | Path, generation: str = "2b", seed: int = 0, spec: TinySpec | None = None) -> Path:
    """Write a tiny random-weight CogVideoX ``generation`` folder in diffusers format and return its path."""
    import torch
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXDPMScheduler,
        CogVideoXTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    if generation not in GENERATIONS:
        raise ValueError(f"generation must be one of {GENERATIONS}, got {generation!r}")
    spec = spec or TinySpec(generation)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)

    _build_tokenizer(directory / "tokenizer")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(directory / "tokenizer"))
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=vocab, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu", dropout_rate=0.0,
        )
    ).eval()
    t5.save_pretrained(directory / "text_encoder")

    latent_size = spec.sample_size // 8
    rope = generation in ("5b", "1.5")
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=spec.heads,
        attention_head_dim=spec.head_dim,
        in_channels=4,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=32,
        num_layers=spec.layers,
        sample_width=latent_size,
        sample_height=latent_size,
        sample_frames=9 if generation != "1.5" else 17,
        patch_size=2,
        patch_size_t=2 if generation == "1.5" else None,
        temporal_compression_ratio=4,
        max_text_seq_length=spec.text_len,
        use_rotary_positional_embeddings=rope,
        use_learned_positional_embeddings=False,
        patch_bias=generation != "1.5",
    ).eval()
    # Random init leaves some projections at zero; give every weight a visible value so tests can't pass trivially.
    with torch.no_grad():
        for p in transformer.parameters():
            p.normal_(0.0, 0.2)
    transformer.save_pretrained(directory / "transformer")

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
    ).eval()
    vae.save_pretrained(directory / "vae")

    snr_shift = 3.0 if generation == "2b" else 1.0
    scheduler_kwargs = dict(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
        num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
        set_alpha_to_one=True, snr_shift_scale=snr_shift, steps_offset=0, timestep_spacing="trailing",
    )
    scheduler_cls = CogVideoXDDIMScheduler if generation == "2b" else CogVideoXDPMScheduler
    scheduler_cls(**scheduler_kwargs).save_pretrained(directory / "scheduler")

    model_index = {
        "_class_name": "CogVideoXPipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", scheduler_cls.__name__],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "transformer": ["diffusers", "CogVideoXTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLCogVideoX"],
    }
    (directory / "model_index.json").write_text(json.dumps(model_index, indent=2))
    (directory / TINY_MARKER).write_text(
        f"Tiny CogVideoX-{generation}-shaped model with RANDOM weights (seed {seed}).\n"
        "It produces noise, not video; it exists to test and demonstrate the pipeline.\n"
    )
    log.info("built tiny random-weight CogVideoX-%s model in %s", generation, directory)
    return directory
