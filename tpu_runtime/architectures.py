"""The released CogVideoX and Wan models as configs only, no weights: what ``plan`` compiles when it is given a
model's name instead of a folder or files.

Each entry is the model's diffusers repository reduced to its JSON files (``model_index.json`` and each
component's ``config.json``/``scheduler_config.json``), with the values those repositories publish. Written to a
folder, an entry is a model folder the families open with ``target_devices`` (abstract: shapes and dtypes only).
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError
from .wan_files import WAN21_LATENTS, WAN22_LATENTS

# google/t5-v1_1-xxl's encoder, as CogVideoX's text_encoder/config.json has it.
T5_XXL = {
    "architectures": ["T5EncoderModel"], "model_type": "t5", "d_model": 4096, "d_ff": 10240, "d_kv": 64,
    "num_heads": 64, "num_layers": 24, "num_decoder_layers": 24, "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6,
    "dropout_rate": 0.1, "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
    "decoder_start_token_id": 0, "is_encoder_decoder": True,
}
# google/umt5-xxl's encoder, as Wan's text_encoder/config.json has it: T5-XXL's shape with a 256k vocabulary and
# a relative-position bias in every layer.
UMT5_XXL = {**T5_XXL, "architectures": ["UMT5EncoderModel"], "model_type": "umt5", "vocab_size": 256384,
            "scalable_attention": True}


def _cogvideox_transformer(heads: int, layers: int, rotary: bool, v15: bool = False) -> dict:
    config = {
        "_class_name": "CogVideoXTransformer3DModel", "activation_fn": "gelu-approximate", "attention_bias": True,
        "attention_head_dim": 64, "dropout": 0.0, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 16,
        "max_text_seq_length": 226, "norm_elementwise_affine": True, "norm_eps": 1e-5,
        "num_attention_heads": heads, "num_layers": layers, "out_channels": 16, "patch_size": 2,
        "sample_frames": 49, "sample_height": 60, "sample_width": 90, "spatial_interpolation_scale": 1.875,
        "temporal_compression_ratio": 4, "temporal_interpolation_scale": 1.0, "text_embed_dim": 4096,
        "time_embed_dim": 512, "timestep_activation_fn": "silu", "use_rotary_positional_embeddings": rotary,
    }
    if v15:
        config.update(patch_bias=False, patch_size_t=2, sample_frames=81, sample_height=96, sample_width=170,
                      use_learned_positional_embeddings=False)
    return config


def _cogvideox_vae(scaling: float, v15: bool = False) -> dict:
    config = {
        "_class_name": "AutoencoderKLCogVideoX", "act_fn": "silu", "block_out_channels": [128, 256, 256, 512],
        "down_block_types": ["CogVideoXDownBlock3D"] * 4, "up_block_types": ["CogVideoXUpBlock3D"] * 4,
        "force_upcast": True, "in_channels": 3, "latent_channels": 16, "layers_per_block": 3, "norm_eps": 1e-6,
        "norm_num_groups": 32, "out_channels": 3, "sample_height": 480, "sample_width": 720,
        "scaling_factor": scaling, "temporal_compression_ratio": 4, "use_post_quant_conv": False,
        "use_quant_conv": False,
    }
    if v15:
        config.update(sample_height=768, sample_width=1360, invert_scale_latents=True)
    return config


def _cogvideox_scheduler(snr_shift: float) -> dict:
    return {
        "_class_name": "CogVideoXDDIMScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
        "beta_start": 0.00085, "clip_sample": False, "clip_sample_range": 1.0, "num_train_timesteps": 1000,
        "prediction_type": "v_prediction", "rescale_betas_zero_snr": True, "sample_max_value": 1.0,
        "set_alpha_to_one": True, "snr_shift_scale": snr_shift, "steps_offset": 0, "timestep_spacing": "trailing",
    }


def _cogvideox_i2v(transformer: dict, v15: bool) -> dict:
    """The I2V model of a generation: the image latents on channels (twice the input channels); 5b-I2V has learned
    positions for 480x720, 1.5-I2V an ``ofs`` embedding and a position grid for up to 2400x2400."""
    config = dict(transformer, in_channels=2 * transformer["out_channels"])
    if v15:
        config.update(ofs_embed_dim=512, sample_height=300, sample_width=300)
    else:
        config.update(use_learned_positional_embeddings=True)
    return config


def _cogvideox(repo: str, transformer: dict, vae: dict, snr_shift: float) -> dict:
    image = transformer["in_channels"] == 2 * transformer["out_channels"]
    index = {"_class_name": "CogVideoXImageToVideoPipeline" if image else "CogVideoXPipeline",
             "scheduler": ["diffusers", "CogVideoXDDIMScheduler"],
             "text_encoder": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "T5Tokenizer"],
             "transformer": ["diffusers", "CogVideoXTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLCogVideoX"]}
    return {"repo": repo, "model_index.json": index, "transformer/config.json": transformer,
            "vae/config.json": vae, "text_encoder/config.json": T5_XXL,
            "scheduler/scheduler_config.json": _cogvideox_scheduler(snr_shift)}


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
    from .wan import DEFAULT_BOUNDARY, DEFAULT_BOUNDARY_I2V, DEFAULT_SCHEDULER

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
    "cogvideox-2b": _cogvideox("THUDM/CogVideoX-2b", _cogvideox_transformer(30, 30, rotary=False),
                               _cogvideox_vae(1.15258426), snr_shift=3.0),
    "cogvideox-5b": _cogvideox("THUDM/CogVideoX-5b", _cogvideox_transformer(48, 42, rotary=True),
                               _cogvideox_vae(0.7), snr_shift=1.0),
    "cogvideox1.5-5b": _cogvideox("THUDM/CogVideoX1.5-5B", _cogvideox_transformer(48, 42, rotary=True, v15=True),
                                  _cogvideox_vae(0.7, v15=True), snr_shift=1.0),
    "wan2.1-t2v-1.3b": _wan("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", _wan_transformer(12, 8960, 30), WAN21_VAE, 3.0),
    "wan2.1-t2v-14b": _wan("Wan-AI/Wan2.1-T2V-14B-Diffusers", _wan_transformer(40, 13824, 40), WAN21_VAE, 3.0),
    "wan2.2-t2v-a14b": _wan("Wan-AI/Wan2.2-T2V-A14B-Diffusers", _wan_transformer(40, 13824, 40), WAN21_VAE, 12.0,
                            two_experts=True),
    "wan2.2-ti2v-5b": _wan("Wan-AI/Wan2.2-TI2V-5B-Diffusers", _wan_transformer(24, 14336, 30, channels=48),
                           WAN22_VAE, 5.0, expand_timesteps=True),
    # image to video
    "cogvideox-5b-i2v": _cogvideox("THUDM/CogVideoX-5b-I2V", _cogvideox_i2v(
        _cogvideox_transformer(48, 42, rotary=True), v15=False), _cogvideox_vae(0.7), snr_shift=1.0),
    "cogvideox1.5-5b-i2v": _cogvideox("THUDM/CogVideoX1.5-5B-I2V", _cogvideox_i2v(
        _cogvideox_transformer(48, 42, rotary=True, v15=True), v15=True), _cogvideox_vae(0.7, v15=True),
        snr_shift=1.0),
    "wan2.1-i2v-14b-480p": _wan("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                                _wan_i2v(_wan_transformer(40, 13824, 40), clip=True), WAN21_VAE, 3.0),
    "wan2.1-i2v-14b-720p": _wan("Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
                                _wan_i2v(_wan_transformer(40, 13824, 40), clip=True), WAN21_VAE, 5.0),
    "wan2.1-flf2v-14b-720p": _wan("Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers",
                                  _wan_i2v(_wan_transformer(40, 13824, 40), clip=True, flf2v=True), WAN21_VAE, 16.0),
    "wan2.2-i2v-a14b": _wan("Wan-AI/Wan2.2-I2V-A14B-Diffusers", _wan_i2v(_wan_transformer(40, 13824, 40), clip=False),
                            WAN21_VAE, 5.0, two_experts=True),
}


def write_architecture(name: str, folder: str | Path) -> Path:
    """Write the config-only model folder of ``name`` into ``folder`` and return it."""
    key = name.lower()
    if key not in ARCHITECTURES:
        raise InputError(f"{name!r} is not a known model: use a model folder, single files, or one of "
                         f"{', '.join(ARCHITECTURES)}")
    root = Path(folder) / key
    for relative, content in ARCHITECTURES[key].items():
        if relative == "repo":
            continue
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2))
    return root
