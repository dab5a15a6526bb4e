"""The released LTX-2 models as configs only, no weights: what ``plan`` compiles when it is given the model's name
instead of a folder.

``ltx2-19b`` is Lightricks/LTX-2 (2.0, the 19B dev transformer) in diffusers layout: diffusers' own class defaults
for its components are that release's configuration (a 48-block transformer of 4096 video and 2048 audio channels,
connectors over Gemma 3 12B's 49 stacked hidden states, the 128-channel video VAE, the audio VAE, the vocoder), and
the text encoder is Gemma 3 12B. Written to a folder (``registry.write_architecture``), the entry is a model folder
the family opens with ``target_devices``.

``ltx2.3-22b`` is Lightricks/LTX-2.3 (22B dev: a transformer of 18.99B parameters and text connectors
of 3.17B, as its checkpoint holds them): every value diffusers' conversion script
(``scripts/convert_ltx2_to_diffusers.py``) gives its ``version == "2.3"`` branches for the transformer (gated
attention, prompt modulation, perturbed attention for STG, no caption projection), the connectors (eight blocks
each, as wide as the transformer's streams, one text projection per modality), the video VAE (a fourth decoder
block, no residual upsamplers), the audio VAE (as 2.0) and the vocoder (``LTX2VocoderWithBWE``: 48 kHz through the
band extension), over the class defaults of the installed diffusers. The script has no 2.3 branch for the text
encoder, the latent upsampler or the scheduler: Gemma 3 12B, the upsampler class's defaults and 2.0's scheduler.

``ltx2-19b-distilled`` and ``ltx2.3-22b-distilled`` are the distilled checkpoints of the same releases: the dev
ones' shapes, sampled as Lightricks' distilled recipe does (one transformer pass a step: guidance and audio guidance
1, no STG, no modality isolation; diffusers' eight distilled sigmas). An entry's ``sampling`` is those settings,
which ``plan`` uses for it where its own options do not say otherwise (it is not a file of the folder).
"""

from __future__ import annotations

# Gemma 3 12B (google/gemma-3-12b-it): 48 layers, five sliding-window layers to each full one.
GEMMA3_12B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 3840, "intermediate_size": 15360,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "query_pre_attn_scalar": 256, "sliding_window": 1024, "max_position_embeddings": 131072,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 8,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                      "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14},
    "mm_tokens_per_image": 256, "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
}

SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
             "use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
             "max_image_seq_len": 4096, "shift_terminal": 0.1, "time_shift_type": "exponential"}


def _defaults(cls: type, **overrides) -> dict:
    """The config a diffusers model class builds with no arguments (its release configuration), as JSON."""
    import inspect

    config = {"_class_name": cls.__name__}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name != "self" and p.default is not inspect.Parameter.empty:
            config[name] = list(p.default) if isinstance(p.default, tuple) else p.default
    config.update(overrides)
    return config


def _ltx2_19b() -> dict:
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    index = {
        "_class_name": "LTX2Pipeline", "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"],
        "connectors": ["ltx2", "LTX2TextConnectors"], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
        "tokenizer": ["transformers", "GemmaTokenizer"],
        "transformer": ["diffusers", "LTX2VideoTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLLTX2Video"],
        "vocoder": ["ltx2", "LTX2Vocoder"],
    }
    return {"repo": "Lightricks/LTX-2", "model_index.json": index,
            # the release's RoPE (diffusers' conversion script: "split", in float64) where the classes default
            # to "interleaved"; the VAE's compression as the script states it
            "transformer/config.json": _defaults(LTX2VideoTransformer3DModel, rope_type="split",
                                                 rope_double_precision=True),
            "connectors/config.json": _defaults(LTX2TextConnectors, rope_type="split", rope_double_precision=True),
            "vae/config.json": _defaults(AutoencoderKLLTX2Video, decoder_causal=False, spatial_compression_ratio=32,
                                         temporal_compression_ratio=8),
            "audio_vae/config.json": _defaults(AutoencoderKLLTX2Audio),
            "vocoder/config.json": _defaults(LTX2Vocoder),
            "latent_upsampler/config.json": _defaults(LTX2LatentUpsamplerModel),
            "text_encoder/config.json": GEMMA3_12B, "scheduler/scheduler_config.json": SCHEDULER}


# LTX-2.3 in diffusers' conversion script (``version == "2.3"``); the rest of each config is the class's default.
TRANSFORMER_23 = {
    "in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 32,
    "attention_head_dim": 128, "cross_attention_dim": 4096, "vae_scale_factors": [8, 32, 32], "pos_embed_max_pos": 20,
    "base_height": 2048, "base_width": 2048, "gated_attn": True, "cross_attn_mod": True, "audio_in_channels": 128,
    "audio_out_channels": 128, "audio_patch_size": 1, "audio_patch_size_t": 1, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64, "audio_cross_attention_dim": 2048, "audio_scale_factor": 4,
    "audio_pos_embed_max_pos": 20, "audio_sampling_rate": 16000, "audio_hop_length": 160, "audio_gated_attn": True,
    "audio_cross_attn_mod": True, "num_layers": 48, "activation_fn": "gelu-approximate",
    "qk_norm": "rms_norm_across_heads", "norm_elementwise_affine": False, "norm_eps": 1e-6, "caption_channels": 3840,
    "attention_bias": True, "attention_out_bias": True, "rope_theta": 10000.0, "rope_double_precision": True,
    "causal_offset": 1, "timestep_scale_multiplier": 1000, "cross_attn_timestep_scale_multiplier": 1000,
    "rope_type": "split", "use_prompt_embeddings": False, "perturbed_attn": True,
}
CONNECTORS_23 = {
    "caption_channels": 3840, "text_proj_in_factor": 49, "video_connector_num_attention_heads": 32,
    "video_connector_attention_head_dim": 128, "video_connector_num_layers": 8,
    "video_connector_num_learnable_registers": 128, "video_gated_attn": True,
    "audio_connector_num_attention_heads": 32, "audio_connector_attention_head_dim": 64,
    "audio_connector_num_layers": 8, "audio_connector_num_learnable_registers": 128, "audio_gated_attn": True,
    "connector_rope_base_seq_len": 4096, "rope_theta": 10000.0, "rope_double_precision": True,
    "causal_temporal_positioning": False, "rope_type": "split", "per_modality_projections": True,
    "video_hidden_dim": 4096, "audio_hidden_dim": 2048, "proj_bias": True,
}
VAE_23 = {  # timestep_conditioning: the script's argument, False unless asked for
    "in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": [256, 512, 1024, 1024],
    "down_block_types": ["LTX2VideoDownBlock3D"] * 4, "decoder_block_out_channels": [256, 512, 512, 1024],
    "layers_per_block": [4, 6, 4, 2, 2], "decoder_layers_per_block": [4, 6, 4, 2, 2],
    "spatio_temporal_scaling": [True] * 4, "decoder_spatio_temporal_scaling": [True] * 4,
    "decoder_inject_noise": [False] * 5, "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
    "upsample_type": ["spatiotemporal", "spatiotemporal", "temporal", "spatial"], "upsample_residual": [False] * 4,
    "upsample_factor": [2, 2, 1, 2], "timestep_conditioning": False, "patch_size": 4, "patch_size_t": 1,
    "resnet_norm_eps": 1e-6, "encoder_causal": True, "decoder_causal": False, "encoder_spatial_padding_mode": "zeros",
    "decoder_spatial_padding_mode": "zeros", "spatial_compression_ratio": 32, "temporal_compression_ratio": 8,
}
AUDIO_VAE_23 = {  # the script: "Same config as LTX-2.0"
    "base_channels": 128, "output_channels": 2, "ch_mult": [1, 2, 4], "num_res_blocks": 2, "attn_resolutions": None,
    "in_channels": 2, "resolution": 256, "latent_channels": 8, "norm_type": "pixel", "causality_axis": "height",
    "dropout": 0.0, "mid_block_add_attention": False, "sample_rate": 16000, "mel_hop_length": 160, "is_causal": True,
    "mel_bins": 64, "double_z": True,
}
_DILATIONS = [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
VOCODER_23 = {  # LTX2VocoderWithBWE: the vocoder to 16 kHz, then the band extension to 48 kHz
    "in_channels": 128, "hidden_channels": 1536, "out_channels": 2, "upsample_kernel_sizes": [11, 4, 4, 4, 4, 4],
    "upsample_factors": [5, 2, 2, 2, 2, 2], "resnet_kernel_sizes": [3, 7, 11], "resnet_dilations": _DILATIONS,
    "act_fn": "snakebeta", "leaky_relu_negative_slope": 0.1, "antialias": True, "antialias_ratio": 2,
    "antialias_kernel_size": 12, "final_act_fn": None, "final_bias": False, "bwe_in_channels": 128,
    "bwe_hidden_channels": 512, "bwe_out_channels": 2, "bwe_upsample_kernel_sizes": [12, 11, 4, 4, 4],
    "bwe_upsample_factors": [6, 5, 2, 2, 2], "bwe_resnet_kernel_sizes": [3, 7, 11], "bwe_resnet_dilations": _DILATIONS,
    "bwe_act_fn": "snakebeta", "bwe_leaky_relu_negative_slope": 0.1, "bwe_antialias": True, "bwe_antialias_ratio": 2,
    "bwe_antialias_kernel_size": 12, "bwe_final_act_fn": None, "bwe_final_bias": False, "filter_length": 512,
    "hop_length": 80, "window_length": 512, "num_mel_channels": 64, "input_sampling_rate": 16000,
    "output_sampling_rate": 48000,
}


def _ltx2_3_22b() -> dict:
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    entry = _ltx2_19b()
    entry["model_index.json"] = dict(entry["model_index.json"], vocoder=["ltx2", "LTX2VocoderWithBWE"])
    entry.update({"repo": "Lightricks/LTX-2.3",
                  "transformer/config.json": _defaults(LTX2VideoTransformer3DModel, **TRANSFORMER_23),
                  "connectors/config.json": _defaults(LTX2TextConnectors, **CONNECTORS_23),
                  "vae/config.json": _defaults(AutoencoderKLLTX2Video, **VAE_23),
                  "audio_vae/config.json": _defaults(AutoencoderKLLTX2Audio, **AUDIO_VAE_23),
                  "vocoder/config.json": _defaults(LTX2VocoderWithBWE, **VOCODER_23),
                  "latent_upsampler/config.json": _defaults(LTX2LatentUpsamplerModel)})
    return entry


# The distilled recipe (diffusers' LTX-2 pipelines with the distilled checkpoint): one pass a step, 8 sigmas.
DISTILLED = {"guidance": 1.0, "audio_guidance": 1.0, "stg_scale": 0.0, "modality_scale": 1.0, "sigmas": "distilled",
             "steps": 8}


def _distilled(entry: dict, repo_file: str) -> dict:
    return dict(entry, repo=f"{entry['repo']} ({repo_file})", sampling=dict(DISTILLED))


ARCHITECTURES: dict[str, dict] = {
    "ltx2-19b": _ltx2_19b(), "ltx2-19b-distilled": _distilled(_ltx2_19b(), "ltx-2-19b-distilled"),
    "ltx2.3-22b": _ltx2_3_22b(), "ltx2.3-22b-distilled": _distilled(_ltx2_3_22b(), "ltx-2.3-22b-distilled"),
}
