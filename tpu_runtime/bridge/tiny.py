"""Tiny random-weight models of ComfyUI's own classes, saved as the single files ComfyUI's loaders detect, for
``bench --comfy-native`` (and the tests): the numbers they give measure the bridge's overheads and compiles, not a
real model's speed. ComfyUI's code must be importable (``architectures.use_comfyui``)."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch


def random_state(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A state dict of ``module``'s names and shapes with random values of sensible size: matrices ~ 1/sqrt(fan-in),
    norm scales near 1, biases and other vectors small; integer buffers kept."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in module.state_dict().items():
        shape = tuple(t.shape)
        if not t.dtype.is_floating_point:
            out[name] = t.clone()
            continue
        noise = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) >= 2:
            value = noise / math.sqrt(math.prod(shape[1:]))
        elif "norm" in name and name.endswith("weight"):
            value = 1.0 + 0.1 * noise
        else:
            value = 0.05 * noise
        out[name] = value.contiguous()
    return out


def save_diffusion_model(module: torch.nn.Module, path: Path, seed: int, dtype=torch.float32,
                         prefix: str = "model.diffusion_model.", metadata: dict | None = None) -> Path:
    """``module``'s random weights as ComfyUI's single file (the key prefix its checkpoint files carry; ``metadata``:
    the file's header metadata, e.g. the ``config`` LTX-2 files carry)."""
    from safetensors.torch import save_file

    save_file({prefix + k: v.to(dtype) for k, v in random_state(module, seed).items()}, str(path), metadata=metadata)
    return path


def tiny_wan(kind: str = "t2v", dim: int = 128, layers: int = 2, in_dim: int = 16, **extra) -> torch.nn.Module:
    """ComfyUI's Wan classes at a tiny size (heads = dim / 128, as ComfyUI's detection reads them); ``kind`` is a
    ``WanModel`` model type (t2v, i2v, ...) or "vace"."""
    import comfy.ldm.wan.model as wan
    import comfy.ops

    common = dict(dim=dim, ffn_dim=2 * dim, num_heads=max(1, dim // 128), num_layers=layers, in_dim=in_dim,
                  out_dim=16, text_dim=4096, operations=comfy.ops.disable_weight_init)
    if kind == "vace":
        return wan.VaceWanModel(vace_layers=extra.get("vace_layers", 1), vace_in_dim=96, **common)
    return wan.WanModel(model_type=kind, **common, **extra)


# --- VAEs: ComfyUI's VAE object, made by its own loader --------------------------------------------------------------
@contextlib.contextmanager
def _reduced(namespace, name: str, **overrides):
    """While the block runs, ``namespace.name`` (a model class ComfyUI builds at a fixed size) builds at a reduced
    size: its keyword arguments (or its ``ddconfig``'s entries) replaced by ``overrides``."""
    original = getattr(namespace, name)

    class Reduced(original):
        def __init__(self, *args, **kwargs):
            if "ddconfig" in kwargs:
                kwargs["ddconfig"] = {**kwargs["ddconfig"], **overrides}
            else:
                kwargs.update(overrides)
            super().__init__(*args, **kwargs)

    Reduced.__name__ = Reduced.__qualname__ = original.__name__
    setattr(namespace, name, Reduced)
    try:
        yield Reduced
    finally:
        setattr(namespace, name, original)


# LTX-Video's VAE (comfy/ldm/lightricks/vae/causal_video_autoencoder.py) as ComfyUI reads it from a file's metadata:
# 32x spatial and 8x temporal compression like the released ones, one layer a block and no channel growth.
LTXV_TINY_VAE = {
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_all_res", {"multiplier": 1}],
                       ["compress_all_res", {"multiplier": 1}], ["compress_all_res", {"multiplier": 1}]],
    "decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": False}],
                       ["compress_all", {"residual": True, "multiplier": 1}],
                       ["compress_all", {"residual": True, "multiplier": 1}],
                       ["compress_all", {"residual": True, "multiplier": 1}],
                       ["res_x", {"num_layers": 1, "inject_noise": False}]],
    "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
    "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": True,
}

VAE_KINDS = ("wan2.1", "wan2.2", "hunyuan_video", "ltxv", "image", "taesd", "minimax_h3")


def tiny_vae(kind: str, seed: int = 0, dtype=torch.float32, width: int = 8):
    """ComfyUI's VAE object for architecture ``kind`` (``VAE_KINDS``) with random weights, made by ComfyUI's own
    loader (``comfy.sd.VAE`` on a state dict, which recognises the architecture from its keys). Classes ComfyUI
    builds at a fixed size are built at ``width`` base channels (32 for the group-normalised ones); LTX-Video's
    comes from a file's metadata like ComfyUI reads it."""
    import json

    import comfy.sd

    metadata = None
    if kind == "wan2.1":
        import comfy.ldm.wan.vae as module

        reduce = _reduced(module, "WanVAE", dim=width)
        build = lambda cls: cls(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],  # noqa: E731
                                temperal_downsample=[False, True, True])
    elif kind == "wan2.2":
        import comfy.ldm.wan.vae2_2 as module

        reduce = _reduced(module, "WanVAE", dim=width, dec_dim=2 * width)
        build = lambda cls: cls(dim=160, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],  # noqa: E731
                                temperal_downsample=[False, True, True])
    elif kind in ("hunyuan_video", "image"):
        ch = max(32, width)
        reduce = _reduced(comfy.sd, "AutoencoderKL", ch=ch)
        config = {"double_z": True, "z_channels": 16 if kind == "hunyuan_video" else 4, "resolution": 256,
                  "in_channels": 3, "out_ch": 3, "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                  "attn_resolutions": [], "dropout": 0.0}
        if kind == "hunyuan_video":
            config.update(conv3d=True, time_compress=4)
        build = lambda cls: cls(ddconfig=config, embed_dim=config["z_channels"])  # noqa: E731
    elif kind == "taesd":  # ComfyUI's previewer VAE: its size is the real one, read from the state dict
        import comfy.taesd.taesd as module

        reduce = contextlib.nullcontext(None)
        build = lambda cls: module.TAESD(latent_channels=4)  # noqa: E731
    elif kind == "ltxv":
        import comfy.ldm.lightricks.vae.causal_video_autoencoder as module

        metadata = {"config": json.dumps({"vae": LTXV_TINY_VAE})}
        reduce = contextlib.nullcontext(None)
        build = lambda cls: module.VideoVAE(config=LTXV_TINY_VAE)  # noqa: E731
    elif kind == "minimax_h3":  # ComfyUI 0.33's MiniMax H3 video VAE, which tiles the video itself
        import comfy.ldm.minimax.vae as module

        reduce = _minimax_reduced(module, width)
        build = lambda cls: cls()  # noqa: E731
    else:
        raise ValueError(f"unknown VAE kind {kind!r}: one of {VAE_KINDS}")
    with reduce as cls:
        state = random_state(build(cls), seed)
        return comfy.sd.VAE(sd=state, dtype=dtype, metadata=metadata)


@contextlib.contextmanager
def _minimax_reduced(module, width: int):
    """MiniMax H3's VAE at ``width`` base channels (32 at least: it is group-normalised), its ViT decoder one small
    block deep."""
    with _reduced(module, "ViT3DDecoder", num_layers=1, heads=2, dim_head=16), \
            _reduced(module, "MiniMaxH3VideoVAE", ch=max(32, width), num_res_blocks=1) as cls:
        yield cls


def save_wan_vae(path: Path, seed: int, dtype=torch.bfloat16) -> Path:
    """A Wan 2.1 VAE file at the size ComfyUI's loader builds it (its width is fixed: 127M weights), random."""
    import comfy.ldm.wan.vae as module
    from safetensors.torch import save_file

    vae = module.WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                        temperal_downsample=[False, True, True])
    save_file({k: v.to(dtype) for k, v in random_state(vae, seed).items()}, str(path))
    return path


# --- text encoders: ComfyUI's CLIP object, made as its loader makes it -----------------------------------------------
# kind -> (the text model's name in ComfyUI's model options, a reduced configuration of its fixed one). Widths are
# tiny; the vocabularies stay those of the tokenizers ComfyUI ships (umT5's comes with the weights: a small one).
TEXT_CONFIGS = {
    "umt5": ("umt5xxl", {"d_model": 64, "num_heads": 4, "d_kv": 16, "d_ff": 128, "vocab_size": 96}),
    "t5xxl": ("t5xxl", {"d_model": 64, "num_heads": 4, "d_kv": 16, "d_ff": 128}),
    "qwen25_3b": ("qwen25_3b", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                "num_key_value_heads": 2}),
    "clip_l": ("clip_l", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                          "projection_dim": 64}),
}
TEXT_KINDS = tuple(TEXT_CONFIGS)


def umt5_tokenizer_data() -> dict:
    """umT5's tokenizer as ComfyUI reads it from a text encoder file: a SentencePiece model (a tiny real one)."""
    import tempfile

    from ..engine.tiny import train_spiece

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "spiece.model"
        train_spiece(path)
        data = path.read_bytes()
    return {"spiece_model": torch.frombuffer(bytearray(data), dtype=torch.uint8)}


def tiny_text_encoder(kind: str, seed: int = 0, dtype=torch.float32, layers: int = 2, fp8: bool = False, **config):
    """ComfyUI's CLIP object for text encoder ``kind`` (``TEXT_KINDS``: umT5 as Wan loads it, T5-XXL as LTX-Video
    does, Qwen 2.5 (ComfyUI's LLaMA-style model), CLIP-L) with random weights, made as ComfyUI's
    ``load_text_encoder_state_dicts`` makes it (``comfy.sd.CLIP`` on the clip type's classes, then ``load_sd``), at
    a reduced configuration passed the way ComfyUI takes one (``<name>_model_config`` in the model options).
    ``fp8``: as ComfyUI holds a scaled fp8 file (``*_fp8_e4m3fn_scaled``): every linear weight float8_e4m3fn with a
    per-layer scale, cast inside ComfyUI's ops."""
    import comfy.sd

    name, reduced = TEXT_CONFIGS[kind]
    reduced = {**reduced, **config}
    reduced["num_layers" if kind in ("umt5", "t5xxl") else "num_hidden_layers"] = layers

    class Target:
        params: dict = {}

    target = Target()
    tokenizer_data = {}
    if kind == "umt5":
        import comfy.text_encoders.wan as wan

        target.clip, target.tokenizer = wan.te(), wan.WanT5Tokenizer
        tokenizer_data = umt5_tokenizer_data()
    elif kind == "t5xxl":
        import comfy.text_encoders.lt as lt

        target.clip, target.tokenizer = lt.ltxv_te(), lt.LTXVT5Tokenizer
    elif kind == "qwen25_3b":
        import comfy.text_encoders.omnigen2 as omnigen2

        target.clip, target.tokenizer = omnigen2.te(), omnigen2.Omnigen2Tokenizer
    elif kind == "clip_l":
        import comfy.sd1_clip as sd1_clip

        target.clip, target.tokenizer = sd1_clip.SD1ClipModel, sd1_clip.SD1Tokenizer
    else:
        raise ValueError(f"unknown text encoder kind {kind!r}: one of {TEXT_KINDS}")
    options = {"dtype": dtype, f"{name}_model_config": reduced}
    if fp8:
        options["scaled_fp8"] = torch.float8_e4m3fn
    clip = comfy.sd.CLIP(target, tokenizer_data=tokenizer_data, model_options=options)
    text_model = getattr(clip.cond_stage_model, getattr(clip.cond_stage_model, "clip", name))
    state = random_state(text_model.transformer, seed)
    for key in [k for k in state if k.endswith(".scale_weight")]:
        weight = key[: -len("scale_weight")] + "weight"
        scale = state[weight].abs().max() / 448.0
        state[weight], state[key] = state[weight] / scale, scale.reshape(())
    missing, _ = clip.load_sd(state)
    if missing:
        raise RuntimeError(f"tiny {kind} text encoder: weights missing after loading: {missing[:5]}")
    return clip


# umT5 as ComfyUI's Load CLIP (type wan) recognises a file: 24 blocks whose feed-forward reads 4096 features (what its
# detection looks at), everything else reduced. ComfyUI builds umT5 from its fixed configuration file
# (comfy/text_encoders/umt5_config_xxl.json): a ComfyUI copy that loads this file needs ``umt5_config(...)`` there.
UMT5_FILE_CONFIG = {"d_ff": 16, "d_kv": 8, "num_heads": 2, "vocab_size": 96}


def umt5_config(comfy_dir: str | Path, **overrides) -> dict:
    """ComfyUI's umT5-XXL configuration (from the checkout ``comfy_dir``) with ``overrides``."""
    import json

    path = Path(comfy_dir) / "comfy" / "text_encoders" / "umt5_config_xxl.json"
    return {**json.loads(path.read_text()), **overrides}


def save_umt5(path: Path, config: dict, seed: int, dtype=torch.float16) -> Path:
    """A umT5 text encoder file in ComfyUI's layout (``umt5_xxl_fp16.safetensors``: the T5 encoder's names, the
    tokenizer's SentencePiece model inside as ``spiece_model``) for ``config``, with random weights."""
    import comfy.ops
    import comfy.text_encoders.t5 as t5
    from safetensors.torch import save_file

    model = t5.T5(config, torch.float32, "cpu", comfy.ops.manual_cast)
    state = {k: v.to(dtype) for k, v in random_state(model, seed).items()}
    state.update(umt5_tokenizer_data())
    save_file(state, str(path))
    return path


# --- CLIP vision: ComfyUI's CLIP_VISION object ------------------------------------------------------------------------
# CLIP ViT-H (clip_vision_h) as ComfyUI's loader recognises a file: 32 layers (its detection looks for layer 30), every
# width reduced. ComfyUI builds it from its fixed configuration file (comfy/clip_vision_config_h.json): a ComfyUI copy
# that loads such a file needs ``clip_vision_h_config(...)`` written there.
CLIP_VISION_H_FILE_CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                             "projection_dim": 32, "num_hidden_layers": 32}


def clip_vision_h_config(comfy_dir: str | Path, **overrides) -> dict:
    """ComfyUI's CLIP ViT-H vision configuration (from the checkout ``comfy_dir``) with ``overrides``."""
    import json

    path = Path(comfy_dir) / "comfy" / "clip_vision_config_h.json"
    return {**json.loads(path.read_text()), **overrides}


def tiny_clip_vision(config: dict, seed: int = 0, dtype=torch.float32):
    """ComfyUI's CLIP_VISION object (``comfy.clip_vision.ClipVisionModel``) for the vision ``config`` (a
    configuration file's entries), with random weights in ``dtype`` (ComfyUI itself picks its text encoder dtype:
    float16 on the CPU)."""
    import json
    import tempfile

    import comfy.clip_vision
    import comfy.model_management as mm

    chosen = mm.text_encoder_dtype
    mm.text_encoder_dtype = lambda *args, **kwargs: dtype
    try:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "config.json"
            path.write_text(json.dumps(config))
            clip_vision = comfy.clip_vision.ClipVisionModel(str(path))
    finally:
        mm.text_encoder_dtype = chosen
    state = {k: v.to(dtype) for k, v in random_state(clip_vision.model, seed).items()}
    clip_vision.load_sd(state)
    return clip_vision


def save_clip_vision(clip_vision, path: Path) -> Path:
    """A CLIP vision file as ComfyUI's Load CLIP Vision reads it (the transformers names, as clip_vision_h ships)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in clip_vision.get_sd().items()}, str(path))
    return path


# --- ComfyUI 0.33's video model classes -------------------------------------------------------------------------------
# LTX-2 (comfy/ldm/lightricks/av_model.py) as its files carry their configuration (the header's ``config``, read by
# ComfyUI's detection over what the shapes say): video and audio streams, their text connectors, at a tiny width. The
# audio latent's 8 channels x 16 frequency bins are fixed by the class (its audio input is 128 wide).
LTXAV_TINY = {
    "in_channels": 128, "audio_in_channels": 128, "num_attention_heads": 2, "attention_head_dim": 32,
    "cross_attention_dim": 64, "audio_num_attention_heads": 2, "audio_attention_head_dim": 16,
    "audio_cross_attention_dim": 32, "caption_channels": 64, "num_layers": 2, "connector_num_attention_heads": 2,
    "connector_attention_head_dim": 32, "connector_num_layers": 1,
}


def tiny_ltxav(**overrides) -> tuple[torch.nn.Module, dict]:
    """ComfyUI's LTX-2 class (``LTXAVModel``) at a tiny size, and the file metadata that describes it (pass both to
    ``save_diffusion_model``)."""
    import json

    import comfy.ldm.lightricks.av_model as av
    import comfy.ops

    config = {**LTXAV_TINY, **overrides}
    module = av.LTXAVModel(**config, operations=comfy.ops.disable_weight_init)
    return module, {"config": json.dumps({"transformer": config})}


def tiny_hunyuan_video_15(hidden: int = 128, context: int = 64, depth: int = 2) -> torch.nn.Module:
    """ComfyUI's HunyuanVideo class as HunyuanVideo 1.5 builds it (comfy/ldm/hunyuan_video/model.py with 0.33's
    options): 32 latent channels taken with the image condition and its mask (65 in), patch 1x1x1, double blocks
    only, ByT5 glyph text, SigLIP image features (1152 wide: what detection reads to tell 1.5), the condition-type
    embedding; heads of 128 as the released model's."""
    import comfy.ldm.hunyuan_video.model as hv
    import comfy.ops

    return hv.HunyuanVideo(
        image_model="hunyuan_video", operations=comfy.ops.disable_weight_init, in_channels=65, out_channels=32,
        vec_in_dim=None, context_in_dim=context, hidden_size=hidden, mlp_ratio=4.0, num_heads=hidden // 128,
        depth=depth, depth_single_blocks=0, axes_dim=[16, 56, 56], theta=256, patch_size=[1, 1, 1], qkv_bias=True,
        guidance_embed=False, meanflow=False, byt5=True, use_cond_type_embedding=True, vision_in_dim=1152,
        meanflow_sum=True)


def tiny_kandinsky5(model_dim: int = 128, blocks: int = 2) -> torch.nn.Module:
    """ComfyUI's Kandinsky 5 video class (comfy/ldm/kandinsky5/model.py) at a tiny width; the text widths are the
    class's (Qwen 2.5-VL's 3584, CLIP-L's pooled 768: its detection does not read them), heads of 64."""
    import comfy.ldm.kandinsky5.model as k5
    import comfy.ops

    return k5.Kandinsky5(in_visual_dim=16, out_visual_dim=16, time_dim=64, model_dim=model_dim, ff_dim=2 * model_dim,
                         visual_embed_dim=132, num_text_blocks=1, num_visual_blocks=blocks,
                         operations=comfy.ops.disable_weight_init)


def tiny_wan_animate(dim: int = 128, layers: int = 5) -> torch.nn.Module:
    """ComfyUI's Wan 2.2 Animate class (comfy/ldm/wan/model_animate.py): an I2V Wan with pose latents, the face motion
    encoder (its fixed size: 512x512 face crops) and a face adapter block every 5 layers (5 layers: one, which is
    what detection looks for)."""
    import comfy.ldm.wan.model_animate as animate
    import comfy.ops

    return animate.AnimateWanModel(dim=dim, ffn_dim=2 * dim, num_heads=max(1, dim // 128), num_layers=layers,
                                   in_dim=36, out_dim=16, text_dim=4096, operations=comfy.ops.disable_weight_init)


def tiny_cogvideox(heads: int = 2, layers: int = 2, text_dim: int = 64) -> torch.nn.Module:
    """ComfyUI's native CogVideoX class (comfy/ldm/cogvideo/model.py) as 5B-style files build it (rotary positions,
    heads of 64), at a tiny width."""
    import comfy.ldm.cogvideo.model as cogvideo
    import comfy.ops

    return cogvideo.CogVideoXTransformer3DModel(
        num_attention_heads=heads, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=64,
        text_embed_dim=text_dim, num_layers=layers, use_rotary_positional_embeddings=True,
        use_learned_positional_embeddings=False, operations=comfy.ops.disable_weight_init)


# LTX-2's audio VAE and vocoder (comfy/ldm/lightricks/vae/audio_vae.py) as the file's header describes them: the
# released layout (stereo mel spectrograms of 64 bins, 16 kHz, hop 160; latents of 8 channels x 16 bins, 4x in time)
# with 16 base channels, one block a level and a small vocoder (its upsampling still 160x: one sample per hop).
LTXAV_TINY_AUDIO_VAE = {
    "model": {"params": {"sampling_rate": 16000, "ddconfig": {
        "double_z": True, "mel_bins": 64, "z_channels": 8, "resolution": 256, "downsample_time": False,
        "in_channels": 2, "out_ch": 2, "ch": 16, "ch_mult": [1, 2, 4], "num_res_blocks": 1, "attn_resolutions": [],
        "dropout": 0.0, "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height"}}},
    "preprocessing": {"stft": {"filter_length": 1024, "hop_length": 160}},
}
LTXAV_TINY_VOCODER = {
    "upsample_initial_channel": 32, "upsample_rates": [5, 4, 2, 2, 2], "upsample_kernel_sizes": [11, 8, 4, 4, 4],
    "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]], "stereo": True, "output_sample_rate": 16000,
}


def tiny_audio_vae(seed: int = 0):
    """LTX-2's audio VAE as ComfyUI's VAE object (what LTXV Audio VAE Loader gives), made by ComfyUI's own loader from
    a random state dict in the file's layout (``audio_vae.`` and ``vocoder.`` keys) and the header's config."""
    import json

    import comfy.ldm.lightricks.vae.audio_vae as audio_vae
    import comfy.sd

    metadata = {"config": json.dumps({"audio_vae": LTXAV_TINY_AUDIO_VAE, "vocoder": LTXAV_TINY_VOCODER})}
    state = random_state(audio_vae.AudioVAE(metadata=metadata), seed)
    for name in [k for k in state if k.endswith("std-of-means")]:
        state[name] = state[name].abs() + 0.5  # latent statistics: a spread, positive
    state = {("audio_vae." + k[len("autoencoder."):] if k.startswith("autoencoder.") else k): v
             for k, v in state.items()}
    return comfy.sd.VAE(sd=state, metadata=metadata)


def tiny_hunyuan_video_15_vae(seed: int = 0, dtype=torch.float32):
    """HunyuanVideo 1.5's VAE (comfy/ldm/hunyuan_video/vae_refiner.py: 32 latent channels, 16x in space, 4x in time)
    as ComfyUI's VAE object, made by its own loader, at reduced widths (ComfyUI builds it at a fixed size)."""
    import comfy.ldm.hunyuan_video.vae_refiner as refiner
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    widths = dict(block_out_channels=[8, 16, 16, 64, 64])  # the last two: twice the latent channels at least
    config = {"block_out_channels": [128, 256, 512, 1024, 1024], "in_channels": 3, "out_channels": 3,
              "num_res_blocks": 2, "ffactor_spatial": 16, "ffactor_temporal": 4, "downsample_match_channel": True,
              "upsample_match_channel": True, "z_channels": 32}
    with _reduced(refiner, "Encoder", **widths), _reduced(refiner, "Decoder", **widths):
        module = AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.EmptyRegularizer"},
            encoder_config={"target": "comfy.ldm.hunyuan_video.vae_refiner.Encoder", "params": config},
            decoder_config={"target": "comfy.ldm.hunyuan_video.vae_refiner.Decoder", "params": config})
        return comfy.sd.VAE(sd=random_state(module, seed), dtype=dtype)


def gemma_tokenizer_data() -> dict:
    """A tiny real SentencePiece model with Gemma's special ids (pad 0, eos 1, bos 2, unk 3), as ComfyUI reads it
    from a Gemma 3 file (``spiece_model``)."""
    import io

    import sentencepiece

    from ..engine.tiny import CORPUS

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_writer=model, vocab_size=96, model_type="unigram", pad_id=0,
        eos_id=1, bos_id=2, unk_id=3, hard_vocab_limit=False, minloglevel=2)
    return {"spiece_model": torch.frombuffer(bytearray(model.getvalue()), dtype=torch.uint8)}


# Gemma 3 12B as LTX-2's text encoder reads it (comfy/text_encoders/llama.py), reduced; its head width (256) and
# its SigLIP vision tower's image size are the class's own.
GEMMA3_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
               "vocab_size": 128}
GEMMA3_TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


def tiny_ltxav_text_encoder(seed: int = 0, dtype=torch.float32, layers: int = 2, projection: int = 64):
    """LTX-2's text encoder as ComfyUI's CLIP object (what LTXV Audio Text Encoder Loader gives for a Gemma 3 file
    and an LTX-2 checkpoint): Gemma 3 (every hidden state) and the checkpoint's text projection to ``projection``
    features (the diffusion model's ``caption_channels``), random, made as ``load_text_encoder_state_dicts`` makes
    it and loaded from a state dict in the files' layout."""
    import comfy.sd
    import comfy.text_encoders.llama as llama
    import comfy.text_encoders.lt as lt

    class Target:
        params: dict = {}

    target = Target()
    target.clip = lt.ltxav_te(text_projection_type="single_linear", video_projection_dim=projection)
    target.tokenizer = lt.LTXAVGemmaTokenizer
    options = {"dtype": dtype, "model_name": "gemma3_12b",
               "gemma3_12b_model_config": {**GEMMA3_TINY, "num_hidden_layers": layers}}
    vision = llama.Gemma3_12B_Config.vision_config
    llama.Gemma3_12B_Config.vision_config = {**vision, **GEMMA3_TINY_VISION}  # built with the text model, unused
    try:
        clip = comfy.sd.CLIP(target, tokenizer_data=gemma_tokenizer_data(), model_options=options)
    finally:
        llama.Gemma3_12B_Config.vision_config = vision
    model = clip.cond_stage_model
    state = random_state(model.gemma3_12b.transformer, seed)
    state.update({f"text_embedding_projection.{k}": v
                  for k, v in random_state(model.text_embedding_projection, seed + 1).items()})
    missing, unexpected = clip.load_sd(state)
    if missing or unexpected:
        raise RuntimeError(f"tiny LTX-2 text encoder: {missing[:5]} missing, {unexpected[:5]} unexpected")
    return clip
