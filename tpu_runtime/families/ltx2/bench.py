"""LTX-2's part of ``bench`` (``SPEC.bench``): opening the all-in-one checkpoint (bf16 and fp8) against the
diffusers folder, each in a fresh process; and writing a tiny diffusers folder as ComfyUI's single files
(``export_comfy_files``), which that benchmark loads (and the tests compare with the folder)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def file_load(size_mb: int, tools, dtypes=("bfloat16",)) -> tuple[dict, str]:
    """A tiny LTX-2.0 folder whose transformer is replaced by a random one of about ``size_mb`` MB in bfloat16 (16
    heads of 64, layers chosen for the size), written as ComfyUI's all-in-one checkpoint in bf16 and in fp8 (the
    blocks' matrices float8 with their scales, as the released fp8 file), and kept as its folder (float32): each
    opened in a fresh process (``tools.load_in_child(ref, path, dtype)``) and its transformer placed; host seconds and
    peak host memory. ``tools.timed(fn, repeats)``: the median seconds of ``fn``. Returns the results and their table."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    from .tiny import build_tiny_ltx2, transformer_config

    work = Path(tempfile.mkdtemp(prefix="tpu_video_load_"))
    folder = build_tiny_ltx2(work / "ltx2", "2.0", upsampler=False, fp8=True)
    config = dict(transformer_config("2.0"), num_attention_heads=16, attention_head_dim=64, cross_attention_dim=1024,
                  audio_num_attention_heads=16, audio_attention_head_dim=32, audio_cross_attention_dim=512)
    video, audio = 1024, 512  # per block: both streams' attentions (4 + 4 + 2 cross-modal) and feed-forwards
    per_layer = (2 * 4 * video * video + 2 * 4 * audio * audio + 2 * 4 * video * audio + 8 * video * video
                 + 8 * audio * audio) * 2
    config["num_layers"] = max(1, round(size_mb * 2**20 / per_layer))
    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(**config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    model.save_pretrained(folder / "transformer")
    del model
    files = {dtype: export_comfy_files(folder, work / f"files_{dtype}", dtype) for dtype in ("bf16", "fp8")}
    for dtype, paths in files.items():  # what the loader in the fresh process opens
        (work / f"files_{dtype}" / "files.json").write_text(json.dumps({k: str(v) for k, v in paths.items()}))
    out = {"layers": config["num_layers"], "folder_mb": sum(
        f.stat().st_size for f in (folder / "transformer").iterdir()) / 2**20,
        "checkpoint_mb": {k: v["checkpoint"].stat().st_size / 2**20 for k, v in files.items()}}
    out["fp8_dequantise"] = _fp8_dequantise_speed(files["fp8"]["checkpoint"], tools.timed)
    for dtype in dtypes:
        out[dtype] = {"bf16": tools.load_in_child(f"{__name__}:load_files", work / "files_bf16", dtype),
                      "fp8": tools.load_in_child(f"{__name__}:load_files", work / "files_fp8", dtype),
                      "folder": tools.load_in_child(f"{__name__}:load_folder", folder, dtype)}
    return out, _table(out)


def load_files(path: str, dtype: str) -> int:
    """The single files ``export_comfy_files`` wrote into the folder ``path`` (listed in its files.json) opened as
    LTX-2, its transformer placed; the bytes placed."""
    from .model import LTX2Family

    files = json.loads((Path(path) / "files.json").read_text())
    return _placed_bytes(LTX2Family(files=files, dtype=dtype))


def load_folder(path: str, dtype: str) -> int:
    """The diffusers folder ``path`` opened as LTX-2, its transformer placed; the bytes placed."""
    from .model import LTX2Family

    return _placed_bytes(LTX2Family(path, dtype=dtype))


def _placed_bytes(family) -> int:
    return sum(v.size * v.dtype.itemsize for v in family.state("transformer").values())


def _fp8_dequantise_speed(path: Path, timed, repeats: int = 3) -> dict:
    """Seconds per fp8 weight of a checkpoint turned into bfloat16 x scale: the loader's table (``TensorSource.get``)
    against torch's elementwise ``(q.float() * scale).to(bfloat16)``, in this process, medians of ``repeats``."""
    import torch

    from ...engine.weights import TensorSource

    source = TensorSource([path])
    keys = [k for k in source.keys() if source.raw(k).dtype == torch.float8_e4m3fn]
    weights = sum(source.raw(k).numel() for k in keys)

    def table():
        for k in keys:
            source.get(k, torch.bfloat16)

    def elementwise():
        for k in keys:
            (source.raw(k).float() * source.raw(k[: -len("weight")] + "weight_scale").float()).to(torch.bfloat16)

    return {"weights": weights, "table_s": timed(table, repeats), "torch_s": timed(elementwise, repeats)}


def _table(r: dict) -> str:
    lines = [f"\nLTX-2.0 transformer of {r['layers']} blocks (16 heads of 64): all-in-one checkpoint bf16 "
             f"{r['checkpoint_mb']['bf16']:.0f} MiB, fp8 {r['checkpoint_mb']['fp8']:.0f} MiB, diffusers folder "
             f"{r['folder_mb']:.0f} MiB float32; each opened in a fresh process, the transformer placed",
             f"  {'run dtype':<10} {'source':<22} {'host s':>7} {'placed MiB':>11} {'peak allocated MiB':>19}"]
    for dtype in ("bfloat16", "float32"):
        for way, label in (("bf16", "checkpoint (bf16)"), ("fp8", "checkpoint (fp8)"), ("folder", "folder (fp32)")):
            if dtype in r:
                x = r[dtype][way]
                lines.append(f"  {dtype:<10} {label:<22} {x['seconds']:>7.2f} {x['loaded_bytes'] / 2**20:>11.0f} "
                             f"{x['anon_increase_mib']:>19.0f}")
    lines.append("  (on a CPU backend the placed copy is host memory too)")
    d = r["fp8_dequantise"]
    lines.append(f"  fp8 -> bfloat16 x scale, {d['weights'] / 1e6:.0f}M weights in this process: the loader's table "
                 f"{d['table_s'] * 1e9 / d['weights']:.2f} ns a weight, torch elementwise "
                 f"{d['torch_s'] * 1e9 / d['weights']:.2f} ns ({d['torch_s'] / d['table_s']:.1f}x)")
    return "\n".join(lines)


# --- the tiny model as ComfyUI's single files ------------------------------------------------------------------------------------
def _vae_to_original(name: str) -> str:
    """diffusers' LTX-2 video VAE name -> ComfyUI's (the inverse of ``convert_ltx2_vae_to_diffusers``)."""
    import re

    name = name.replace(".resnets.", ".res_blocks.")
    if name == "latents_mean":
        return "per_channel_statistics.mean-of-means"
    if name == "latents_std":
        return "per_channel_statistics.std-of-means"
    m = re.match(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)", name)
    if m:
        return f"encoder.down_blocks.{2 * int(m.group(1)) + 1}.{m.group(2)}"
    m = re.match(r"encoder\.down_blocks\.(\d+)\.(.*)", name)
    if m:
        return f"encoder.down_blocks.{2 * int(m.group(1))}.{m.group(2)}"
    if name.startswith("encoder.mid_block."):
        return name.replace("encoder.mid_block.", f"encoder.down_blocks.{_VAE_STAGES['encoder'] * 2}.")
    if name.startswith("decoder.mid_block."):
        return name.replace("decoder.mid_block.", "decoder.up_blocks.0.")
    m = re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", name)
    if m:
        return f"decoder.up_blocks.{2 * int(m.group(1)) + 1}.{m.group(2)}"
    m = re.match(r"decoder\.up_blocks\.(\d+)\.(.*)", name)
    if m:
        return f"decoder.up_blocks.{2 * int(m.group(1)) + 2}.{m.group(2)}"
    return name


_VAE_STAGES = {"encoder": 4}
def _connector_to_original(name: str) -> str:
    from .files import CONNECTOR_NAMES

    for original, new in CONNECTOR_NAMES:
        if name.startswith(new):
            rest = name[len(new):].replace("transformer_blocks.", "transformer_1d_blocks.")
            return original + rest.replace(".norm_q.", ".q_norm.").replace(".norm_k.", ".k_norm.")
    raise KeyError(name)


def _vocoder_to_original(name: str) -> str:
    from .files import VOCODER_NAMES

    outer = ""
    for sub in ("vocoder.", "bwe_generator."):
        if name.startswith(sub):
            outer, name = sub, name[len(sub):]
    for original, new in VOCODER_NAMES:
        if name.startswith(new):
            name = original + name[len(new):]
            break
    return "vocoder." + outer + name.replace(".downsample.filter", ".downsample.lowpass.filter")


def gemma_spiece_model(tokenizer_folder: str | Path) -> bytes:
    """A SentencePiece model that tokenizes as the tiny Gemma tokenizer (``build_tokenizer``) does: its pieces in
    id order, BPE with no merges (every piece one character), byte fallback, whitespace escaped to ``▁`` and no
    dummy prefix, as Gemma's own model; ComfyUI's Gemma file carries its tokenizer so (``spiece_model``)."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers import AutoTokenizer

    vocab = sorted(AutoTokenizer.from_pretrained(tokenizer_folder).get_vocab().items(), key=lambda kv: kv[1])
    if [i for _, i in vocab] != list(range(len(vocab))):
        raise ValueError("the tokenizer's ids are not contiguous")
    model = pb.ModelProto()
    kind = pb.ModelProto.SentencePiece.Type
    for piece, _ in vocab:
        entry = model.pieces.add()
        entry.piece = piece
        entry.type = (kind.CONTROL if piece in ("<pad>", "<eos>", "<bos>", "<mask>") else kind.UNKNOWN
                      if piece == "<unk>" else kind.BYTE if piece.startswith("<0x") and len(piece) == 6 else kind.NORMAL)
    spec = model.trainer_spec
    spec.model_type, spec.byte_fallback, spec.vocab_size = pb.TrainerSpec.BPE, True, len(vocab)
    spec.pad_id, spec.eos_id, spec.bos_id, spec.unk_id = 0, 1, 2, 3
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = False
    model.normalizer_spec.escape_whitespaces = True
    model.normalizer_spec.remove_extra_whitespaces = False
    return model.SerializeToString()


def export_comfy_files(folder: str | Path, out: str | Path, dtype: str = "fp32",
                       tokenizer: bool = True) -> dict[str, Path]:
    """Write a tiny LTX-2 diffusers folder as ComfyUI's single files: the all-in-one checkpoint (transformer,
    connectors, video and audio VAE, vocoder in ComfyUI's names), Gemma 3 as ComfyUI's text-encoder file, and the
    latent upscaler; the folder itself is the files' ``config`` (what the shapes cannot tell: the tiny models' head
    counts, Gemma pattern, VAE and vocoder strides). ``tokenizer``: the Gemma file carries its tokenizer
    (``spiece_model``, as ComfyUI's does). ``dtype`` fp8: as Lightricks' and ComfyUI's fp8 files, the
    transformer blocks' and Gemma's layers' matrices in float8_e4m3fn with their scales (ComfyUI's per-layer format:
    ``.comfy_quant`` records in the checkpoint, ``_quantization_metadata`` in the Gemma file), the rest bf16; exact
    for a folder built with ``fp8=True``. Returns {"checkpoint", "text_encoder", ["latent_upscaler"], "config"} ->
    path."""
    import torch
    from safetensors.torch import load_file, save_file

    from ...engine.tiny import fp8_per_layer
    from . import files as F

    folder, out = Path(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[dtype]

    def load(component):
        state = {}
        for f in sorted((folder / component).glob("*.safetensors")):
            state.update(load_file(str(f)))
        return {k: v.to(dt) if v.is_floating_point() else v for k, v in state.items()}

    vae_config = json.loads((folder / "vae" / "config.json").read_text())
    _VAE_STAGES["encoder"] = len(vae_config["block_out_channels"])
    tensors = {}
    tensors.update({F.TRANSFORMER + F.transformer_to_original(k): v for k, v in load("transformer").items()})
    tensors.update({_connector_to_original(k): v for k, v in load("connectors").items()})
    tensors.update({"vae." + _vae_to_original(k): v for k, v in load("vae").items()})
    tensors.update({"audio_vae." + k.replace("latents_mean", "per_channel_statistics.mean-of-means")
                    .replace("latents_std", "per_channel_statistics.std-of-means"): v
                    for k, v in load("audio_vae").items()})
    tensors.update({_vocoder_to_original(k): v for k, v in load("vocoder").items()})
    if dtype == "fp8":
        tensors, _ = fp8_per_layer(tensors, lambda k: k.startswith(F.TRANSFORMER + "transformer_blocks."))
    paths = {"checkpoint": out / f"ltx2_tiny_{dtype}.safetensors"}
    save_file(tensors, str(paths["checkpoint"]))
    _, names = F.checkpoint_configs(paths["checkpoint"], F.config_overrides(folder))
    for component, mapping in names.items():  # the round trip is exact: every tensor back under its own name
        back = set(mapping.values())
        want = set(load_file(str(next((folder / component).glob("*.safetensors")))))
        if back != want:
            raise AssertionError(f"{component}: {sorted(back ^ want)[:6]}")
    gemma = load("text_encoder")
    text = {"model." + k[len("language_model.model."):]: v for k, v in gemma.items()
            if k.startswith("language_model.model.")}
    if tokenizer:
        spm = gemma_spiece_model(folder / "tokenizer")
        text["spiece_model"] = torch.frombuffer(bytearray(spm), dtype=torch.uint8)
    quant_meta = {}
    if dtype == "fp8":
        text, quant_meta = fp8_per_layer(text, lambda k: k.startswith("model.layers."), in_metadata=True)
    paths["text_encoder"] = out / f"gemma_tiny_{dtype}.safetensors"
    save_file(text, str(paths["text_encoder"]), metadata=quant_meta or None)
    if (folder / "latent_upsampler").is_dir():
        paths["latent_upscaler"] = out / f"ltx2_upscaler_tiny_{dtype}.safetensors"
        save_file(load("latent_upsampler"), str(paths["latent_upscaler"]))
    paths["config"] = folder  # what the shapes cannot tell: the tiny model's heads, Gemma pattern and strides
    return paths
