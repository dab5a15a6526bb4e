"""The released Wan models as configs only, no weights: what ``plan`` compiles when it is given a model's name
instead of a folder or files.

Each entry is the model's diffusers repository reduced to its JSON files (``model_index.json`` and each
component's ``config.json``/``scheduler_config.json``, CLIP vision's preprocessor config), with the values those
repositories publish. Written to a folder (``registry.write_architecture``), an entry is a model folder the
family opens with ``target_devices``.
"""

from __future__ import annotations

from ...engine.encoders import UMT5_XXL
from .files import WAN21_LATENTS, WAN22_LATENTS


def _wan_transformer(heads: int, ffn: int, layers: int, channels: int = 16) -> dict:
    return {
        "_class_name": "WanTransformer3DModel", "added_kv_proj_dim": None, "attention_head_dim": 128,
        "cross_attn_norm": True, "eps": 1e-6, "ffn_dim": ffn, "freq_dim": 256, "image_dim": None,
        "in_channels": channels, "num_attention_heads": heads, "num_layers": layers, "out_channels": channels,
        "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "text_dim": 4096,
    }


WAN21_VAE = {"_class_name": "AutoencoderKLWan", "attn_scales": [], "base_dim": 96, "dim_mult": [1, 2, 4, 4],
             "dropout": 0.0, "num_res_blocks": 2, "temperal_downsample": [False, True, True], "z_dim": 16,
             **WAN21_LATENTS}
WAN22_VAE = {"_class_name": "AutoencoderKLWan", "attn_scales": [], "base_dim": 160, "decoder_base_dim": 256,
             "dim_mult": [1, 2, 4, 4], "dropout": 0.0, "in_channels": 12, "out_channels": 12, "is_residual": True,
             "num_res_blocks": 2, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
             "temperal_downsample": [False, True, True], "z_dim": 48, "clip_output": False, **WAN22_LATENTS}


# laion/CLIP-ViT-H-14's vision tower, as the Wan 2.1 I2V repositories' image_encoder/config.json has it, and its
# preprocessing (CLIP's: short side to 224, centre crop, OpenAI's mean and std).
CLIP_VISION_H = {"architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model", "hidden_size": 1280,
                 "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16, "patch_size": 14,
                 "image_size": 224, "hidden_act": "gelu", "layer_norm_eps": 1e-5, "projection_dim": 1024,
                 "num_channels": 3}
CLIP_PROCESSOR = {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 224},
                  "resample": 3, "do_center_crop": True, "crop_size": {"height": 224, "width": 224},
                  "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
                  "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


def _wan_i2v(transformer: dict, clip: bool, flf2v: bool = False) -> dict:
    """The image-to-video transformer: + frame mask + image latents on channels; Wan 2.1's attends to CLIP
    features (FLF2V: of two images, with their positions)."""
    config = dict(transformer, in_channels=transformer["out_channels"] * 2 + 4)
    if clip:
        config.update(image_dim=1280, added_kv_proj_dim=transformer["num_attention_heads"] * 128)
    if flf2v:
        config.update(pos_embed_seq_len=2 * 257)
    return config


def _wan(repo: str, transformer: dict, vae: dict, shift: float, two_experts: bool = False,
         expand_timesteps: bool = False) -> dict:
    from .model import DEFAULT_BOUNDARY, DEFAULT_BOUNDARY_I2V, DEFAULT_SCHEDULER

    image = transformer["in_channels"] != transformer["out_channels"]
    clip = transformer.get("image_dim") is not None
    index = {"_class_name": "WanImageToVideoPipeline" if image else "WanPipeline", "scheduler": ["diffusers", "UniPCMultistepScheduler"],
             "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
             "transformer": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"] if two_experts else [None, None],
             "expand_timesteps": expand_timesteps}
    if two_experts:
        index["boundary_ratio"] = DEFAULT_BOUNDARY_I2V if image else DEFAULT_BOUNDARY
    if image:
        index["image_encoder"] = ["transformers", "CLIPVisionModel"] if clip else [None, None]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"] if clip else [None, None]
    files = {"repo": repo, "model_index.json": index, "transformer/config.json": transformer,
             "vae/config.json": vae, "text_encoder/config.json": UMT5_XXL,
             "scheduler/scheduler_config.json": dict(DEFAULT_SCHEDULER, flow_shift=shift)}
    if clip:
        files["image_encoder/config.json"] = CLIP_VISION_H
        files["image_processor/preprocessor_config.json"] = CLIP_PROCESSOR
    if two_experts:
        files["transformer_2/config.json"] = transformer
    return files


ARCHITECTURES: dict[str, dict] = {
    "wan2.1-t2v-1.3b": _wan("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", _wan_transformer(12, 8960, 30), WAN21_VAE, 3.0),
    "wan2.1-t2v-14b": _wan("Wan-AI/Wan2.1-T2V-14B-Diffusers", _wan_transformer(40, 13824, 40), WAN21_VAE, 3.0),
    "wan2.2-t2v-a14b": _wan("Wan-AI/Wan2.2-T2V-A14B-Diffusers", _wan_transformer(40, 13824, 40), WAN21_VAE, 12.0,
                            two_experts=True),
    "wan2.2-ti2v-5b": _wan("Wan-AI/Wan2.2-TI2V-5B-Diffusers", _wan_transformer(24, 14336, 30, channels=48),
                           WAN22_VAE, 5.0, expand_timesteps=True),
    "wan2.1-i2v-14b-480p": _wan("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                                _wan_i2v(_wan_transformer(40, 13824, 40), clip=True), WAN21_VAE, 3.0),
    "wan2.1-i2v-14b-720p": _wan("Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
                                _wan_i2v(_wan_transformer(40, 13824, 40), clip=True), WAN21_VAE, 5.0),
    "wan2.1-flf2v-14b-720p": _wan("Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers",
                                  _wan_i2v(_wan_transformer(40, 13824, 40), clip=True, flf2v=True), WAN21_VAE, 16.0),
    "wan2.2-i2v-a14b": _wan("Wan-AI/Wan2.2-I2V-A14B-Diffusers", _wan_i2v(_wan_transformer(40, 13824, 40), clip=False),
                            WAN21_VAE, 5.0, two_experts=True),
}
