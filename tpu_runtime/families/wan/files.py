"""Wan from ComfyUI's single files: the architecture read from tensor shapes, keys mapped to diffusers' names.

ComfyUI's Wan templates place three (or, for Wan 2.2 A14B, four) files:

- ``models/diffusion_models/``: the transformer, in the original Wan key names (``blocks.N.self_attn.q``,
  ``head.modulation``, ...), optionally under ``model.diffusion_model.``; fp16, bf16, fp8_e4m3fn or ComfyUI's
  "scaled" fp8. Its configuration is inferred from shapes, the way ComfyUI's ``model_detection`` does it
  (``patch_embedding`` gives width, input channels and patch; ``head.head`` the output channels; heads are
  width / 128, as in every released Wan), so any size of the architecture loads without a downloaded config.
  Names are mapped with diffusers' own ``convert_wan_transformer_to_diffusers``.
- ``models/text_encoders/``: umT5-XXL in transformers' ``UMT5EncoderModel`` names (the tied token embedding
  stored once, as ``shared.weight``), with its SentencePiece model inside as a uint8 tensor ``spiece_model``.
- ``models/vae/``: the Wan 2.1 VAE (z_dim 16) or the Wan 2.2 VAE (z_dim 48, 2×2 patches, residual up/down
  blocks), in the original names. Their latent statistics are not in the file; they are fixed per VAE and
  shipped here (``WAN21_LATENTS``, ``WAN22_LATENTS``).
- ``models/clip_vision/``: Wan 2.1 I2V / FLF2V's image encoder, ``clip_vision_h`` (OpenCLIP ViT-H/14) in
  transformers' ``CLIPVisionModel`` names; its size read from the shapes too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ...engine.weights import quant_aux, read_header, strip_prefix
from ...errors import ModelFolderError

@dataclass
class WanFiles:
    """ComfyUI single files standing in for a diffusers folder."""

    transformer: Path
    text_encoder: Path
    vae: Path
    transformer_2: Path | None = None
    clip_vision: Path | None = None  # Wan 2.1 I2V / FLF2V: models/clip_vision/clip_vision_h.safetensors


def recognise(files: dict) -> bool:
    """Whether ``files`` (role -> path) are Wan's: the transformer file holds Wan's ``head.modulation`` and
    ``patch_embedding`` tensors (under any of ComfyUI's prefixes), as ComfyUI's model detection recognises it."""
    path = files.get("transformer")
    if path is None or not Path(path).is_file():
        return False
    try:
        keys = set(strip_prefix(read_header(Path(path)), TRANSFORMER_PREFIXES).values())
    except ModelFolderError:
        return False
    return "head.modulation" in keys and "patch_embedding.weight" in keys


TRANSFORMER_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
HEAD_DIM = 128  # every released Wan transformer (1.3B: 12 heads, 5B: 24, 14B: 40)

# Per-channel latent statistics of the two Wan VAEs (the released configs' latents_mean / latents_std).
WAN21_LATENTS = {
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
}
WAN22_LATENTS = {
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542,
                     0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109,
                     0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899,
                     -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
                     0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344,
                    0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804,
                    0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999,
                    0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
                    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
}


def _shape(header: dict, key: str, path: Path, what: str) -> tuple[int, ...]:
    if key not in header:
        raise ModelFolderError(f"{path} is not a {what}: it has no tensor {key}. Pick the right file (ComfyUI "
                               f"keeps them in models/{_FOLDER[what]}/)")
    return header[key][0]


_FOLDER = {"Wan transformer": "diffusion_models", "umT5 text encoder": "text_encoders", "Wan VAE": "vae",
           "CLIP vision model": "clip_vision"}


# --- transformer ---------------------------------------------------------------------------------------------
def transformer_names(path: Path) -> tuple[dict, dict[str, str]]:
    """(diffusers config, file key -> diffusers name) of a ComfyUI/original Wan transformer file."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    path = Path(path)
    header = read_header(path)
    aux = quant_aux(header)
    keys = [k for k in header if k not in aux]
    short = strip_prefix(keys, TRANSFORMER_PREFIXES)
    h = {short[k]: header[k] for k in keys}
    what = "Wan transformer"
    if "head.modulation" not in h:
        hint = " (it looks like a diffusers-format transformer: pass its whole folder as --model)" \
            if "scale_shift_table" in h else ""
        raise ModelFolderError(f"{path} is not a Wan diffusion model (no head.modulation tensor){hint}: pick a "
                               "Wan file from ComfyUI's models/diffusion_models/")
    pe = _shape(h, "patch_embedding.weight", path, what)
    dim, in_channels, patch = pe[0], pe[1], tuple(pe[2:])
    out_channels = _shape(h, "head.head.weight", path, what)[0] // math.prod(patch)
    layers = 1 + max(int(k.split(".")[1]) for k in h if k.startswith("blocks."))
    if dim % HEAD_DIM:
        raise ModelFolderError(f"{path}: width {dim} is not a multiple of Wan's head size {HEAD_DIM}: not a Wan "
                               "model this pack knows")
    config = {
        "patch_size": list(patch),
        "num_attention_heads": dim // HEAD_DIM,
        "attention_head_dim": HEAD_DIM,
        "in_channels": in_channels,
        "out_channels": out_channels,
        "text_dim": _shape(h, "text_embedding.0.weight", path, what)[1],
        "freq_dim": _shape(h, "time_embedding.0.weight", path, what)[1],
        "ffn_dim": _shape(h, "blocks.0.ffn.0.weight", path, what)[0],
        "num_layers": layers,
        "cross_attn_norm": "blocks.0.norm3.weight" in h,
        "qk_norm": "rms_norm_across_heads" if "blocks.0.self_attn.norm_q.weight" in h else None,
        "eps": 1e-6,
        "image_dim": h["img_emb.proj.0.weight"][0][0] if "img_emb.proj.0.weight" in h else None,
        "added_kv_proj_dim": h["blocks.0.cross_attn.k_img.weight"][0][1]
        if "blocks.0.cross_attn.k_img.weight" in h else None,
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": h["img_emb.emb_pos"][0][1] if "img_emb.emb_pos" in h else None,
    }
    # diffusers' converter renames by substring; run it on the names alone (values are the original keys).
    renamed = convert_wan_transformer_to_diffusers({short[k]: k for k in keys})
    # FLF2V's image position embedding is one name diffusers' converter does not know.
    names = {original: new.replace("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed")
             for new, original in renamed.items()}
    return config, names


_WAN_TO_ORIGINAL = (
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    ("proj_out.", "head.head."),
    ("condition_embedder.image_embedder.norm1.", "img_emb.proj.0."),  # Wan 2.1 I2V / FLF2V
    ("condition_embedder.image_embedder.ff.net.0.proj.", "img_emb.proj.1."),
    ("condition_embedder.image_embedder.ff.net.2.", "img_emb.proj.3."),
    ("condition_embedder.image_embedder.norm2.", "img_emb.proj.4."),
    ("condition_embedder.image_embedder.pos_embed", "img_emb.emb_pos"),
)


def wan_transformer_to_original(name: str) -> str:
    """The original (ComfyUI / Wan repository) name of a diffusers Wan transformer tensor or module name: the
    inverse of ``convert_wan_transformer_to_diffusers`` (single files and LoRA files use these names)."""
    import re

    if name == "scale_shift_table":
        return "head.modulation"
    for old, new in _WAN_TO_ORIGINAL:
        if name.startswith(old):
            return new + name[len(old):]
    m = re.match(r"blocks\.(\d+)\.(.*)", name)
    if not m:
        return name
    n, rest = m.groups()
    swaps = (("attn1.", "self_attn."), ("attn2.", "cross_attn."), ("ffn.net.0.proj.", "ffn.0."),
             ("ffn.net.2.", "ffn.2."), ("norm2.", "norm3."), ("scale_shift_table", "modulation"))
    for old, new in swaps:
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    for old, new in ((".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."), (".to_out.0.", ".o."),
                     (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."), (".norm_added_k.", ".norm_k_img.")):
        rest = rest.replace(old, new)
    return f"blocks.{n}.{rest}"


# --- umT5 text encoder -------------------------------------------------------------------------------------------
def umt5_names(path: Path) -> tuple[dict, dict[str, str]]:
    """(transformers UMT5Config kwargs, file key -> module name) of a ComfyUI umT5 encoder file."""
    path = Path(path)
    header = read_header(path)
    what = "umT5 text encoder"
    aux = quant_aux(header)
    keys = [k for k in header if k != "spiece_model" and k not in aux]
    short = strip_prefix(keys, ("text_encoders.umt5xxl.transformer.", "umt5xxl.transformer.", "transformer."))
    h = {short[k]: header[k] for k in keys}
    if "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" not in h:
        raise ModelFolderError(f"{path} is not a umT5 text encoder (no per-layer relative attention bias): pick "
                               "umt5_xxl_fp16 or umt5_xxl_fp8_e4m3fn_scaled from ComfyUI's models/text_encoders/")
    if "spiece_model" not in header:
        raise ModelFolderError(f"{path} carries no tokenizer (tensor spiece_model): use ComfyUI's umT5 file, which "
                               "ships its SentencePiece model inside")
    vocab, d_model = _shape(h, "shared.weight", path, what)
    buckets, heads = _shape(h, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", path, what)
    inner = _shape(h, "encoder.block.0.layer.0.SelfAttention.q.weight", path, what)[0]
    config = {
        "vocab_size": vocab, "d_model": d_model, "num_heads": heads, "d_kv": inner // heads,
        "d_ff": _shape(h, "encoder.block.0.layer.1.DenseReluDense.wi_0.weight", path, what)[0],
        "num_layers": 1 + max(int(k.split(".")[2]) for k in h if k.startswith("encoder.block.")),
        "relative_attention_num_buckets": buckets,
        "relative_attention_max_distance": 128,  # umT5's; not recorded in the file
        "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0, "is_encoder_decoder": False,
    }
    return config, {k: short[k] for k in keys}


# --- VAE -------------------------------------------------------------------------------------------------------------
_RESIDUAL = (("residual.0.gamma", "norm1.gamma"), ("residual.2.", "conv1."), ("residual.3.gamma", "norm2.gamma"),
             ("residual.6.", "conv2."), ("shortcut.", "conv_shortcut."))
_FIXED = {"conv1.": "quant_conv.", "conv2.": "post_quant_conv.", "encoder.conv1.": "encoder.conv_in.",
          "decoder.conv1.": "decoder.conv_in.", "encoder.head.0.": "encoder.norm_out.",
          "encoder.head.2.": "encoder.conv_out.", "decoder.head.0.": "decoder.norm_out.",
          "decoder.head.2.": "decoder.conv_out."}


def _residual(rest: str) -> str:
    for old, new in _RESIDUAL:
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def vae_names(path: Path) -> tuple[dict, dict[str, str]]:
    """(diffusers AutoencoderKLWan config, file key -> diffusers name) of a ComfyUI Wan 2.1 or 2.2 VAE file."""
    path = Path(path)
    header = read_header(path)
    what = "Wan VAE"
    if "decoder.middle.0.residual.0.gamma" not in header:
        raise ModelFolderError(f"{path} is not a Wan VAE (no decoder.middle.0.residual.0.gamma): pick wan_2.1_vae "
                               "or wan2.2_vae from ComfyUI's models/vae/")
    residual = any(re.match(r"decoder\.upsamples\.\d+\.upsamples\.", k) for k in header)  # Wan 2.2 layout
    z_dim = _shape(header, "conv2.weight", path, what)[0]
    conv_in = _shape(header, "encoder.conv1.weight", path, what)
    decoder_in = _shape(header, "decoder.conv1.weight", path, what)
    up_stage_of = {} if residual else _up_stages(header)
    stages = len({s for s, _ in up_stage_of.values()}) if not residual else \
        len({int(k.split(".")[2]) for k in header if k.startswith("decoder.upsamples.")})
    res_per_up_stage = max((jj for _, jj in up_stage_of.values() if jj is not None), default=0) + 1
    aux = quant_aux(header)
    names: dict[str, str] = {}
    for key in header:
        if key in aux:
            continue
        new = _vae_name(key, up_stage_of)
        if new is None:
            raise ModelFolderError(f"{path}: tensor {key} is not part of a Wan VAE this pack knows")
        names[key] = new
    patch = 2 if residual else None
    latents = WAN22_LATENTS if residual else WAN21_LATENTS
    if len(latents["latents_mean"]) != z_dim:
        raise ModelFolderError(f"{path}: a Wan {'2.2' if residual else '2.1'} VAE with z_dim {z_dim} is unknown "
                               f"(expected {len(latents['latents_mean'])})")
    down_stages = 1 + max(int(k.split(".")[2]) for k in header if k.startswith("encoder.downsamples.")) \
        if residual else None
    num_stages = down_stages if residual else stages
    base_dim = conv_in[0]
    config = {
        "base_dim": base_dim,
        "z_dim": z_dim,
        "dim_mult": _dim_mult(header, base_dim, residual, num_stages),
        "num_res_blocks": (res_per_up_stage - 1) if not residual else _res_blocks_22(header),
        "attn_scales": [],
        "temperal_downsample": _temporal_down(header, residual, num_stages),
        "dropout": 0.0,
        "is_residual": residual,
        "in_channels": conv_in[1],
        "out_channels": _shape(header, "decoder.head.2.weight", path, what)[0],
        "patch_size": patch,
        "scale_factor_temporal": 4,
        "scale_factor_spatial": 16 if residual else 8,
        **latents,
    }
    if residual:
        config["decoder_base_dim"] = decoder_in[0] // config["dim_mult"][-1]
    return config, names


def _up_stages(header) -> dict[int, tuple[int, int | None]]:
    """Wan 2.1's decoder: one flat list of blocks, in stages of residual blocks each but the last ending in an
    up-sampler; flat index -> (stage, residual block index, None for the up-sampler)."""
    stage, j, up_stage_of = 0, 0, {}
    for n in sorted({int(k.split(".")[2]) for k in header if k.startswith("decoder.upsamples.")}):
        is_resample = any(k.startswith(f"decoder.upsamples.{n}.resample") or
                          k.startswith(f"decoder.upsamples.{n}.time_conv") for k in header)
        up_stage_of[n] = (stage, None if is_resample else j)
        if is_resample:
            stage, j = stage + 1, 0
        else:
            j += 1
    return up_stage_of


def _vae_name(key: str, up_stage_of: dict) -> str | None:
    """diffusers' name for the VAE tensor ``key`` of ComfyUI's file (None: not a Wan VAE tensor)."""
    m = re.match(r"(encoder|decoder)\.middle\.(\d)\.(.*)", key)
    if m:
        part, idx, rest = m.groups()
        return (f"{part}.mid_block.attentions.0.{rest}" if idx == "1"
                else f"{part}.mid_block.resnets.{int(idx) // 2}.{_residual(rest)}")
    if m := re.match(r"encoder\.downsamples\.(\d+)\.downsamples\.(\d+)\.(.*)", key):  # 2.2
        s, jj, rest = m.groups()
        return (f"encoder.down_blocks.{s}.downsampler.{rest}" if rest.startswith(("resample", "time_conv"))
                else f"encoder.down_blocks.{s}.resnets.{jj}.{_residual(rest)}")
    if m := re.match(r"decoder\.upsamples\.(\d+)\.upsamples\.(\d+)\.(.*)", key):  # 2.2
        s, jj, rest = m.groups()
        return (f"decoder.up_blocks.{s}.upsampler.{rest}" if rest.startswith(("resample", "time_conv"))
                else f"decoder.up_blocks.{s}.resnets.{jj}.{_residual(rest)}")
    if m := re.match(r"encoder\.downsamples\.(\d+)\.(.*)", key):  # 2.1: one flat list
        n, rest = m.groups()
        return f"encoder.down_blocks.{n}.{_residual(rest)}"
    if m := re.match(r"decoder\.upsamples\.(\d+)\.(.*)", key):  # 2.1: flat, grouped into stages
        n, rest = m.groups()
        s, jj = up_stage_of[int(n)]
        return (f"decoder.up_blocks.{s}.upsamplers.0.{rest}" if jj is None
                else f"decoder.up_blocks.{s}.resnets.{jj}.{_residual(rest)}")
    for old, repl in _FIXED.items():
        if key.startswith(old):
            return repl + key[len(old):]
    return None


def _dim_mult(header, base_dim: int, residual: bool, stages: int) -> list[int]:
    """Channel multipliers per encoder stage, from the first residual conv of each stage."""
    mults = []
    for s in range(stages):
        if residual:
            key = f"encoder.downsamples.{s}.downsamples.0.residual.2.weight"
        else:
            key = None
            flat = sorted({int(k.split(".")[2]) for k in header if k.startswith("encoder.downsamples.")})
            stage = 0
            for n in flat:
                if stage == s and f"encoder.downsamples.{n}.residual.2.weight" in header:
                    key = f"encoder.downsamples.{n}.residual.2.weight"
                    break
                if any(k.startswith(f"encoder.downsamples.{n}.resample") for k in header):
                    stage += 1
        mults.append(header[key][0][0] // base_dim)
    return mults


def _res_blocks_22(header) -> int:
    return len({int(k.split(".")[4]) for k in header if re.match(r"encoder\.downsamples\.0\.downsamples\.\d+\.residual", k)})


def _temporal_down(header, residual: bool, stages: int) -> list[bool]:
    """Which down-sampling stages also halve time (they carry a time_conv)."""
    out = []
    pattern = r"encoder\.downsamples\.(\d+)\.downsamples\.\d+\.time_conv" if residual \
        else r"encoder\.downsamples\.(\d+)\.time_conv"
    with_time = {int(re.match(pattern, k).group(1)) for k in header if re.match(pattern, k)}
    if residual:
        return [s in with_time for s in range(stages - 1)]
    resamples = sorted({int(k.split(".")[2]) for k in header
                        if re.match(r"encoder\.downsamples\.\d+\.resample", k)})
    return [n in with_time for n in resamples][: stages - 1] if resamples else out


# --- CLIP vision (Wan 2.1 I2V / FLF2V) -------------------------------------------------------------------------
CLIP_VISION_HEADS = 16  # OpenCLIP ViT-H/14 (clip_vision_h), as ViT-L and ViT-bigG: 16 heads


def clip_vision_names(path: Path) -> tuple[dict, dict[str, str]]:
    """(transformers ``CLIPVisionConfig`` kwargs, file key -> ``CLIPVisionModel`` name) of ComfyUI's CLIP vision
    file (``clip_vision_h.safetensors``: transformers' names, ``vision_model.…``, possibly under a prefix). The
    size is read from the shapes: width and patch from the patch embedding, image size from the positions,
    layers and MLP width from the encoder; heads are CLIP's 16."""
    path = Path(path)
    header = read_header(path)
    what = "CLIP vision model"
    anchor = "vision_model.embeddings.patch_embedding.weight"
    found = [k for k in header if k.endswith(anchor)]
    if not found:
        hint = " (it is in OpenCLIP's own names: use ComfyUI's repackaged clip_vision_h.safetensors)" \
            if any(k.startswith("visual.") for k in header) else ""
        raise ModelFolderError(f"{path} is not a CLIP vision model: it has no tensor {anchor}{hint}. Pick "
                               "clip_vision_h.safetensors from ComfyUI's models/clip_vision/")
    prefix = found[0][: -len(anchor)]
    names = {k: k[len(prefix):] for k in header if k.startswith(prefix + "vision_model.")}
    h = {names[k]: header[k] for k in names}
    width, _, patch, _ = h[anchor][0]
    positions = _shape(h, "vision_model.embeddings.position_embedding.weight", path, what)[0]
    side = math.isqrt(positions - 1)
    if side * side != positions - 1:
        raise ModelFolderError(f"{path}: {positions} positions are not a square grid plus the class token: not a "
                               "CLIP vision model this pack knows")
    layers = 1 + max(int(k.split(".")[3]) for k in h if k.startswith("vision_model.encoder.layers."))
    config = {
        "hidden_size": width, "intermediate_size": _shape(h, "vision_model.encoder.layers.0.mlp.fc1.weight",
                                                          path, what)[0],
        "num_hidden_layers": layers, "num_attention_heads": CLIP_VISION_HEADS, "patch_size": patch,
        "image_size": patch * side, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
    }
    if width % CLIP_VISION_HEADS:
        raise ModelFolderError(f"{path}: width {width} does not split into CLIP's {CLIP_VISION_HEADS} heads")
    return config, {k: v for k, v in names.items() if not v.endswith("position_ids")}
