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


def tiny_wan(kind: str = "t2v", dim: int = 128, layers: int = 2, in_dim: int = 16, out_dim: int = 16,
             **extra) -> torch.nn.Module:
    """ComfyUI's Wan classes at a tiny size (heads = dim / 128, as ComfyUI's detection reads them); ``kind`` is a
    ``WanModel`` model type (t2v, i2v, ...) or "vace"; Wan 2.2 TI2V-5B is a t2v with 48 channels in and out."""
    import comfy.ldm.wan.model as wan
    import comfy.ops

    common = dict(dim=dim, ffn_dim=2 * dim, num_heads=max(1, dim // 128), num_layers=layers, in_dim=in_dim,
                  out_dim=out_dim, text_dim=4096, operations=comfy.ops.disable_weight_init)
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
    Reduced.__module__ = original.__module__
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


def tiny_minimax_h3(hidden: int = 128, heads: int = 2, head_dim: int = 64, layers: int = 2, refiner_layers: int = 1,
                    text_dim: int = 64, curve: bool = False) -> torch.nn.Module:
    """ComfyUI 0.33's MiniMax H3 audio-video DiT (``MiniMaxH3Model``) at a tiny size, as ComfyUI's detection reads it
    from the weights: ``curve`` is the form whose adaLN reads a precomputed time-embedding curve (``adaln_t_table``)
    instead of a time embedder. Its RoPE covers 3 x 2 x 8 = 48 of each head's widths (the released one 96 of 128).
    Save it with ``save_minimax_h3``: the checkpoint's RoPE frequencies are real ones."""
    import comfy.ldm.minimax.model as minimax
    import comfy.ops

    extra = {"adaln_curve_grid": 33} if curve else {"timestep_input_dim": 32, "time_embed_hidden_size": 2 * hidden}
    return minimax.MiniMaxH3Model(hidden_size=hidden, num_layers=layers, token_refiner_num_layers=refiner_layers,
                                  num_attention_heads=heads, attention_head_dim=head_dim, ffn_hidden_size=2 * hidden,
                                  text_dim=text_dim, time_embed_dim=64, rope_inv_freq_len=8, **extra,
                                  operations=comfy.ops.disable_weight_init)


def minimax_h3_state(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random weights for a MiniMax H3 DiT (``tiny_minimax_h3``) with the checkpoint's RoPE frequencies in their real
    form (a geometric series per axis) and a smooth time-embedding curve where the model reads one."""
    state = random_state(module, seed)
    n = state["rope.inv_freq"].shape[0]
    state["rope.inv_freq"] = 1.0 / (256.0 ** (torch.arange(n, dtype=torch.float32) / n))
    if "adaln_t_table" in state:
        grid, width = state["adaln_t_table"].shape
        t = torch.linspace(0.0, 1.0, grid)[:, None]
        g = torch.Generator().manual_seed(seed + 1)
        state["adaln_t_table"] = torch.sin(t * torch.randn(1, width, generator=g) * 3.0) + 0.1 * torch.randn(
            1, width, generator=g)
    return state


def save_minimax_h3(module: torch.nn.Module, path: Path, seed: int, dtype=torch.float32) -> Path:
    """A MiniMax H3 DiT as ComfyUI's diffusion-model file (``minimax_h3_state``); its output heads and patch
    projections stay float32 as in the released files."""
    from safetensors.torch import save_file

    keep = ("video_patch_proj", "audio_patch_proj", "final_layer.video_out", "final_layer.audio_out", "rope.",
            "adaln_t_table")
    state = {k: (v if k.startswith(keep) else v.to(dtype)) for k, v in minimax_h3_state(module, seed).items()}
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in state.items()}, str(path))
    return path


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


HUNYUAN_VIDEO_15_VAE_TINY = {"block_out_channels": [8, 16, 16, 64, 64]}  # the last two: twice the latent channels


def tiny_hunyuan_video_15_vae(seed: int = 0, dtype=torch.float32):
    """HunyuanVideo 1.5's VAE (comfy/ldm/hunyuan_video/vae_refiner.py: 32 latent channels, 16x in space, 4x in time)
    as ComfyUI's VAE object, made by its own loader, at reduced widths (ComfyUI builds it at a fixed size)."""
    import comfy.ldm.hunyuan_video.vae_refiner as refiner
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    widths = HUNYUAN_VIDEO_15_VAE_TINY
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


# --- quantized files, as ComfyUI 0.33 writes them ---------------------------------------------------------------------
def quantize(weight: torch.Tensor, fmt: str, **conf) -> tuple[dict, dict]:
    """A weight as ComfyUI's quantizer stores it for format ``fmt`` (a key of its QUANT_ALGOS): the tensors by key
    suffix ("weight", "weight_scale", "weight_scale_2") and the layer's ``comfy_quant`` entry. ``convrot``: the
    weight rotated, then quantized per output row (int8 ConvRot)."""
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor

    options = {"scale": "recalculate"} if fmt.startswith("float8") or fmt == "nvfp4" else {}
    if conf.get("convrot"):
        options.update(per_channel=True, convrot=True, convrot_groupsize=conf["convrot_groupsize"])
    q = QuantizedTensor.from_float(weight, QUANT_ALGOS[fmt]["comfy_tensor_layout"], **options)
    tensors = {k: v.view(torch.uint8) if v.dtype == torch.float8_e8m0fnu else v  # e8m0 scales stored as their bytes
               for k, v in q.state_dict("weight").items()}
    return tensors, {"format": fmt, **conf}


def save_quantized(state: dict, path, formats, prefix: str = "", extra: dict | None = None, awq_seed: int | None = None,
                   layer_entries: bool = False, metadata: dict | None = None):
    """``state`` (float weights) saved with the linear weights ``formats(name)`` names quantized: (fmt, conf) or
    None to keep a weight as it is. ``awq_seed``: every quantized layer also carries an AWQ smoothing scale
    (``pre_quant_scale``, ModelOpt's: ComfyUI multiplies the layer's input by it), random and positive. The layers'
    formats go into the header's ``_quantization_metadata``, or with ``layer_entries`` into a ``comfy_quant`` tensor
    per layer (the form ComfyUI's own state dicts write, and the one its VAE loader reads)."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(awq_seed or 0)
    out, layers = dict(extra or {}), {}
    for key, value in state.items():
        chosen = formats(key) if key.endswith(".weight") and value.ndim == 2 else None
        if chosen is None:
            out[prefix + key] = value
            continue
        layer = prefix + key[: -len(".weight")]
        tensors, layers[layer] = quantize(value, *chosen[:1], **chosen[1])
        out.update({f"{layer}.{suffix}": tensor for suffix, tensor in tensors.items()})
        if awq_seed is not None:
            out[f"{layer}.pre_quant_scale"] = (0.5 + torch.rand(value.shape[1], generator=g)).to(torch.bfloat16)
    if layer_entries:
        for layer, conf in layers.items():
            out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
        save_file(out, str(path))
        return path
    save_file(out, str(path), metadata={**(metadata or {}), "_quantization_metadata": json.dumps(
        {"format_version": "1.0", "layers": layers})})
    return path


# --- MiniMax H3 as its templates load it ------------------------------------------------------------------------------
# ComfyUI builds MiniMax H3's text encoder (Qwen3-VL 32B cut to 50 layers), video VAE (a 3D CNN encoder and a 2.4B ViT
# decoder) and audio VAE at fixed sizes, whatever the file holds. ``minimax_h3_reduced`` makes them tiny while it is
# entered (``shrink_minimax_h3`` for good, in a test's ComfyUI server); the DiT's size is read from its weights.
QWEN3VL_32B_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "vocab_size": 151936}
QWEN3VL_VISION_TINY = {"hidden_size": 32, "intermediate_size": 64, "depth": 3, "deepstack_visual_indexes": [0, 1, 2],
                       "num_heads": 2}
MINIMAX_AUDIO_VAE_TINY = {"encoder_dim": 8, "latent_dim": 64, "decoder_dim": 256}
# (ViT decoder, whole VAE): its own spatial tiles 64 pixels wide (256 released), so that small frames are tiled too
MINIMAX_VIDEO_VAE_TINY = ({"num_layers": 1, "heads": 2, "dim_head": 16},
                          {"ch": 32, "num_res_blocks": 1, "tile_size": 64, "tile_overlap_min": 16})


def _minimax_h3_reductions() -> list[tuple[object, str, object]]:
    """(namespace, attribute, replacement) for every fixed-size part of MiniMax H3's text encoder and VAEs."""
    import functools

    import comfy.ldm.minimax.audio_vae as audio
    import comfy.ldm.minimax.vae as video
    import comfy.text_encoders.qwen3vl as qwen3vl

    vision = {k: v for k, v in QWEN3VL_VISION_TINY.items() if k != "num_heads"}
    replaced = [
        (qwen3vl.QWEN3VL_CONFIGS, "qwen3vl_32b",
         functools.partial(qwen3vl.QWEN3VL_CONFIGS["qwen3vl_32b"], **QWEN3VL_32B_TINY)),
        (qwen3vl.QWEN3VL_VISION, "qwen3vl_32b", {**qwen3vl.QWEN3VL_VISION["qwen3vl_32b"], **vision}),
        (qwen3vl, "QWEN3VL_VISION_COMMON", {**qwen3vl.QWEN3VL_VISION_COMMON,
                                            "num_heads": QWEN3VL_VISION_TINY["num_heads"]}),
    ]
    for namespace, name, overrides in ((video, "ViT3DDecoder", MINIMAX_VIDEO_VAE_TINY[0]),
                                       (video, "MiniMaxH3VideoVAE", MINIMAX_VIDEO_VAE_TINY[1]),
                                       (audio, "MiniMaxH3AudioVAE", MINIMAX_AUDIO_VAE_TINY)):
        with _reduced(namespace, name, **overrides) as cls:
            replaced.append((namespace, name, cls))
    return replaced


def _set(namespace, name, value):
    if isinstance(namespace, dict):
        namespace[name] = value
    else:
        setattr(namespace, name, value)


def _get(namespace, name):
    return namespace[name] if isinstance(namespace, dict) else getattr(namespace, name)


@contextlib.contextmanager
def minimax_h3_reduced():
    """While the block runs, ComfyUI builds MiniMax H3's text encoder and VAEs at the tiny sizes above."""
    replaced = _minimax_h3_reductions()
    saved = [(namespace, name, _get(namespace, name)) for namespace, name, _ in replaced]
    try:
        for namespace, name, value in replaced:
            _set(namespace, name, value)
        yield
    finally:
        for namespace, name, value in saved:
            _set(namespace, name, value)


# ComfyUI's Wan 2.2 VAE (comfy/ldm/wan/vae2_2.py) is built at a fixed width too (dim 160, decoder 256).
WAN22_VAE_TINY = {"dim": 8, "dec_dim": 16}


def shrink_wan22_vae() -> None:
    """ComfyUI builds the Wan 2.2 VAE at the tiny width above from now on (a test's server)."""
    import comfy.ldm.wan.vae2_2 as module

    with _reduced(module, "WanVAE", **WAN22_VAE_TINY) as cls:
        pass
    module.WanVAE = cls


def save_wan22_vae(path: Path, seed: int, dtype=torch.bfloat16) -> Path:
    """A Wan 2.2 VAE file (``wan2.2_vae``), random, at the width ``shrink_wan22_vae`` makes ComfyUI build."""
    import comfy.ldm.wan.vae2_2 as module
    from safetensors.torch import save_file

    with _reduced(module, "WanVAE", **WAN22_VAE_TINY) as cls:
        vae = cls(dim=160, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                  temperal_downsample=[False, True, True])
    save_file({k: v.to(dtype) for k, v in random_state(vae, seed).items()}, str(path))
    return path


def shrink_minimax_h3() -> None:
    """ComfyUI builds MiniMax H3's text encoder and VAEs at the tiny sizes above from now on (a test's server)."""
    for namespace, name, value in _minimax_h3_reductions():
        _set(namespace, name, value)


def _qwen3vl_text_encoder_module(dtype=torch.float32):
    import comfy.ops
    import comfy.text_encoders.minimax as minimax

    return minimax.MiniMaxQwen3VL({}, dtype, "cpu", comfy.ops.manual_cast)


def save_minimax_h3_text_encoder(path: Path, seed: int, quantized: bool = True) -> Path:
    """MiniMax H3's text encoder file (``qwen3vl_32b_minimax_h3_nvfp4_awq``: Qwen3-VL's 50 language layers and its
    vision tower, in the keys ComfyUI's Load CLIP detects), random, at the tiny size (inside ``minimax_h3_reduced``):
    the language layers' matrices nvfp4 with AWQ smoothing scales, everything else bf16."""
    from safetensors.torch import save_file

    state = {k: v.to(torch.bfloat16) for k, v in random_state(_qwen3vl_text_encoder_module(), seed).items()}
    if not quantized:
        save_file(state, str(path))
        return path

    def chosen(key):
        return ("nvfp4", {}) if key.startswith("model.layers.") and "_proj." in key else None

    return save_quantized(state, path, chosen, awq_seed=seed)


def save_minimax_h3_video_vae(path: Path, seed: int) -> Path:
    """MiniMax H3's video VAE file (``minimax_h3_video_vae_int8_convrot``), random, at the tiny size (inside
    ``minimax_h3_reduced``): the ViT decoder's linear layers int8 with ConvRot (group 16), the rest float32."""
    import comfy.ldm.minimax.vae as video

    state = random_state(video.MiniMaxH3VideoVAE(), seed)
    state["latents_std"] = 0.5 + state["latents_std"].abs()

    def chosen(key):
        return ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 16}) if (
            key.startswith("decoder.transformer_blocks.")) else None

    return save_quantized(state, path, chosen, layer_entries=True)


def save_minimax_h3_audio_vae(path: Path, seed: int) -> Path:
    """MiniMax H3's audio VAE file (``minimax_h3_audio_vae_fp32``), random, at the tiny size (inside
    ``minimax_h3_reduced``)."""
    import comfy.ldm.minimax.audio_vae as audio
    from safetensors.torch import save_file

    module = audio.MiniMaxH3AudioVAE()
    state = random_state(module, seed)
    state["latents_std"] = 0.5 + state["latents_std"].abs()
    # the anti-aliasing filters are the module's own windowed sincs (random ones would amplify every rounding of the
    # vocoder's twenty-odd resampling stages into a chaotic output)
    state.update({k: v for k, v in module.state_dict().items() if k.endswith(".filter")})
    # and its residual blocks add little to their input, so that the signal keeps its size through the stages as a
    # trained vocoder's does (random ones double it at every stage, and a snake activation of large values turns
    # each rounding into a large difference)
    for key in [k for k in state if k.startswith("decoder.resblocks.") and ".convs2." in k]:
        state[key] = state[key] * 0.1
    save_file(state, str(path))
    return path


def save_minimax_h3_dit(path: Path, seed: int, curve: bool = True) -> Path:
    """MiniMax H3's DiT file as its templates name it (``minimax_h3_fl2va_pruned_int8_convrot``: the pruned, curve
    form), tiny, its blocks' attention and feed-forward matrices int8 with ConvRot (group 16), the rest float32; its
    condition projection reads the tiny Qwen3-VL's width."""
    module = tiny_minimax_h3(curve=curve, text_dim=QWEN3VL_32B_TINY["hidden_size"])

    def chosen(key):
        return ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 16}) if key.startswith("blocks.") and (
            ".attn." in key or ".mlp." in key) else None

    return save_quantized(minimax_h3_state(module, seed), path, chosen, prefix="model.diffusion_model.")


def minimax_h3_lora(module: torch.nn.Module, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """A LoRA in ComfyUI's key names for the attention and feed-forward matrices of a MiniMax H3 DiT's blocks (as
    the turbo LoRAs of its templates touch them)."""
    import re

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, sub in module.named_modules():
        if hasattr(sub, "in_features") and re.match(r"blocks\.\d+\.(attn|mlp)\.", name):
            key = f"diffusion_model.{name}"
            out[f"{key}.lora_down.weight"] = torch.randn(rank, sub.in_features, generator=g) * 0.05
            out[f"{key}.lora_up.weight"] = torch.randn(sub.out_features, rank, generator=g) * 0.05
    return out


# --- SAM 3 / 3.1 (segmentation and video tracking) as a checkpoint loader loads it --------------------------------------
# ComfyUI builds SAM 3's detector, tracker and text encoder at fixed sizes (a 1024-wide 32-block ViT over 1008x1008
# frames, 256-wide heads, a 24-layer CLIP text encoder). ``sam3_reduced`` makes them tiny while it is entered
# (``shrink_sam3`` for good, in a test's ComfyUI server); the frame size (1008, 72x72 patches) stays the class's.
SAM3_TINY_WIDTH = 32  # the ViT's width, the text encoder's (its resizer reads one as the other) and the heads'
SAM3_TINY_VIT = {"depth": 2, "num_heads": 2, "global_att_blocks": (1,)}
SAM3_TINY_TEXT = {"hidden_size": SAM3_TINY_WIDTH, "intermediate_size": 64, "num_attention_heads": 2,
                  "num_hidden_layers": 1}
# one layer and one head where attention runs over all 72x72 patches of a frame (and of the frames in memory)
SAM3_TINY_HEADS = {"d_model": SAM3_TINY_WIDTH, "num_heads": 1, "enc_layers": 1, "dec_layers": 1, "dim_ff": 64}
SAM3_TINY_MEMORY_ATTENTION = {"num_heads": 1, "num_layers": 1, "dim_ff": 64}
SAM3_TINY_MEMORY_CHANNELS = [4, 8, 16, 32]  # the tracker's mask downsampler (1152x1152 masks to 72x72)


def _sam3_reductions() -> list[tuple[object, str, object]]:
    """(namespace, attribute, replacement) for every fixed-size part of SAM 3's detector, tracker and text encoder."""
    import comfy.ldm.sam3.detector as detector
    import comfy.ldm.sam3.sam as sam
    import comfy.ldm.sam3.tracker as tracker
    import comfy.text_encoders.sam3_clip as sam3_clip

    replaced = [(sam3_clip, "SAM3_CLIP_CONFIG", {**sam3_clip.SAM3_CLIP_CONFIG, **SAM3_TINY_TEXT})]
    reductions = (
        (sam, "ViTDet", SAM3_TINY_VIT),
        # 16 object queries, not 200: a random detector finds every query above the threshold, and the tracker's
        # non-maximum suppression compares every pair of their masks
        (detector, "SAM3Detector", {"d_model": SAM3_TINY_WIDTH, "embed_dim": SAM3_TINY_WIDTH, "num_queries": 16}),
        (detector, "Transformer", SAM3_TINY_HEADS),
        (tracker, "SAM3Tracker", {"d_model": SAM3_TINY_WIDTH, "mem_dim": SAM3_TINY_WIDTH}),
        (tracker, "SAM31Tracker", {"d_model": SAM3_TINY_WIDTH, "mem_dim": SAM3_TINY_WIDTH}),
        (tracker, "MemoryBackbone", {"channels": SAM3_TINY_MEMORY_CHANNELS}),
        (tracker, "MemoryTransformer", SAM3_TINY_MEMORY_ATTENTION),
        (tracker, "DecoupledMemoryTransformer", SAM3_TINY_MEMORY_ATTENTION),
    )
    for namespace, name, overrides in reductions:
        with _reduced(namespace, name, **overrides) as cls:
            replaced.append((namespace, name, cls))
    trackers = {name: cls for namespace, name, cls in replaced if namespace is tracker and name.endswith("Tracker")}
    # the detector picks its tracker class from a table made at import
    replaced += [(detector.TRACKER_CLASSES, "SAM3", trackers["SAM3Tracker"]),
                 (detector.TRACKER_CLASSES, "SAM31", trackers["SAM31Tracker"])]
    return replaced


@contextlib.contextmanager
def _replaced(replaced: list[tuple[object, str, object]]):
    """While the block runs, each (namespace, attribute) holds its replacement; the originals afterwards."""
    saved = [(namespace, name, _get(namespace, name)) for namespace, name, _ in replaced]
    try:
        for namespace, name, value in replaced:
            _set(namespace, name, value)
        yield
    finally:
        for namespace, name, value in reversed(saved):
            _set(namespace, name, value)


def sam3_reduced():
    """While the block runs, ComfyUI builds SAM 3's detector, tracker and text encoder at the tiny sizes above."""
    return _replaced(_sam3_reductions())


def shrink_sam3() -> None:
    """ComfyUI builds SAM 3 at the tiny sizes above from now on (a test's server)."""
    for namespace, name, value in _sam3_reductions():
        _set(namespace, name, value)


def _open_clip_text_names(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A CLIP text model's transformers names (``text_model.…``) as open_clip writes them (SAM 3's checkpoint: fused
    attention projections, ``transformer.resblocks.N``), under ``prefix``: what ComfyUI's loader converts back."""
    renames = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
               "self_attn.out_proj": "attn.out_proj"}
    out, fused = {}, {}
    for key, value in state.items():
        name = key.removeprefix("text_model.")
        if name == "embeddings.position_embedding.weight":
            out[prefix + "positional_embedding"] = value
        elif name == "embeddings.token_embedding.weight":
            out[prefix + "token_embedding.weight"] = value
        elif name.startswith("final_layer_norm."):
            out[prefix + "ln_final." + name.rsplit(".", 1)[1]] = value
        elif name.startswith("encoder.layers."):
            layer, rest = name[len("encoder.layers."):].split(".", 1)
            part, kind = rest.rsplit(".", 1)
            if part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                fused.setdefault((layer, kind), {})[part] = value
            else:
                out[f"{prefix}transformer.resblocks.{layer}.{renames[part]}.{kind}"] = value
        else:
            out[prefix + name] = value
    for (layer, kind), parts in fused.items():
        out[f"{prefix}transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat(
            [parts[f"self_attn.{p}_proj"] for p in "qkv"])
    return out


def save_sam3(path: Path, seed: int, multiplex: bool = True, dtype=torch.float16) -> Path:
    """SAM 3.1's checkpoint as its templates name it (``sam3.1_multiplex_fp16``: the detector with its multiplex
    propagation convolutions, the multiplex tracker and the CLIP text encoder, in the released key layout), random,
    at the tiny size (inside ``sam3_reduced``). ``multiplex=False``: SAM 3."""
    import comfy.ldm.sam3.detector as detector
    import comfy.ops
    import comfy.text_encoders.sam3_clip as sam3_clip
    from safetensors.torch import save_file

    model = detector.SAM3Model(operations=comfy.ops.disable_weight_init, image_model="SAM31" if multiplex else "SAM3")
    state = random_state(model, seed)
    text = sam3_clip.SAM3ClipModel(dtype=torch.float32)
    text_state = random_state(text.transformer, seed + 1)
    state.update(_open_clip_text_names(text_state, "detector.backbone.language_backbone.encoder."))
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(path))
    return path


# --- other Wan-based video models, as their templates load them --------------------------------------------------------
INT8_CONVROT = ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 16})


def save_int8_convrot_blocks(module: torch.nn.Module, path: Path, seed: int, blocks: str = "blocks.",
                             metadata: dict | None = None) -> Path:
    """A diffusion model file as the ``*_int8_convrot`` releases lay it out: the linear matrices of its transformer
    blocks (names starting with ``blocks``) int8 with ConvRot (group 16), everything else float32, random;
    ``metadata``: more header entries (LTX's ``config``)."""

    def chosen(key):
        return INT8_CONVROT if key.startswith(blocks) else None

    return save_quantized(random_state(module, seed), path, chosen, prefix="model.diffusion_model.", metadata=metadata)


def tiny_scail(dim: int = 128, layers: int = 1, scail2: bool = True) -> torch.nn.Module:
    """ComfyUI's SCAIL / SCAIL-2 class (comfy/ldm/wan/model.py: an I2V Wan whose pose latents, and with SCAIL-2 the
    28-channel identity masks, are patch-embedded beside the video's tokens) at a tiny width; 20 input channels (the
    latent and its 4-channel mask) as the released ones."""
    import comfy.ldm.wan.model as wan
    import comfy.ops

    cls = wan.SCAIL2WanModel if scail2 else wan.SCAILWanModel
    return cls(dim=dim, ffn_dim=2 * dim, num_heads=max(1, dim // 128), num_layers=layers, in_dim=20, out_dim=16,
               text_dim=4096, operations=comfy.ops.disable_weight_init)


# --- SeedVR2 (video upscaling) as its template loads it ---------------------------------------------------------------
# ComfyUI tells SeedVR2 3B from its 32nd block and builds it at its released width (2560, 20 heads of 128), and its
# VAE at fixed widths (128 to 512 channels): ``seedvr2_reduced`` makes both tiny while it is entered
# (``shrink_seedvr2`` for good, in a test's server); the 32 blocks stay (detection reads the last one).
SEEDVR2_TINY = {"vid_dim": 64, "heads": 2, "head_dim": 32, "rope_dim": 32}
SEEDVR2_TINY_VAE_CHANNELS = (32, 32, 32, 32)  # group-normalised in groups of 32


def _seedvr2_reductions() -> list[tuple[object, str, object]]:
    import comfy.ldm.seedvr.model as model
    import comfy.ldm.seedvr.vae as vae

    with _reduced(model, "NaDiT", **SEEDVR2_TINY) as cls:
        return [(model, "NaDiT", cls), (vae, "BYTEDANCE_BLOCK_OUT_CHANNELS", SEEDVR2_TINY_VAE_CHANNELS)]


def seedvr2_reduced():
    """While the block runs, ComfyUI builds SeedVR2's DiT and VAE at the tiny sizes above."""
    return _replaced(_seedvr2_reductions())


def shrink_seedvr2() -> None:
    """ComfyUI builds SeedVR2 at the tiny sizes above from now on (a test's server)."""
    for namespace, name, value in _seedvr2_reductions():
        _set(namespace, name, value)


def tiny_seedvr2() -> torch.nn.Module:
    """SeedVR2 3B's DiT (``NaDiT``) as ComfyUI's detection configures it, at the tiny size (inside
    ``seedvr2_reduced``)."""
    import comfy.ldm.seedvr.model as model
    import comfy.ops

    return model.NaDiT(norm_eps=1e-5, num_layers=32, mlp_type="swiglu", vid_out_norm=True, image_model="seedvr2",
                       operations=comfy.ops.disable_weight_init)


def save_seedvr2_vae(path: Path, seed: int, dtype=torch.float16) -> Path:
    """SeedVR2's VAE file (``seedvr2_ema_vae_fp16``), random, at the tiny widths (inside ``seedvr2_reduced``)."""
    import comfy.ldm.seedvr.vae as vae
    from safetensors.torch import save_file

    state = random_state(vae.VideoAutoencoderKLWrapper(), seed)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(path))
    return path


# --- audio encoders (wav2vec2) as Load Audio Encoder loads them, and the audio-driven Wan models -------------------------
# ComfyUI reads a wav2vec2 file's width and builds its large (1024 wide, 24 layers: Wan 2.2 S2V's) or base (768, 12:
# InfiniteTalk's Chinese one) configuration. A test's server takes these tiny widths as those (``shrink_wav2vec2``):
# the same configuration flags, two layers, four heads. Its convolutional feature encoder (512 channels) is the class's.
WAV2VEC2_CONFIGS = {  # ComfyUI's (comfy/audio_encoders/audio_encoders.py), by released width
    1024: {"conv_norm": True, "conv_bias": True, "do_normalize": True, "do_stable_layer_norm": True},
    768: {"conv_norm": False, "conv_bias": False, "do_normalize": False, "do_stable_layer_norm": False},
}
WAV2VEC2_TINY = {1024: {"embed_dim": 64, "num_heads": 4, "num_layers": 2},
                 768: {"embed_dim": 48, "num_heads": 4, "num_layers": 2}}


def _wav2vec2_config(released_width: int) -> dict:
    return {"model_type": "wav2vec2", **WAV2VEC2_TINY[released_width], **WAV2VEC2_CONFIGS[released_width]}


def shrink_wav2vec2() -> None:
    """Load Audio Encoder builds a wav2vec2 file of a tiny width (``WAV2VEC2_TINY``) with ComfyUI's configuration of
    the released width it stands for, from now on (a test's server); any other file as ComfyUI does."""
    import logging

    import comfy.audio_encoders.audio_encoders as audio_encoders
    import comfy.utils

    original = audio_encoders.load_audio_encoder_from_sd
    tiny_widths = {config["embed_dim"]: width for width, config in WAV2VEC2_TINY.items()}

    def load_audio_encoder_from_sd(sd, prefix=""):
        sd = comfy.utils.state_dict_prefix_replace(sd, {"wav2vec2.": ""})
        norm = sd.get("encoder.layer_norm.bias")
        if norm is None or norm.shape[0] not in tiny_widths:
            return original(sd, prefix)
        encoder = audio_encoders.AudioEncoderModel(_wav2vec2_config(tiny_widths[norm.shape[0]]))
        missing, unexpected = encoder.load_sd(sd)
        if missing or unexpected:
            logging.warning("tiny wav2vec2: missing %s, unexpected %s", missing, unexpected)
        return encoder

    audio_encoders.load_audio_encoder_from_sd = load_audio_encoder_from_sd


def save_wav2vec2(path: Path, seed: int, released_width: int = 1024, dtype=torch.float16) -> Path:
    """A wav2vec2 file as Load Audio Encoder reads it (``wav2vec2_large_english_fp16``: 1024; the Chinese base one:
    768), random, at the tiny width that stands for it."""
    import comfy.ops
    from comfy.audio_encoders.wav2vec2 import Wav2Vec2Model
    from safetensors.torch import save_file

    config = {k: v for k, v in _wav2vec2_config(released_width).items() if k != "model_type"}
    model = Wav2Vec2Model(**config, operations=comfy.ops.disable_weight_init)
    save_file({k: v.to(dtype).contiguous() for k, v in random_state(model, seed).items()}, str(path))
    return path


# Wan 2.2 S2V reads wav2vec2 large's 25 hidden states (1024 wide) whatever its file holds: at the tiny wav2vec2's
# width and count in a test's server (``shrink_wan_s2v``).
WAN_S2V_TINY_AUDIO = {"audio_dim": WAV2VEC2_TINY[1024]["embed_dim"],
                      "audio_layers": WAV2VEC2_TINY[1024]["num_layers"] + 1}


def _wan_s2v_reductions() -> list[tuple[object, str, object]]:
    import comfy.ldm.wan.model as wan

    with _reduced(wan, "WanModel_S2V", audio_dim=WAN_S2V_TINY_AUDIO["audio_dim"]) as s2v, \
            _reduced(wan, "CausalAudioEncoder", num_layers=WAN_S2V_TINY_AUDIO["audio_layers"]) as audio:
        return [(wan, "WanModel_S2V", s2v), (wan, "CausalAudioEncoder", audio)]


def wan_s2v_reduced():
    """While the block runs, ComfyUI builds Wan 2.2 S2V's audio input at the tiny wav2vec2's size."""
    return _replaced(_wan_s2v_reductions())


def shrink_wan_s2v() -> None:
    """ComfyUI builds Wan 2.2 S2V's audio input at the tiny wav2vec2's size from now on (a test's server)."""
    for namespace, name, value in _wan_s2v_reductions():
        _set(namespace, name, value)


def tiny_wan_s2v(dim: int = 128, layers: int = 2) -> torch.nn.Module:
    """ComfyUI's Wan 2.2 S2V class (``WanModel_S2V``: audio tokens from wav2vec2's hidden states, injected into the
    blocks; the reference and motion frames) at a tiny width, its audio input at the tiny wav2vec2's."""
    import comfy.ldm.wan.model as wan
    import comfy.ops

    with wan_s2v_reduced():
        return wan.WanModel_S2V(dim=dim, ffn_dim=2 * dim, num_heads=max(1, dim // 128), num_layers=layers,
                                text_dim=4096, operations=comfy.ops.disable_weight_init)


# --- HunyuanVideo 1.5 (and Capybara, its edit and I2V fine-tune) as their templates load them --------------------------
# ComfyUI builds Qwen 2.5-VL 7B (the text model and its vision tower) and the 1.5 VAE at fixed sizes: at these in a
# test's server (``shrink_hunyuan_video_15``; four Qwen layers: HunyuanVideo 1.5 reads the third from last). The Qwen
# keys' width ComfyUI tells the 7B by (k_proj: 4 heads x 128) and the widths the DiT reads (ByT5's 1472, SigLIP's
# 1152) stay; ByT5 and SigLIP 384 come from configuration files, which a test's ComfyUI copy gets with these entries
# (their layers cut; SigLIP's file names the 23rd layer detection reads).
QWEN25_7B_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 4}
QWEN25_VL_VISION_TINY = {"hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_layers": 1}
BYT5_SMALL_GLYPH_TINY = {"num_layers": 1, "d_ff": 64}
SIGLIP_384_TINY = {"num_hidden_layers": 2, "intermediate_size": 64}
SIGLIP_384_DETECTED_LAYER = "vision_model.encoder.layers.22.layer_norm1.weight"


def _hunyuan_video_15_reductions() -> list[tuple[object, str, object]]:
    import functools

    import comfy.ldm.hunyuan_video.vae_refiner as refiner
    import comfy.text_encoders.llama as llama
    import comfy.text_encoders.qwen_vl as qwen_vl

    replaced = [(llama, "Qwen25_7BVLI_Config", functools.partial(llama.Qwen25_7BVLI_Config, **QWEN25_7B_TINY))]
    for namespace, name, overrides in ((qwen_vl, "Qwen2VLVisionTransformer", QWEN25_VL_VISION_TINY),
                                       (refiner, "Encoder", HUNYUAN_VIDEO_15_VAE_TINY),
                                       (refiner, "Decoder", HUNYUAN_VIDEO_15_VAE_TINY)):
        with _reduced(namespace, name, **overrides) as cls:
            replaced.append((namespace, name, cls))
    return replaced


def hunyuan_video_15_reduced():
    """While the block runs, ComfyUI builds Qwen 2.5-VL 7B and HunyuanVideo 1.5's VAE at the tiny sizes above."""
    return _replaced(_hunyuan_video_15_reductions())


def shrink_hunyuan_video_15() -> None:
    """ComfyUI builds Qwen 2.5-VL 7B and HunyuanVideo 1.5's VAE at the tiny sizes above from now on (a test's server)."""
    for namespace, name, value in _hunyuan_video_15_reductions():
        _set(namespace, name, value)


def save_qwen25_7b(path: Path, seed: int, dtype=torch.bfloat16) -> Path:
    """Qwen 2.5-VL 7B as a text encoder file (``qwen_2.5_vl_7b``: the language model and its vision tower, in the
    keys ComfyUI's Load CLIP detects), random, at the tiny size (inside ``hunyuan_video_15_reduced``)."""
    import comfy.ops
    import comfy.text_encoders.llama as llama
    from safetensors.torch import save_file

    model = llama.Qwen25_7BVLI({}, torch.float32, "cpu", comfy.ops.disable_weight_init)
    save_file({k: v.to(dtype).contiguous() for k, v in random_state(model, seed).items()}, str(path))
    return path


def json_config(comfy_dir: str | Path, relative: str, **overrides) -> dict:
    """A configuration file of the checkout ``comfy_dir`` (``relative`` to it) with ``overrides``."""
    import json

    return {**json.loads((Path(comfy_dir) / relative).read_text()), **overrides}


def save_byt5_small_glyph(path: Path, config: dict, seed: int, dtype=torch.float16) -> Path:
    """The glyph ByT5 text encoder file (``byt5_small_glyphxl_fp16``: the T5 encoder's names) for ``config``,
    random."""
    import comfy.ops
    import comfy.text_encoders.t5 as t5
    from safetensors.torch import save_file

    model = t5.T5(config, torch.float32, "cpu", comfy.ops.manual_cast)
    save_file({k: v.to(dtype).contiguous() for k, v in random_state(model, seed).items()}, str(path))
    return path


def save_siglip_384(path: Path, config: dict, seed: int, dtype=torch.float16) -> Path:
    """SigLIP 384 as Load CLIP Vision reads it (``sigclip_vision_patch14_384``) for ``config`` (layers cut), random;
    it names the 23rd layer ComfyUI's detection looks for."""
    from safetensors.torch import save_file

    model = tiny_clip_vision(config, seed=seed, dtype=dtype)
    state = {k: v.contiguous() for k, v in model.get_sd().items()}
    state[SIGLIP_384_DETECTED_LAYER] = torch.ones(config["hidden_size"], dtype=dtype)
    save_file(state, str(path))
    return path


def save_hunyuan_video_15_vae(path: Path, seed: int, dtype=torch.float16) -> Path:
    """HunyuanVideo 1.5's VAE file (``hunyuanvideo15_vae_fp16``), random, at the tiny widths ComfyUI builds it at in a
    test's server."""
    from safetensors.torch import save_file

    vae = tiny_hunyuan_video_15_vae(seed=seed)
    save_file({k: v.to(dtype).contiguous() for k, v in vae.get_sd().items()}, str(path))
    return path


# --- LTX-2.3 as its templates load it ---------------------------------------------------------------------------------
# The LTX-2.3 checkpoint (``ltx-2.3-22b-dev-fp8``) holds the diffusion model, the video VAE, the audio VAE with its
# vocoder and the text encoder's projection, its header's ``config`` describing each (ComfyUI reads them from there:
# the transformer's options over what its shapes say, the VAEs' whole layout). The tiny one keeps 2.3's options (gated
# attention, cross-attention AdaLN, caption projections before the connectors, dual text projections: the connectors
# take the video and the audio stream's own widths) at LTXAV_TINY's widths.
LTX23_TINY = {**LTXAV_TINY, "apply_gated_attention": True, "cross_attention_adaln": True,
              "caption_proj_before_connector": True, "caption_projection_first_linear": False,
              "connector_apply_gated_attention": True, "audio_connector_num_attention_heads": 2,
              "audio_connector_attention_head_dim": 16}
# LTX-2's video VAE (version 2's block kinds: space, time and space-time compression with residuals), one layer a
# block and 32 base channels.
LTX2_TINY_VAE = {
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space_res", {"multiplier": 2}],
                       ["compress_time_res", {"multiplier": 2}], ["compress_all_res", {"multiplier": 2}],
                       ["compress_all_res", {"multiplier": 1}], ["res_x", {"num_layers": 1}]],
    "decoder_blocks": [["res_x", {"num_layers": 1, "inject_noise": False}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["compress_all", {"residual": True, "multiplier": 2}],
                       ["res_x", {"num_layers": 1, "inject_noise": False}]],
    "encoder_base_channels": 16, "decoder_base_channels": 16,
    "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
    "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False,
}
# Gemma 3 12B (comfy/text_encoders/llama.py builds it at a fixed size, and its SigLIP tower with it): reduced while
# ``gemma3_12b_reduced`` is entered (``shrink_gemma3_12b`` for good, in a test's server). Its file keeps the released
# layer count's last layer name (ComfyUI's Load CLIP tells Gemma 3 12B by it, and from Gemma 4 12B by a sixth layer's
# value projection: six layers, five local ones and a global one as released); the head width stays 256.
GEMMA3_12B_TINY = {**GEMMA3_TINY, "num_hidden_layers": 6}
GEMMA3_12B_TINY_VISION = {**GEMMA3_TINY_VISION, "image_size": 56}
# LTX-2.3's latent upscaler (comfy/ldm/lightricks/latent_upsampler.py), its configuration in the header as released.
LTX23_TINY_UPSAMPLER = {"_class_name": "LatentUpsampler", "in_channels": 128, "mid_channels": 32,
                        "num_blocks_per_stage": 1, "dims": 3, "spatial_upsample": True, "temporal_upsample": False,
                        "spatial_scale": 2.0, "rational_resampler": False}


def _gemma3_12b_reductions():
    import dataclasses

    import comfy.text_encoders.llama as llama

    base = llama.Gemma3_12B_Config
    if getattr(base, "_tiny", False):
        return []
    fields = {**GEMMA3_12B_TINY, "vision_config": {**llama.GEMMA3_VISION_CONFIG, **GEMMA3_12B_TINY_VISION}}
    reduced = dataclasses.make_dataclass(
        base.__name__, [(k, type(v), dataclasses.field(default_factory=lambda v=v: v)) for k, v in fields.items()],
        bases=(base,))
    reduced._tiny = True
    reduced.__module__ = base.__module__
    return [(llama, "Gemma3_12B_Config", reduced)]


@contextlib.contextmanager
def gemma3_12b_reduced():
    """While the block runs, ComfyUI builds Gemma 3 12B (LTX-2's text encoder) at the tiny size above."""
    replaced = _gemma3_12b_reductions()
    saved = [(namespace, name, _get(namespace, name)) for namespace, name, _ in replaced]
    try:
        for namespace, name, value in replaced:
            _set(namespace, name, value)
        yield
    finally:
        for namespace, name, value in saved:
            _set(namespace, name, value)


def shrink_gemma3_12b() -> None:
    """ComfyUI builds Gemma 3 12B at the tiny size above from now on (a test's server)."""
    for namespace, name, value in _gemma3_12b_reductions():
        _set(namespace, name, value)


def save_gemma3_12b(path: Path, seed: int, quantized: bool = True, dtype=torch.bfloat16) -> Path:
    """Gemma 3 12B as LTX-2's templates load it (``gemma_3_12B_it_fp4_mixed``: the language model, its vision tower
    and projector, the SentencePiece model as ``spiece_model``), random, at the tiny size (inside
    ``gemma3_12b_reduced``): the language layers' attention and feed-forward matrices nvfp4, the rest bf16 (the mixed
    form), and an empty last layer name where the released file's 48th layer is."""
    import comfy.ops
    import comfy.text_encoders.llama as llama
    from safetensors.torch import save_file

    module = llama.Gemma3_12B({}, torch.float32, "cpu", comfy.ops.manual_cast)
    state = {k: v.to(dtype) for k, v in random_state(module, seed).items()}
    state["model.layers.47.self_attn.q_norm.weight"] = torch.zeros(0, dtype=dtype)
    extra = gemma_tokenizer_data()
    if not quantized:
        save_file({**state, **extra}, str(path))
        return path

    def chosen(key):
        return ("nvfp4", {}) if key.startswith("model.layers.") and "_proj." in key else None

    return save_quantized(state, path, chosen, extra=extra)


def tiny_ltx23(**overrides) -> tuple[torch.nn.Module, dict]:
    """ComfyUI's LTX-2 class with LTX-2.3's options at a tiny size, and its header's transformer config."""
    config = {**LTX23_TINY, **overrides}
    module, _ = tiny_ltxav(**config)
    return module, config


def save_ltx23_checkpoint(path: Path, seed: int, dit_dtype=torch.float16, generation: str = "2.3") -> Path:
    """The LTX-2.3 checkpoint as its templates name it (``ltx-2.3-22b-dev-fp8``): ``model.diffusion_model.`` (the
    tiny LTX-2.3 transformer), ``vae.`` (the video VAE), ``audio_vae.`` and ``vocoder.`` (the audio VAE), the text
    encoder's dual projection (``text_embedding_projection.``: Gemma 3's stacked states to the video and the audio
    connectors' widths), with the header's ``config`` of each. The transformer's weights are ``dit_dtype`` (the tests'
    loaders read fp8, fp16 and bf16 names alike), the rest float32. ``generation`` "2.0": LTX-2's checkpoint
    (``ltx-2-19b-dev-fp8``) instead: the transformer without 2.3's options (LTXAV_TINY) and a single projection
    (``text_embedding_projection.aggregate_embed``) to its caption width, which both connectors take."""
    import json

    import comfy.ldm.lightricks.vae.audio_vae as audio_vae
    import comfy.ldm.lightricks.vae.causal_video_autoencoder as video_vae
    import comfy.ops
    import comfy.text_encoders.lt as lt
    from safetensors.torch import save_file

    module, transformer = tiny_ltx23() if generation == "2.3" else (tiny_ltxav()[0], dict(LTXAV_TINY))
    config = {"transformer": transformer, "vae": LTX2_TINY_VAE, "audio_vae": LTXAV_TINY_AUDIO_VAE,
              "vocoder": LTXAV_TINY_VOCODER}
    metadata = {"config": json.dumps(config)}
    state = {f"model.diffusion_model.{k}": v.to(dit_dtype) for k, v in random_state(module, seed).items()}
    vae = random_state(video_vae.VideoVAE(config=LTX2_TINY_VAE), seed + 1)
    for name in [k for k in vae if k.endswith("std-of-means")]:
        vae[name] = vae[name].abs() + 0.5
    state.update({f"vae.{k}": v for k, v in vae.items()})
    audio = random_state(audio_vae.AudioVAE(metadata=metadata), seed + 2)
    for name in [k for k in audio if k.endswith("std-of-means")]:
        audio[name] = audio[name].abs() + 0.5
    state.update({("audio_vae." + k[len("autoencoder."):] if k.startswith("autoencoder.") else k): v
                  for k, v in audio.items()})
    hidden = GEMMA3_12B_TINY["hidden_size"] * (GEMMA3_12B_TINY["num_hidden_layers"] + 1)
    if generation == "2.3":
        projection = lt.DualLinearProjection(hidden, transformer["cross_attention_dim"],
                                             transformer["audio_cross_attention_dim"],
                                             operations=comfy.ops.disable_weight_init)
        state.update({f"text_embedding_projection.{k}": v for k, v in random_state(projection, seed + 3).items()})
    else:
        projection = torch.nn.Linear(hidden, transformer["caption_channels"], bias=False)
        state.update({f"text_embedding_projection.aggregate_embed.{k}": v
                      for k, v in random_state(projection, seed + 3).items()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)
    return path


def save_ltx23_upsampler(path: Path, seed: int) -> Path:
    """LTX-2.3's spatial latent upscaler (``ltx-2.3-spatial-upscaler-x2-1.1``), random, at a tiny width, its
    configuration in the header as released."""
    import json

    import comfy.ops
    from comfy.ldm.lightricks.latent_upsampler import LatentUpsampler
    from safetensors.torch import save_file

    module = LatentUpsampler.from_config(LTX23_TINY_UPSAMPLER, operations=comfy.ops.disable_weight_init)
    state = {k: v.to(torch.bfloat16) for k, v in random_state(module, seed).items()}
    save_file(state, str(path), metadata={"config": json.dumps(LTX23_TINY_UPSAMPLER)})
    return path


def ltx23_lora(seed: int, rank: int = 4, generation: str = "2.3") -> dict[str, torch.Tensor]:
    """A LoRA (``lora_A`` / ``lora_B``, bf16) for the attention and feed-forward matrices of the tiny LTX-2.3
    transformer's blocks (``generation`` "2.0": LTX-2's), in the ``diffusion_model.`` names LTX-2's LoRAs carry."""
    import re

    module = tiny_ltx23()[0] if generation == "2.3" else tiny_ltxav()[0]
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Linear) and re.match(r"transformer_blocks\.\d+\.(attn\d|audio_attn\d|ff|audio_ff)",
                                                         name):
            key = f"diffusion_model.{name}"
            out[f"{key}.lora_A.weight"] = (torch.randn(rank, sub.in_features, generator=g) * 0.05).to(torch.bfloat16)
            out[f"{key}.lora_B.weight"] = (torch.randn(sub.out_features, rank, generator=g) * 0.05).to(torch.bfloat16)
    return out


def gemma3_12b_lora(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """A LoRA for the tiny Gemma 3 12B's attention and feed-forward matrices (inside ``gemma3_12b_reduced``), in the
    ``text_encoders.`` names ComfyUI maps to a text encoder's weights."""
    import comfy.ops
    import comfy.text_encoders.llama as llama

    module = llama.Gemma3_12B({}, torch.float32, "cpu", comfy.ops.manual_cast)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Linear) and name.startswith("model.layers.") and name.endswith("_proj"):
            key = f"text_encoders.gemma3_12b.transformer.{name}"
            out[f"{key}.lora_A.weight"] = (torch.randn(rank, sub.in_features, generator=g) * 0.05).to(torch.bfloat16)
            out[f"{key}.lora_B.weight"] = (torch.randn(sub.out_features, rank, generator=g) * 0.05).to(torch.bfloat16)
    return out



# --- LTX-2.5: its transformer, VAEs and Gemma 4 text encoders as separate files ------------------------------------------
# Gemma 4 12B (LTX-2.5's text encoder, with LTX's text projection in its file) and Gemma 4 E2B (the prompt enhancer:
# text, image and audio towers) as comfy/text_encoders/gemma4.py builds them at a fixed size: reduced while
# ``gemma4_reduced`` is entered (``shrink_gemma4`` for good, in a test's server). Their files keep the released layer
# count's last layer name (ComfyUI's Load CLIP tells the variants apart by it); 12B keeps six layers (five local, a
# global one without its value projection: how Load CLIP tells it from Gemma 3 12B).
GEMMA4_TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
               "num_key_value_heads": 1}
GEMMA4_TINY_HEADS = {"head_dim": 32, "global_head_dim": 64}
GEMMA4_12B_TINY = {**GEMMA4_TINY, "num_hidden_layers": 6}
GEMMA4_E2B_TINY = {**GEMMA4_TINY, "num_hidden_layers": 5, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16}
GEMMA4_TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
                      "head_dim": 16}
GEMMA4_TINY_AUDIO = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                     "output_proj_dims": 32}
GEMMA4_TINY_UNIFIED_VISION = {"mm_embed_dim": 32, "output_proj_dims": 32}
GEMMA4_TINY_UNIFIED_AUDIO = {"output_proj_dims": 32}
# Gemma 4's chat markers and media placeholders (ids as released where ComfyUI's code names them)
GEMMA4_SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<|turn>": 4, "<turn|>": 5, "<|channel>": 6,
                  "<channel|>": 7, "<|think|>": 8, "<|image>": 9, "<image|>": 10, "<|audio>": 11, "<audio|>": 12,
                  "<|image|>": 258880, "<|audio|>": 258881, "<|video|>": 258884}


def gemma4_tokenizer_data() -> dict:
    """A tiny word-level tokenizer (the ``tokenizers`` JSON Gemma 4's files carry as ``tokenizer_json``) with Gemma's
    special ids (pad 0, eos 1, bos 2) and Gemma 4's chat markers; every other id below the tiny vocabulary a word."""
    import re

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from ..engine.tiny import CORPUS

    vocab = dict(GEMMA4_SPECIAL)
    words = sorted({w for line in CORPUS for w in re.findall(r"\w+|[^\w\s]", line.lower())})
    free = (i for i in range(GEMMA4_TINY["vocab_size"]) if i not in vocab.values())
    for i in free:
        vocab[words.pop(0) if words else f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA4_SPECIAL])
    text = tok.to_str()
    return {"tokenizer_json": torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)}


def _gemma4_reductions():
    import dataclasses

    import comfy.text_encoders.gemma4 as gemma4

    if getattr(gemma4.Gemma4_12B_Config, "_tiny", False):
        return []

    def reduced(base, fields, attributes):
        cls = dataclasses.make_dataclass(
            base.__name__, [(k, type(v), dataclasses.field(default=v)) for k, v in fields.items()], bases=(base,))
        for k, v in attributes.items():
            setattr(cls, k, v)
        cls._tiny = True
        cls.__module__ = base.__module__
        return cls

    e2b = reduced(gemma4.Gemma4_E2B_Config, GEMMA4_E2B_TINY, {
        **GEMMA4_TINY_HEADS, "sliding_attention": [512, 512, False],
        "vision_config": {**gemma4.GEMMA4_VISION_CONFIG, **GEMMA4_TINY_VISION},
        "audio_config": {**gemma4.GEMMA4_AUDIO_CONFIG, **GEMMA4_TINY_AUDIO}})
    twelve = reduced(gemma4.Gemma4_12B_Config, GEMMA4_12B_TINY, {
        **GEMMA4_TINY_HEADS,
        "vision_config": {**gemma4.GEMMA4_UNIFIED_VISION_CONFIG, **GEMMA4_TINY_UNIFIED_VISION},
        "audio_config": {**gemma4.GEMMA4_UNIFIED_AUDIO_CONFIG, **GEMMA4_TINY_UNIFIED_AUDIO}})
    return [(gemma4, "Gemma4_12B_Config", twelve), (gemma4, "Gemma4_E2B_Config", e2b),
            (gemma4, "Gemma4_E2B", gemma4._make_variant(e2b))]


@contextlib.contextmanager
def gemma4_reduced():
    """While the block runs, ComfyUI builds Gemma 4 12B and E2B at the tiny sizes above."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced_cm(_gemma4_reductions()))
        yield


@contextlib.contextmanager
def _replaced_cm(replaced):
    saved = [(namespace, name, _get(namespace, name)) for namespace, name, _ in replaced]
    try:
        for namespace, name, value in replaced:
            _set(namespace, name, value)
        yield
    finally:
        for namespace, name, value in reversed(saved):
            _set(namespace, name, value)


def shrink_gemma4() -> None:
    """ComfyUI builds Gemma 4 12B and E2B at the tiny sizes above from now on (a test's server)."""
    for namespace, name, value in _gemma4_reductions():
        _set(namespace, name, value)


def _gemma4_int8_convrot(key):
    return INT8_CONVROT if key.startswith("model.layers.") and "_proj." in key else None


def save_gemma4_e2b(path: Path, seed: int) -> Path:
    """Gemma 4 E2B as LTX-2.5's prompt enhancer loads it (``gemma4_e2b_it_int8_convrot``: the language model with its
    per-layer inputs, the vision and audio towers and projectors, the tokenizer), random, at the tiny size (inside
    ``gemma4_reduced``): the language layers' attention and feed-forward matrices int8 ConvRot, the rest bf16."""
    import comfy.ops
    import comfy.text_encoders.gemma4 as gemma4

    module = gemma4.Gemma4_E2B({}, torch.float32, "cpu", comfy.ops.manual_cast)
    state = {k: v.to(torch.bfloat16) for k, v in random_state(module, seed).items()}
    state["model.layers.34.self_attn.q_norm.weight"] = torch.zeros(0, dtype=torch.bfloat16)
    return save_quantized(state, path, _gemma4_int8_convrot, extra=gemma4_tokenizer_data())


def save_gemma4_12b_with_projection(path: Path, seed: int) -> Path:
    """Gemma 4 12B as LTX-2.5's templates load it (``gemma4-12b-with-proj-ltx-2.5-comfy-int8-convrot``: the language
    model, its encoder-free image and audio embedders, LTX's dual text projection to the tiny LTX-2.3 transformer's
    video and audio widths, the tokenizer), random, at the tiny size (inside ``gemma4_reduced``): the language
    layers' attention and feed-forward matrices int8 ConvRot, the rest bf16."""
    import comfy.ops
    import comfy.text_encoders.gemma4 as gemma4
    import comfy.text_encoders.lt as lt

    module = gemma4.Gemma4_12B({}, torch.float32, "cpu", comfy.ops.manual_cast)
    state = {k: v.to(torch.bfloat16) for k, v in random_state(module, seed).items()}
    state["model.layers.47.self_attn.q_norm.weight"] = torch.zeros(0, dtype=torch.bfloat16)
    hidden = GEMMA4_12B_TINY["hidden_size"] * (GEMMA4_12B_TINY["num_hidden_layers"] + 1)
    transformer = tiny_ltx23()[1]
    projection = lt.DualLinearProjection(hidden, transformer["cross_attention_dim"],
                                         transformer["audio_cross_attention_dim"],
                                         operations=comfy.ops.disable_weight_init)
    state.update({f"text_embedding_projection.{k}": v.to(torch.bfloat16)
                  for k, v in random_state(projection, seed + 1).items()})
    return save_quantized(state, path, _gemma4_int8_convrot, extra=gemma4_tokenizer_data())


def save_ltx25_transformer(path: Path, seed: int) -> Path:
    """LTX-2.5's transformer alone (``ltx-2.5-22b-distilled-transformer-comfy-int8-convrot``): the tiny LTX-2.3
    transformer, its blocks' matrices int8 ConvRot, its config in the header."""
    import json

    module, config = tiny_ltx23()
    return save_int8_convrot_blocks(module, path, seed, blocks="transformer_blocks.",
                                    metadata={"config": json.dumps({"transformer": config})})


def save_ltx25_video_vae(path: Path, seed: int) -> Path:
    """LTX-2.5's video VAE alone (``ltx-2.5-video-vae-bf16``), the tiny LTX-2 one, its config in the header."""
    import json

    import comfy.ldm.lightricks.vae.causal_video_autoencoder as video_vae
    from safetensors.torch import save_file

    vae = random_state(video_vae.VideoVAE(config=LTX2_TINY_VAE), seed)
    for name in [k for k in vae if k.endswith("std-of-means")]:
        vae[name] = vae[name].abs() + 0.5
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in vae.items()}, str(path),
              metadata={"config": json.dumps({"vae": LTX2_TINY_VAE})})
    return path


def save_ltx25_audio_vae(path: Path, seed: int) -> Path:
    """LTX-2.5's audio VAE and vocoder alone (``ltx-2.5-audio-vae-bf16``), the tiny LTX-2 ones, their config in the
    header."""
    import json

    import comfy.ldm.lightricks.vae.audio_vae as audio_vae
    from safetensors.torch import save_file

    metadata = {"config": json.dumps({"audio_vae": LTXAV_TINY_AUDIO_VAE, "vocoder": LTXAV_TINY_VOCODER})}
    audio = random_state(audio_vae.AudioVAE(metadata=metadata), seed)
    for name in [k for k in audio if k.endswith("std-of-means")]:
        audio[name] = audio[name].abs() + 0.5
    state = {("audio_vae." + k[len("autoencoder."):] if k.startswith("autoencoder.") else k): v.to(torch.bfloat16)
             for k, v in audio.items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)
    return path
