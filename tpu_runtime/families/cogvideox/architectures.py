"""The released CogVideoX models as configs only, no weights: what ``plan`` compiles when it is given a model's
name instead of a folder.

Each entry is the model's diffusers repository reduced to its JSON files (``model_index.json`` and each
component's ``config.json``/``scheduler_config.json``), with the values those repositories publish. Written to a
folder (``registry.write_architecture``), an entry is a model folder the family opens with ``target_devices``.
"""

from __future__ import annotations

from ...engine.encoders import T5_XXL


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


ARCHITECTURES: dict[str, dict] = {
    "cogvideox-2b": _cogvideox("THUDM/CogVideoX-2b", _cogvideox_transformer(30, 30, rotary=False),
                               _cogvideox_vae(1.15258426), snr_shift=3.0),
    "cogvideox-5b": _cogvideox("THUDM/CogVideoX-5b", _cogvideox_transformer(48, 42, rotary=True),
                               _cogvideox_vae(0.7), snr_shift=1.0),
    "cogvideox1.5-5b": _cogvideox("THUDM/CogVideoX1.5-5B", _cogvideox_transformer(48, 42, rotary=True, v15=True),
                                  _cogvideox_vae(0.7, v15=True), snr_shift=1.0),
    "cogvideox-5b-i2v": _cogvideox("THUDM/CogVideoX-5b-I2V", _cogvideox_i2v(
        _cogvideox_transformer(48, 42, rotary=True), v15=False), _cogvideox_vae(0.7), snr_shift=1.0),
    "cogvideox1.5-5b-i2v": _cogvideox("THUDM/CogVideoX1.5-5B-I2V", _cogvideox_i2v(
        _cogvideox_transformer(48, 42, rotary=True, v15=True), v15=True), _cogvideox_vae(0.7, v15=True),
        snr_shift=1.0),
}
