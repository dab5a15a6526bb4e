"""ComfyUI's single files of the tiny random-weight diffusers models the tests build: the same weights under the
names and in the dtypes of the files ComfyUI's templates load, so that loading them can be compared with loading
the folder (and diffusers' pipeline on it)."""

from __future__ import annotations

import json
from pathlib import Path

from tpu_runtime.engine.tiny import fp8_scaled
from tpu_runtime.families.ltx2.bench import export_comfy_files as export_ltx2_files  # noqa: F401 (the bench's too)
from tpu_runtime.families.wan.files import wan_transformer_to_original


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


def export_wan_files(folder: str | Path, out: str | Path, fmt: str = "fp16",
                       prefix: str = "model.diffusion_model.") -> dict[str, Path]:
    """Write a tiny Wan diffusers folder as the single files ComfyUI's templates use: the transformer(s) in the
    original key names (``fmt``: fp32, fp16, bf16 or fp8_scaled), umT5 with its SentencePiece model inside (fp16,
    or scaled fp8 with an fp8_scaled transformer, as umt5_xxl_fp8_e4m3fn_scaled), the VAE in the original names
    (bf16), the CLIP vision encoder of I2V/FLF2V models as ComfyUI's clip_vision_h (fp16). Returns
    {"transformer", ["transformer_2"], "text_encoder", "vae", ["clip_vision"]} -> path."""
    import torch
    from safetensors.torch import load_file, save_file


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
