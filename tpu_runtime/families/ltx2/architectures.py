"""The released LTX-2 model as configs only, no weights: what ``plan`` compiles when it is given the model's name
instead of a folder.

``ltx2-19b`` is Lightricks/LTX-2 (2.0, the 19B dev transformer) in diffusers layout: diffusers' own class defaults
for its components are that release's configuration (a 48-block transformer of 4096 video and 2048 audio channels,
connectors over Gemma 3 12B's 49 stacked hidden states, the 128-channel video VAE, the audio VAE, the vocoder), and
the text encoder is Gemma 3 12B. Written to a folder (``registry.write_architecture``), the entry is a model folder
the family opens with ``target_devices``.
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
            "transformer/config.json": _defaults(LTX2VideoTransformer3DModel),
            "connectors/config.json": _defaults(LTX2TextConnectors),
            "vae/config.json": _defaults(AutoencoderKLLTX2Video, decoder_causal=False),
            "audio_vae/config.json": _defaults(AutoencoderKLLTX2Audio),
            "vocoder/config.json": _defaults(LTX2Vocoder),
            "latent_upsampler/config.json": _defaults(LTX2LatentUpsamplerModel),
            "text_encoder/config.json": GEMMA3_12B, "scheduler/scheduler_config.json": SCHEDULER}


ARCHITECTURES: dict[str, dict] = {"ltx2-19b": _ltx2_19b()}
