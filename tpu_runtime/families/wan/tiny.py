"""Tiny random-weight Wan models (2.1, 2.2 A14B, TI2V-5B; I2V and FLF2V), saved as real diffusers folders; the
same weights exported as ComfyUI's single files (``export_comfy_files``); LoRAs for them in every format people
download (see ``engine/tiny.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...engine.tiny import LORA_FORMATS, exact, finish, fp8_scaled, train_spiece, write_tiny_lora  # noqa: F401

WAN_GENERATIONS = ("2.1", "2.2-A14B", "2.2-TI2V-5B")


@dataclass(frozen=True)
class TinyWanSpec:
    """How large a tiny Wan model is. Heads are 128 wide as in every released Wan (ComfyUI's files do not record
    the head count, so single-file loading assumes it)."""

    heads: int = 2
    layers: int = 2
    ffn: int = 64
    text_dim: int = 32
    vae_base_dim: int = 8


WAN_IMAGE_KINDS = ("", "i2v", "flf2v")


def build_tiny_wan(directory: str | Path, generation: str = "2.1", seed: int = 0,
                   spec: TinyWanSpec | None = None, image: str = "") -> Path:
    """Write a tiny random-weight Wan ``generation`` folder in diffusers format and return its path.

    "2.1": one transformer, Wan 2.1 VAE (z 16); "2.2-A14B": two experts (boundary 0.875); "2.2-TI2V-5B": 48
    latent channels, the Wan 2.2 VAE (2x2 patches, x16) and ``expand_timesteps``. Weights are rounded so the
    ComfyUI-format exports (``export_comfy_files``) in fp16, bf16 and scaled fp8 hold exactly the same numbers.

    ``image``: "i2v" makes the image-to-video model of the generation (2.1: with a CLIP vision encoder of the
    real 257-token shape, as Wan2.1-I2V-14B; 2.2-A14B: as Wan2.2-I2V-A14B, boundary 0.9, no image encoder);
    "flf2v" (2.1): Wan2.1-FLF2V-14B (CLIP features of a first and a last image, with their position embedding).
    TI2V-5B takes an image as it is.
    """
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    from .files import WAN21_LATENTS, WAN22_LATENTS
    from .model import DEFAULT_SCHEDULER, DEFAULT_SHIFT

    if generation not in WAN_GENERATIONS:
        raise ValueError(f"generation must be one of {WAN_GENERATIONS}, got {generation!r}")
    if image not in WAN_IMAGE_KINDS or (image and generation == "2.2-TI2V-5B") or \
            (image == "flf2v" and generation != "2.1"):
        raise ValueError(f"image={image!r}: i2v for 2.1 and 2.2-A14B, flf2v for 2.1 (TI2V-5B takes images as is)")
    spec = spec or TinyWanSpec()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    ti2v = generation == "2.2-TI2V-5B"

    (directory / "tokenizer").mkdir(exist_ok=True)
    spm = directory / "tokenizer" / "spiece.model"
    train_spiece(spm)
    tokenizer = T5TokenizerFast.from_pretrained(directory / "tokenizer", extra_ids=0)  # converts spiece.model
    tokenizer.save_pretrained(directory / "tokenizer")

    def randomise(module, fp8=False, std=0.05, stronger=(), strong_std=0.0):
        with torch.no_grad():
            for name, p in module.named_parameters():
                scale = strong_std if any(s in name for s in stronger) else std
                p.copy_(exact(torch.randn_like(p) * scale, fp8))
        return module

    t5 = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=spec.text_dim, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
        dropout_rate=0.0, is_encoder_decoder=False,
    )).eval()
    randomise(t5, fp8=True, std=0.3)
    t5.save_pretrained(directory / "text_encoder")

    channels = 48 if ti2v else 16
    experts = ["transformer", "transformer_2"] if generation == "2.2-A14B" else ["transformer"]
    clip = generation == "2.1" and image in ("i2v", "flf2v")
    clip_width = 64
    for name in experts:
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=spec.heads, attention_head_dim=128,
            in_channels=channels + (4 + channels if image else 0),  # image-to-video: + mask + image latents
            out_channels=channels, text_dim=spec.text_dim, freq_dim=32, ffn_dim=spec.ffn, num_layers=spec.layers,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
            image_dim=clip_width if clip else None, added_kv_proj_dim=spec.heads * 128 if clip else None,
            pos_embed_seq_len=2 * 257 if image == "flf2v" else None,
        ).eval()
        # A strong text path (cross-attention, text projection): prompts must visibly change the video, or a
        # test could not tell a wrong text encoding from a right one.
        # Image-to-video: a strong input projection too, so the image's channels visibly steer the video.
        randomise(transformer, fp8=True, stronger=("attn2.", "text_embedder.", "image_embedder.")
                  + (("patch_embedding.",) if image else ()), strong_std=0.25)
        transformer.save_pretrained(directory / name)
    if clip:
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        encoder = CLIPVisionModel(CLIPVisionConfig(
            hidden_size=clip_width, intermediate_size=96, num_hidden_layers=3, num_attention_heads=16,
            image_size=224, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-5, projection_dim=32)).eval()
        randomise(encoder, std=0.2)
        encoder.save_pretrained(directory / "image_encoder")
        CLIPImageProcessor().save_pretrained(directory / "image_processor")

    if ti2v:
        vae = AutoencoderKLWan(base_dim=spec.vae_base_dim, decoder_base_dim=spec.vae_base_dim, z_dim=48,
                               is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                               scale_factor_spatial=16, **WAN22_LATENTS)
    else:
        vae = AutoencoderKLWan(base_dim=spec.vae_base_dim, z_dim=16, **WAN21_LATENTS)
    # The encoder (image-to-video only) stronger, so different pictures give visibly different latents.
    randomise(vae.eval(), std=0.1, stronger=("encoder.",), strong_std=0.3)
    vae.save_pretrained(directory / "vae")

    config = {k: v for k, v in DEFAULT_SCHEDULER.items() if not k.startswith("_")}
    UniPCMultistepScheduler(**config, flow_shift=DEFAULT_SHIFT[generation]).save_pretrained(directory / "scheduler")
    model_index = {
        "_class_name": "WanImageToVideoPipeline" if image else "WanPipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"] if len(experts) == 2 else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "boundary_ratio": (0.9 if image else 0.875) if len(experts) == 2 else None,
        "expand_timesteps": ti2v,
    }
    if image:
        model_index["image_encoder"] = ["transformers", "CLIPVisionModel"] if clip else [None, None]
        model_index["image_processor"] = ["transformers", "CLIPImageProcessor"] if clip else [None, None]
    return finish(directory, model_index, f"Wan-{generation}{'-' + image.upper() if image else ''}", seed)


# diffusers -> original Wan names, the inverse of what ComfyUI's files hold (written out independently of
# diffusers' own converter, which the loader uses, so a test of one against the other means something).
def _vae_residual_to_original(rest: str) -> str:
    for old, new in (("norm1.gamma", "residual.0.gamma"), ("conv1.", "residual.2."), ("norm2.gamma", "residual.3.gamma"),
                     ("conv2.", "residual.6."), ("conv_shortcut.", "shortcut.")):
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def wan_vae_to_original(name: str, num_res_blocks: int, residual: bool) -> str:
    import re

    fixed = {"quant_conv.": "conv1.", "post_quant_conv.": "conv2.", "encoder.conv_in.": "encoder.conv1.",
             "decoder.conv_in.": "decoder.conv1.", "encoder.norm_out.": "encoder.head.0.",
             "encoder.conv_out.": "encoder.head.2.", "decoder.norm_out.": "decoder.head.0.",
             "decoder.conv_out.": "decoder.head.2."}
    for old, new in fixed.items():
        if name.startswith(old):
            return new + name[len(old):]
    if m := re.match(r"(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d)\.(.*)", name):
        part, kind, i, rest = m.groups()
        if kind == "attentions":
            return f"{part}.middle.1.{rest}"
        return f"{part}.middle.{2 * int(i)}.{_vae_residual_to_original(rest)}"
    if residual:
        if m := re.match(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", name):
            s, j, rest = m.groups()
            return f"encoder.downsamples.{s}.downsamples.{j}.{_vae_residual_to_original(rest)}"
        if m := re.match(r"encoder\.down_blocks\.(\d+)\.downsampler\.(.*)", name):
            s, rest = m.groups()
            return f"encoder.downsamples.{s}.downsamples.{num_res_blocks}.{rest}"
        if m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", name):
            s, j, rest = m.groups()
            return f"decoder.upsamples.{s}.upsamples.{j}.{_vae_residual_to_original(rest)}"
        if m := re.match(r"decoder\.up_blocks\.(\d+)\.upsampler\.(.*)", name):
            s, rest = m.groups()
            return f"decoder.upsamples.{s}.upsamples.{num_res_blocks + 1}.{rest}"
    else:
        if m := re.match(r"encoder\.down_blocks\.(\d+)\.(.*)", name):
            n, rest = m.groups()
            return f"encoder.downsamples.{n}.{_vae_residual_to_original(rest)}"
        per_stage = num_res_blocks + 2  # the decoder's residual blocks, then its up-sampler, in one flat list
        if m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", name):
            s, j, rest = m.groups()
            return f"decoder.upsamples.{int(s) * per_stage + int(j)}.{_vae_residual_to_original(rest)}"
        if m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", name):
            s, rest = m.groups()
            return f"decoder.upsamples.{int(s) * per_stage + num_res_blocks + 1}.{rest}"
    raise KeyError(f"no original Wan VAE name for {name}")


def export_comfy_files(folder: str | Path, out: str | Path, fmt: str = "fp16",
                       prefix: str = "model.diffusion_model.") -> dict[str, Path]:
    """Write a tiny Wan diffusers folder as the single files ComfyUI's templates use: the transformer(s) in the
    original key names (``fmt``: fp32, fp16, bf16 or fp8_scaled), umT5 with its SentencePiece model inside (fp16,
    or scaled fp8 with an fp8_scaled transformer, as umt5_xxl_fp8_e4m3fn_scaled), the VAE in the original names
    (bf16), the CLIP vision encoder of I2V/FLF2V models as ComfyUI's clip_vision_h (fp16). Returns
    {"transformer", ["transformer_2"], "text_encoder", "vae", ["clip_vision"]} -> path."""
    import torch
    from safetensors.torch import load_file, save_file

    from .files import wan_transformer_to_original

    folder, out = Path(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8_scaled": torch.float32}
    paths = {}
    for name in ("transformer", "transformer_2"):
        if not (folder / name).is_dir():
            continue
        state = load_file(str(folder / name / "diffusion_pytorch_model.safetensors"))
        tensors = {prefix + wan_transformer_to_original(k): v.to(dtypes[fmt]) for k, v in state.items()}
        if fmt == "fp8_scaled":
            tensors = fp8_scaled(tensors)
        paths[name] = out / f"wan_{name}_{fmt}.safetensors"
        save_file(tensors, str(paths[name]))
    text = load_file(str(folder / "text_encoder" / "model.safetensors"))
    text = {k: v.to(torch.float16) for k, v in text.items() if k != "encoder.embed_tokens.weight"}
    text_fmt = "fp8_scaled" if fmt == "fp8_scaled" else "fp16"
    if text_fmt == "fp8_scaled":
        text = fp8_scaled(text)
    spm = (folder / "tokenizer" / "spiece.model").read_bytes()
    text["spiece_model"] = torch.frombuffer(bytearray(spm), dtype=torch.uint8)
    paths["text_encoder"] = out / f"umt5_{text_fmt}.safetensors"
    save_file(text, str(paths["text_encoder"]))
    vae_config = json.loads((folder / "vae" / "config.json").read_text())
    vae = load_file(str(folder / "vae" / "diffusion_pytorch_model.safetensors"))
    vae = {wan_vae_to_original(k, vae_config["num_res_blocks"], vae_config.get("is_residual", False)):
           v.to(torch.bfloat16) for k, v in vae.items()}
    paths["vae"] = out / "wan_vae_bf16.safetensors"
    save_file(vae, str(paths["vae"]))
    if (folder / "image_encoder").is_dir():  # as ComfyUI's clip_vision_h: transformers' names, fp16
        clip = load_file(str(folder / "image_encoder" / "model.safetensors"))
        clip = {"vision_model." + k.removeprefix("vision_model."): v.to(torch.float16) for k, v in clip.items()
                if not k.endswith("position_ids")}
        paths["clip_vision"] = out / "clip_vision_fp16.safetensors"
        save_file(clip, str(paths["clip_vision"]))
    return paths


LORA_TARGETS = r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)\.weight|blocks\.\d+\.ffn\.net\.(0\.proj|2)\.weight"


def build_tiny_lora(transformer: str | Path, out: str | Path, fmt: str = "comfy", **options) -> Path:
    """A random-weight LoRA over every attention and feed-forward linear of every block of the Wan transformer folder
    ``transformer``, in format ``fmt`` (``LORA_FORMATS``; the original Wan names for the ComfyUI and musubi ones),
    with ``write_tiny_lora``'s options."""
    from .files import wan_transformer_to_original

    return write_tiny_lora(transformer, out, fmt, LORA_TARGETS, original=wan_transformer_to_original, **options)
