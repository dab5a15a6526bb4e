"""LTX-2 from ComfyUI's single files: the architecture read from tensor shapes, keys mapped to diffusers' names.

ComfyUI's LTX-2 templates place three files:

- ``models/checkpoints/``: the all-in-one checkpoint (``ltx-2-19b-dev.safetensors``): the transformer under
  ``model.diffusion_model.``, the text connectors (``model.diffusion_model.{video,audio}_embeddings_connector.``
  and the top-level ``text_embedding_projection.aggregate_embed``), the video VAE (``vae.``), the audio VAE
  (``audio_vae.``) and the vocoder (``vocoder.``). Names are mapped with diffusers' own
  ``convert_ltx2_transformer_to_diffusers`` / ``convert_ltx2_vae_to_diffusers`` /
  ``convert_ltx2_audio_vae_to_diffusers``; the connectors and the vocoder have no diffusers single-file converter,
  their mapping is written here (``CONNECTOR_NAMES``, ``VOCODER_NAMES``).
- ``models/text_encoders/``: Gemma 3 (``gemma_3_12B_it.safetensors``) in transformers' names (``model.layers.N``),
  with its SentencePiece model inside as a uint8 tensor ``spiece_model`` (ComfyUI's tokenizer comes from there).
- ``models/latent_upscale_models/``: the spatial upsampler (``ltx-2-spatial-upscaler-x2-1.0.safetensors``), in
  the names diffusers' ``LTX2LatentUpsamplerModel`` uses.

Configurations: widths, layer counts, channels and the 2.3 features present are read from shapes. What shapes
cannot tell (attention head counts, Gemma's sliding-window pattern, the vocoder's strides and dilations, the audio
VAE's resolution) is the released model's (diffusers' class defaults, Gemma 3 12B's published config), as
ComfyUI's own detection assumes it (32 heads). For another model, a diffusers folder of its configs (the file role
``config``, as diffusers' ``from_single_file(config=...)``) gives them: each component's config there replaces what
was assumed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ...engine.weights import quant_aux, read_header
from ...errors import ModelFolderError

TRANSFORMER = "model.diffusion_model."
VIDEO_HEADS = AUDIO_HEADS = 32  # ComfyUI's model_detection: every released LTX-2 transformer


@dataclass
class LTX2Files:
    """ComfyUI single files standing in for an LTX-2 diffusers folder."""

    checkpoint: Path
    text_encoder: Path
    latent_upscaler: Path | None = None
    tokenizer: Path | None = None  # a Gemma tokenizer folder, for a text-encoder file without spiece_model
    config: Path | None = None  # a diffusers folder of the model's configs, for a model other than the released ones


def _checkpoint_keys(path) -> set[str] | None:
    try:
        return set(read_header(Path(path)))
    except (ModelFolderError, OSError):
        return None


def recognise(files: dict) -> bool:
    """Whether ``files`` (role -> path) are LTX-2's: the checkpoint holds the audio-video transformer (its
    ``audio_adaln_single``), as ComfyUI's model detection recognises LTXAV."""
    path = files.get("checkpoint")
    if path is None or not Path(path).is_file():
        return False
    keys = _checkpoint_keys(path)
    return keys is not None and f"{TRANSFORMER}audio_adaln_single.linear.weight" in keys


def config_overrides(folder: Path | None) -> dict[str, dict]:
    """Component -> its config in the diffusers folder ``folder`` (the text encoder's text config), for what the
    single files' shapes cannot tell; empty without a folder."""
    if folder is None:
        return {}
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"config {folder} is not a folder: give a diffusers LTX-2 folder (or its configs)")
    out = {}
    for component in ("transformer", "connectors", "vae", "audio_vae", "vocoder", "text_encoder", "latent_upsampler"):
        path = folder / component / "config.json"
        if path.is_file():
            config = json.loads(path.read_text())
            config = config.get("text_config", config) if component == "text_encoder" else config
            out[component] = {k: v for k, v in config.items() if not k.startswith("_")}
    return out


def _defaults(cls) -> dict:
    from .architectures import _defaults as defaults

    return {k: v for k, v in defaults(cls).items() if not k.startswith("_")}


def _count(keys, pattern: str) -> int:
    rx = re.compile(pattern)
    return 1 + max((int(m.group(1)) for k in keys if (m := rx.match(k))), default=-1)


# --- key names ---------------------------------------------------------------------------------------------------
CONNECTOR_NAMES = (  # ComfyUI / ltx-core -> diffusers LTX2TextConnectors (2.0)
    ("text_embedding_projection.aggregate_embed.", "text_proj_in."),
    ("text_embedding_projection.video_aggregate_embed.", "video_text_proj_in."),  # 2.3
    ("text_embedding_projection.audio_aggregate_embed.", "audio_text_proj_in."),  # 2.3
    (TRANSFORMER + "video_embeddings_connector.", "video_connector."),
    (TRANSFORMER + "audio_embeddings_connector.", "audio_connector."),
)
VOCODER_NAMES = (("conv_pre.", "conv_in."), ("ups.", "upsamplers."), ("resblocks.", "resnets."),
                 ("conv_post.", "conv_out."), ("act_post.", "act_out."))


_TRANSFORMER_TO_ORIGINAL = (("audio_time_embed.", "audio_adaln_single."), ("prompt_adaln.", "prompt_adaln_single."),
                            ("audio_prompt_adaln.", "audio_prompt_adaln_single."), ("time_embed.", "adaln_single."),
                            ("audio_proj_in.", "audio_patchify_proj."), ("proj_in.", "patchify_proj."),
                            ("av_cross_attn_video_scale_shift.", "av_ca_video_scale_shift_adaln_single."),
                            ("av_cross_attn_video_a2v_gate.", "av_ca_a2v_gate_adaln_single."),
                            ("av_cross_attn_audio_scale_shift.", "av_ca_audio_scale_shift_adaln_single."),
                            ("av_cross_attn_audio_v2a_gate.", "av_ca_v2a_gate_adaln_single."))


def transformer_to_original(name: str) -> str:
    """A diffusers ``LTX2VideoTransformer3DModel`` name -> the original (ltx-core, ComfyUI) one, without the
    checkpoint's ``model.diffusion_model.`` prefix: the inverse of diffusers' ``convert_ltx2_transformer_to_diffusers``
    renames, and the names LoRA files trained on the original model use (``diffusion_model.<name>``)."""
    for old, new in _TRANSFORMER_TO_ORIGINAL:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    return (name.replace("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video")
            .replace("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio")
            .replace(".norm_q.", ".q_norm.").replace(".norm_k.", ".k_norm."))


def connector_name(key: str) -> str | None:
    for old, new in CONNECTOR_NAMES:
        if key.startswith(old):
            rest = key[len(old):].replace("transformer_1d_blocks.", "transformer_blocks.")
            return new + rest.replace(".q_norm.", ".norm_q.").replace(".k_norm.", ".norm_k.")
    return None


def vocoder_name(key: str) -> str:
    """ComfyUI's vocoder name -> diffusers': HiFi-GAN (2.0: ``vocoder.conv_pre`` ...) or, with band extension (2.3),
    BigVGAN under ``vocoder.vocoder.`` and ``vocoder.bwe_generator.`` beside ``vocoder.mel_stft.``."""
    rest = key[len("vocoder."):]
    outer = ""
    for sub in ("vocoder.", "bwe_generator."):
        if rest.startswith(sub):
            outer, rest = sub, rest[len(sub):]
    for old, new in VOCODER_NAMES:
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return outer + rest.replace(".downsample.lowpass.filter", ".downsample.filter")


def _vae_name(key: str, encoder_blocks: int) -> str:
    """ComfyUI's video VAE name -> diffusers', for any number of stages (diffusers' converter knows the 2.0 VAE's
    four down and three up stages; 2.3's decoder has four): blocks alternate stage, re-sampler; the encoder's
    last block and the decoder's first are the mid blocks."""
    rest = key[len("vae."):].replace(".res_blocks.", ".resnets.")
    if rest.startswith("per_channel_statistics."):
        return {"mean-of-means": "latents_mean", "std-of-means": "latents_std"}.get(rest.split(".", 1)[1], rest)
    m = re.match(r"(encoder|decoder)\.(down|up)_blocks\.(\d+)\.(.*)", rest)
    if not m:
        return rest
    part, _, n, tail = m.groups()
    n = int(n)
    if part == "encoder":
        if n == encoder_blocks - 1:
            return f"encoder.mid_block.{tail}"
        return f"encoder.down_blocks.{n // 2}.{tail}" if n % 2 == 0 else \
            f"encoder.down_blocks.{n // 2}.downsamplers.0.{tail}"
    if n == 0:
        return f"decoder.mid_block.{tail}"
    return f"decoder.up_blocks.{n // 2}.upsamplers.0.{tail}" if n % 2 else f"decoder.up_blocks.{n // 2 - 1}.{tail}"


def checkpoint_names(path: Path) -> dict[str, dict[str, str]]:
    """component -> (file key -> diffusers name) of an all-in-one LTX-2 checkpoint."""
    from diffusers.loaders.single_file_utils import (convert_ltx2_audio_vae_to_diffusers,
                                                     convert_ltx2_transformer_to_diffusers,
                                                     convert_ltx2_vae_to_diffusers)

    header = read_header(Path(path), "LTX-2 checkpoint")
    aux = quant_aux(header)  # an fp8 checkpoint's scales and format records: read with their weights
    keys = [k for k in header if k not in aux]
    names: dict[str, dict[str, str]] = {c: {} for c in ("transformer", "connectors", "vae", "audio_vae", "vocoder")}
    for k in keys:
        if (c := connector_name(k)) is not None:
            names["connectors"][k] = c
    # diffusers' converters rename by substring: run them on the names alone (values are the original keys).
    transformer = {k: k for k in keys if k.startswith(TRANSFORMER) and k not in names["connectors"]}
    names["transformer"] = {v: re.sub(r"^(audio_)?prompt_adaln_single\.", r"\1prompt_adaln.", new)  # 2.3
                            for new, v in convert_ltx2_transformer_to_diffusers(transformer).items()}
    vae = [k for k in keys if k.startswith("vae.")]
    encoder_blocks = _count(vae, r"vae\.encoder\.down_blocks\.(\d+)\.")
    if encoder_blocks <= 9 and _count(vae, r"vae\.decoder\.up_blocks\.(\d+)\.") <= 7:  # diffusers' converter's
        names["vae"] = {v: new for new, v in convert_ltx2_vae_to_diffusers({k: k for k in vae}).items()}
    else:
        names["vae"] = {k: _vae_name(k, encoder_blocks) for k in vae
                        if not k.endswith(("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds"))}
    names["audio_vae"] = {v: new for new, v in convert_ltx2_audio_vae_to_diffusers(
        {k: k for k in keys if k.startswith("audio_vae.")}).items()}
    names["vocoder"] = {k: vocoder_name(k) for k in keys if k.startswith("vocoder.")}
    return names


# --- configs -------------------------------------------------------------------------------------------------
def checkpoint_configs(path: Path, overrides: dict | None = None) -> tuple[dict[str, dict], dict[str, dict[str, str]]]:
    """(component -> diffusers config, component -> names) of ComfyUI's all-in-one LTX-2 checkpoint; ``overrides``
    (component -> config) replace what the shapes cannot tell."""
    path = Path(path)
    header = read_header(path, "LTX-2 checkpoint")
    if f"{TRANSFORMER}audio_adaln_single.linear.weight" not in header:
        what = ("an LTX-Video (no sound) model" if f"{TRANSFORMER}adaln_single.linear.weight" in header
                else "not an LTX-2 checkpoint")
        raise ModelFolderError(f"{path} is {what}: it has no tensor {TRANSFORMER}audio_adaln_single.linear.weight. "
                               "Pick LTX-2's all-in-one checkpoint (ltx-2-19b-dev.safetensors, models/checkpoints/)")
    names = checkpoint_names(path)
    for component, prefix in (("vae", "vae."), ("audio_vae", "audio_vae."), ("vocoder", "vocoder."),
                              ("connectors", TRANSFORMER + "video_embeddings_connector.")):
        if not (names[component]):
            raise ModelFolderError(f"{path} has no {component} (no tensor under {prefix}): it is a transformer-only "
                                   "file; use the all-in-one LTX-2 checkpoint ComfyUI's templates load")
    shape = {c: {new: header[k][0] for k, new in n.items()} for c, n in names.items()}

    def need(component: str, name: str) -> tuple[int, ...]:
        if name not in shape[component]:
            raise ModelFolderError(f"{path}: the {component} has no tensor for {name}: the file is not an LTX-2 "
                                   "checkpoint this pack knows")
        return shape[component][name]

    transformer = _transformer_config(shape["transformer"], need)
    configs = {"transformer": transformer, "connectors": _connectors_config(shape["connectors"], need, transformer),
               "vae": _vae_config(shape["vae"], need), "audio_vae": _audio_vae_config(shape["audio_vae"], need)}
    configs["vocoder"], bwe = _vocoder_config(shape["vocoder"], need)
    for component, override in (overrides or {}).items():
        if component in configs:
            configs[component].update(override)
    configs["vocoder_class"] = {"name": "LTX2VocoderWithBWE" if bwe else "LTX2Vocoder"}
    return configs, names


def _transformer_config(t: dict, need) -> dict:
    """The transformer's config from its tensors' shapes ``t`` (name -> shape; ``need(component, name)`` refuses a
    missing one)."""
    from diffusers import LTX2VideoTransformer3DModel

    inner, in_ch = need("transformer", "proj_in.weight")
    audio_inner, audio_in = need("transformer", "audio_proj_in.weight")
    transformer = dict(_defaults(LTX2VideoTransformer3DModel), rope_type="split", rope_double_precision=True)
    transformer.update(
        in_channels=in_ch, out_channels=need("transformer", "proj_out.weight")[0], audio_in_channels=audio_in,
        audio_out_channels=need("transformer", "audio_proj_out.weight")[0],
        num_layers=_count(t, r"transformer_blocks\.(\d+)\."),
        num_attention_heads=VIDEO_HEADS, attention_head_dim=inner // VIDEO_HEADS,
        audio_num_attention_heads=AUDIO_HEADS, audio_attention_head_dim=audio_inner // AUDIO_HEADS,
        cross_attention_dim=need("transformer", "transformer_blocks.0.attn2.to_k.weight")[1],
        audio_cross_attention_dim=need("transformer", "transformer_blocks.0.audio_attn2.to_k.weight")[1],
        gated_attn="transformer_blocks.0.attn1.to_gate_logits.weight" in t,
        audio_gated_attn="transformer_blocks.0.audio_attn1.to_gate_logits.weight" in t,
        cross_attn_mod="transformer_blocks.0.prompt_scale_shift_table" in t,
        audio_cross_attn_mod="transformer_blocks.0.audio_prompt_scale_shift_table" in t,
        perturbed_attn="transformer_blocks.0.attn1.to_gate_logits.weight" in t,  # 2.3 (no weights of its own)
        use_prompt_embeddings="caption_projection.linear_1.weight" in t)
    if "caption_projection.linear_1.weight" in t:
        transformer["caption_channels"] = t["caption_projection.linear_1.weight"][1]
    return transformer


def _connectors_config(c: dict, need, transformer: dict) -> dict:
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    per_modality = "video_text_proj_in.weight" in c
    proj = need("connectors", "video_text_proj_in.weight" if per_modality else "text_proj_in.weight")
    v_width = need("connectors", "video_connector.learnable_registers")
    a_width = need("connectors", "audio_connector.learnable_registers")
    caption = transformer.get("caption_channels", proj[0])
    connectors = dict(_defaults(LTX2TextConnectors), rope_type="split", rope_double_precision=True)
    connectors.update(
        caption_channels=caption, text_proj_in_factor=proj[1] // caption,
        video_connector_num_layers=_count(c, r"video_connector\.transformer_blocks\.(\d+)\."),
        audio_connector_num_layers=_count(c, r"audio_connector\.transformer_blocks\.(\d+)\."),
        video_connector_num_learnable_registers=v_width[0], audio_connector_num_learnable_registers=a_width[0],
        **_connector_heads("video", v_width[1]), **_connector_heads("audio", a_width[1]),
        per_modality_projections=per_modality,
        **({"video_hidden_dim": proj[0], "audio_hidden_dim": need("connectors", "audio_text_proj_in.weight")[0]}
           if per_modality else {}),
        video_gated_attn="video_connector.transformer_blocks.0.attn1.to_gate_logits.weight" in c,
        audio_gated_attn="audio_connector.transformer_blocks.0.attn1.to_gate_logits.weight" in c,
        proj_bias=("video_text_proj_in.bias" if per_modality else "text_proj_in.bias") in c)
    return connectors


def _vae_config(v: dict, need) -> dict:
    from diffusers import AutoencoderKLLTX2Video

    vae = dict(_defaults(AutoencoderKLLTX2Video), decoder_causal=False)
    stages = _count(v, r"encoder\.down_blocks\.(\d+)\.")
    up = _count(v, r"decoder\.up_blocks\.(\d+)\.")
    vae.update(
        latent_channels=need("vae", "latents_mean")[0],
        # a stage's blocks run at the previous stage's width (its down-sampler widens): the widths are those of
        # stages 1.. and of the mid block; the decoder's, those of its mid block and its stages but the last
        block_out_channels=[need("vae", f"encoder.down_blocks.{i}.resnets.0.conv1.conv.weight")[0]
                            for i in range(1, stages)] + [need("vae", "encoder.mid_block.resnets.0.conv1.conv.weight")[0]],
        layers_per_block=[_count(v, rf"encoder\.down_blocks\.{i}\.resnets\.(\d+)\.") for i in range(stages)]
        + [_count(v, r"encoder\.mid_block\.resnets\.(\d+)\.")],
        decoder_block_out_channels=list(reversed(
            [need("vae", "decoder.mid_block.resnets.0.conv1.conv.weight")[0]]
            + [need("vae", f"decoder.up_blocks.{i}.resnets.0.conv1.conv.weight")[0] for i in range(up - 1)])),
        decoder_spatio_temporal_scaling=[True] * up, decoder_inject_noise=[False] * (up + 1),
        spatial_compression_ratio=32, temporal_compression_ratio=8,  # every released LTX-2 VAE
        decoder_layers_per_block=[_count(v, rf"decoder\.up_blocks\.{i}\.resnets\.(\d+)\.") for i in reversed(range(up))]
        + [_count(v, r"decoder\.mid_block\.resnets\.(\d+)\.")])
    return vae


def _audio_vae_config(a: dict, need) -> dict:
    from diffusers import AutoencoderKLLTX2Audio

    audio_vae = _defaults(AutoencoderKLLTX2Audio)
    audio_vae.update(base_channels=need("audio_vae", "latents_mean")[0],
                     latent_channels=need("audio_vae", "decoder.conv_in.conv.weight")[1]
                     if "decoder.conv_in.conv.weight" in a else audio_vae["latent_channels"])
    return audio_vae


def _vocoder_config(o: dict, need) -> tuple[dict, bool]:
    """The vocoder's config, and whether it is 2.3's with bandwidth extension."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    vocoder = _defaults(LTX2Vocoder)
    bwe = "vocoder.conv_in.weight" in o
    if bwe:
        from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

        vocoder = _defaults(LTX2VocoderWithBWE)
    conv_in = need("vocoder", ("vocoder." if bwe else "") + "conv_in.weight")
    ups = _count(o, r"(?:vocoder\.)?upsamplers\.(\d+)\.")
    head = "vocoder." if bwe else ""
    vocoder.update(in_channels=conv_in[1], hidden_channels=conv_in[0],
                   out_channels=need("vocoder", head + "conv_out.weight")[0],
                   upsample_kernel_sizes=[need("vocoder", f"{head}upsamplers.{i}.weight")[2] for i in range(ups)])
    return vocoder, bwe


def _connector_heads(which: str, width: int) -> dict:
    """Released connectors: 2.0's 3840 wide (30 heads of 128), 2.3's as wide as the transformer streams (32
    heads of 128 video, 32 of 64 audio)."""
    heads = 32 if width % 32 == 0 and width // 32 in (64, 128) else max(1, width // 128)
    return {f"{which}_connector_num_attention_heads": heads, f"{which}_connector_attention_head_dim": width // heads}


# --- Gemma 3 text encoder -----------------------------------------------------------------------------------------
GEMMA_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


def gemma_names(path: Path, override: dict | None = None) -> tuple[dict, dict[str, str]]:
    """(Gemma3TextConfig kwargs, file key -> Gemma3TextModel name) of ComfyUI's Gemma 3 text-encoder file."""
    from .architectures import GEMMA3_12B

    path = Path(path)
    header = read_header(path, "Gemma 3 text encoder")
    aux = quant_aux(header)
    names = {}
    for k in header:
        if k.startswith(("model.vision", "vision", "multi_modal", "model.multi_modal")) or k == "spiece_model" \
                or k in aux:
            continue
        for p in GEMMA_PREFIXES:
            if k.startswith(p):
                names[k] = k[len(p):]
                break
    h = {n: header[k][0] for k, n in names.items()}
    if "layers.0.self_attn.q_norm.weight" not in h or "embed_tokens.weight" not in h:
        hint = " (it is an LTX-2 checkpoint: give it as the checkpoint)" \
            if f"{TRANSFORMER}audio_adaln_single.linear.weight" in header else ""
        raise ModelFolderError(f"{path} is not a Gemma 3 text encoder (no model.layers.0.self_attn.q_norm.weight)"
                               f"{hint}: pick gemma_3_12B_it from ComfyUI's models/text_encoders/")
    vocab, hidden = h["embed_tokens.weight"]
    head_dim = h["layers.0.self_attn.q_norm.weight"][0]
    layers = _count(h, r"layers\.(\d+)\.")
    config = dict(GEMMA3_12B["text_config"])
    config.update(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, head_dim=head_dim,
                  query_pre_attn_scalar=head_dim,
                  num_attention_heads=h["layers.0.self_attn.q_proj.weight"][0] // head_dim,
                  num_key_value_heads=h["layers.0.self_attn.k_proj.weight"][0] // head_dim,
                  intermediate_size=h["layers.0.mlp.gate_proj.weight"][0],
                  layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6)
                  + ["sliding_attention"] * (layers % 6))
    config.update({k: v for k, v in (override or {}).items() if k in config})
    return config, names


# --- spatial latent upsampler -----------------------------------------------------------------------------------
def upscaler_names(path: Path, override: dict | None = None) -> tuple[dict, dict[str, str]]:
    """(LTX2LatentUpsamplerModel config, file key -> name) of ComfyUI's latent upscale model file (diffusers'
    names already)."""
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    path = Path(path)
    header = read_header(path, "LTX-2 latent upscaler")
    if "initial_conv.weight" not in header or "final_conv.weight" not in header:
        raise ModelFolderError(f"{path} is not an LTX-2 spatial latent upscaler (no initial_conv / final_conv "
                               "tensors): pick ltx-2-spatial-upscaler-x2 from ComfyUI's models/latent_upscale_models/")
    mid, in_ch = header["initial_conv.weight"][0][:2]
    config = _defaults(LTX2LatentUpsamplerModel)
    config.update(in_channels=in_ch, mid_channels=mid, num_blocks_per_stage=_count(header, r"res_blocks\.(\d+)\."),
                  use_rational_resampler="upsampler.blur_down.kernel" in header)
    config.update(override or {})
    aux = quant_aux(header)
    return config, {k: k for k in header if k not in aux}
