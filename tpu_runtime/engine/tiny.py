"""What every family's tiny random-weight models share: a small tokenizer corpus and the tokenizers trained on
it, weight rounding that every file format holds exactly, ComfyUI's scaled-fp8 encoding, the marker that says
"random weights", and random LoRA files.

The families' builders (``families/<name>/tiny.py``) write real diffusers folders with these: ``demo``, ``bench``
and the tests load them through the same loaders as real downloads. The weights are random, so the video is noise;
these models exist to exercise code paths, never to judge output quality.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

TINY_MARKER = "tiny_random_weights.txt"

# Words for training the tiny tokenizer: enough for prompts in tests and the demo to tokenize into pieces.
CORPUS = [
    "a panda playing a guitar in a bamboo forest at sunset",
    "a cat walks on the grass, realistic style, high quality video",
    "a red car drives along a coastal road while waves crash on the rocks",
    "an astronaut rides a horse on the moon, cinematic lighting",
    "slow motion of a glass of water falling on the table",
    "low quality, blurry, distorted, ugly, bad anatomy, watermark, text",
    "the quick brown fox jumps over the lazy dog 0 1 2 3 4 5 6 7 8 9",
]



def build_t5_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import T5TokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=120, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    fast = T5TokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0)
    fast.save_pretrained(directory)


def train_spiece(path: Path) -> None:
    """A small real SentencePiece (unigram) model with umT5's special ids: pad 0, eos 1, unk 2, no bos."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 4), model_writer=model, vocab_size=96, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, hard_vocab_limit=False, minloglevel=2,
    )
    path.write_bytes(model.getvalue())


def exact(t, fp8: bool):
    """Round a weight so that every file format the tests write holds it exactly: bfloat16 values (fp16-exact
    too once tiny magnitudes are zeroed), and for matrices, fp8_e4m3fn values times a power-of-two scale (the
    smallest at or above absmax / 448: a value past fp8_e4m3fn's 448 is cast to NaN, not clamped)."""
    import torch

    t = t.to(torch.bfloat16).float()
    t[t.abs() < 2.0**-14] = 0.0
    if fp8 and t.ndim == 2 and t.abs().max() > 0:
        scale = 2.0 ** torch.ceil(torch.log2(t.abs().max() / 448.0))
        t = (t / scale).to(torch.float8_e4m3fn).float() * scale
        t[t.abs() < 2.0**-14] = 0.0
    return t


def finish(directory: Path, model_index: dict, label: str, seed: int) -> Path:
    """Write model_index.json and the marker that says the weights are random."""
    import json

    (directory / "model_index.json").write_text(json.dumps(model_index, indent=2))
    (directory / TINY_MARKER).write_text(
        f"Tiny {label}-shaped model with RANDOM weights (seed {seed}).\n"
        "It produces noise, not video; it exists to test and demonstrate the pipeline.\n"
    )
    log.info("built tiny random-weight %s model in %s", label, directory)
    return directory


def fp8_quantise(t):
    """(float8_e4m3fn values, 0-dim float32 scale) of matrix ``t``, the scale the smallest power of two at or
    above absmax / 448 (as ``exact``): a matrix ``exact(t, fp8=True)`` rounded is held exactly."""
    import torch

    scale = 2.0 ** torch.ceil(torch.log2(t.float().abs().max() / 448.0))
    return (t.float() / scale).to(torch.float8_e4m3fn), scale.reshape(()).float()


def fp8_scaled(tensors: dict) -> dict:
    """ComfyUI's older "scaled" fp8: matrices as float8_e4m3fn with a 0-dim float32 ``scale_weight``, plus the
    marker."""
    import torch

    out = {}
    for key, t in tensors.items():
        if t.ndim == 2 and key.endswith(".weight") and t.abs().max() > 0:
            out[key], out[key[: -len("weight")] + "scale_weight"] = fp8_quantise(t)
        else:
            out[key] = t
    out["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    return out


def fp8_per_layer(tensors: dict, quantise, in_metadata: bool = False) -> tuple[dict, dict]:
    """ComfyUI's per-layer quantisation format (its fp8 LTX-2 checkpoints): each matrix ``quantise(key)`` picks
    as float8_e4m3fn with ``<layer>.weight_scale`` and ``<layer>.input_scale`` (float32, 0-dim), the layer's
    format as a ``<layer>.comfy_quant`` JSON tensor or, with ``in_metadata``, in the file's
    ``_quantization_metadata``. Returns (tensors, safetensors metadata)."""
    import json

    import torch

    out, layers = {}, {}
    for key, t in tensors.items():
        if t.ndim == 2 and key.endswith(".weight") and quantise(key) and t.abs().max() > 0:
            layer = key[: -len(".weight")]
            out[key], out[f"{layer}.weight_scale"] = fp8_quantise(t)
            out[f"{layer}.input_scale"] = torch.tensor(1.0)
            layers[layer] = {"format": "float8_e4m3fn"}
            if not in_metadata:
                out[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(layers[layer]).encode()),
                                                           dtype=torch.uint8)
        else:
            out[key] = t
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})} if in_metadata else {}
    return out, meta


LORA_FORMATS = ("comfy", "comfy_ab", "musubi", "diffusers")


def write_tiny_lora(transformer: str | Path, out: str | Path, fmt: str, targets: str,
                    original: Callable[[str], str] = lambda name: name, rank: int = 4, seed: int = 0,
                    scale: float = 0.3, bias_diffs: bool = False, extra: dict | None = None) -> Path:
    """A random-weight LoRA for the transformer folder ``transformer`` (diffusers format) over every weight whose
    name matches the regex ``targets``, written as people download them (``fmt``):

    - ``comfy``: ComfyUI / original names (``original(name)``), ``diffusion_model.`` prefix, lora_down/lora_up
      with alpha (and ``.diff_b`` bias differences on the feed-forward layers with ``bias_diffs``);
    - ``comfy_ab``: original names with lora_A/lora_B and no alpha;
    - ``musubi``: kohya/musubi-tuner ``lora_unet_`` names (dots as underscores) with alpha;
    - ``diffusers``: diffusers/PEFT ``transformer.`` names with lora_A/lora_B.

    ``extra``: more tensors written as given (e.g. keys that match nothing)."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    if fmt not in LORA_FORMATS:
        raise ValueError(f"fmt must be one of {LORA_FORMATS}")
    state = load_file(str(Path(transformer) / "diffusion_pytorch_model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key in sorted(state):
        if not re.fullmatch(targets, key):
            continue
        out_dim, in_dim = state[key].shape
        module = key[: -len(".weight")]
        down = torch.randn(rank, in_dim, generator=generator) * scale
        up = torch.randn(out_dim, rank, generator=generator) * scale
        if fmt == "diffusers":
            tensors[f"transformer.{module}.lora_A.weight"] = down
            tensors[f"transformer.{module}.lora_B.weight"] = up
            continue
        name = original(key)[: -len(".weight")]
        name = f"lora_unet_{name.replace('.', '_')}" if fmt == "musubi" else f"diffusion_model.{name}"
        low, high = ("lora_A", "lora_B") if fmt == "comfy_ab" else ("lora_down", "lora_up")
        tensors[f"{name}.{low}.weight"] = down
        tensors[f"{name}.{high}.weight"] = up
        if fmt != "comfy_ab":
            tensors[f"{name}.alpha"] = torch.tensor(float(rank) / 2)
        if bias_diffs and fmt == "comfy" and (".ffn." in key or ".ff." in key):
            tensors[f"{name}.diff_b"] = torch.randn(out_dim, generator=generator) * 0.05
    tensors.update(extra or {})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    return out
