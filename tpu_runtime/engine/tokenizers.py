"""The tokenizer a ComfyUI text-encoder file carries: its SentencePiece model as a uint8 tensor ``spiece_model``
(umT5's, Gemma 3's), called as transformers' tokenizers are called (``tokenizer(texts, max_length=N, ...)`` ->
``input_ids`` and ``attention_mask``, padded to ``N``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace


def spiece_model(path: Path) -> bytes | None:
    """The SentencePiece model inside the safetensors file ``path`` (None: it has none)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("spiece_model").numpy().tobytes() if "spiece_model" in f.keys() else None  # noqa: SIM118 (safe_open has no __contains__)


class SentencePieceTokenizer:
    """Token ids of each text as the model's transformers tokenizer gives them: ``<bos>`` first where ``bos``
    (Gemma), the pieces, ``</s>`` last where ``eos`` (T5; truncation keeps it), padded with the pad id to
    ``max_length`` on ``padding_side`` ("left": Gemma as LTX-2's pipeline calls it)."""

    def __init__(self, model_proto: bytes, *, bos: bool = False, eos: bool = False, padding_side: str = "right"):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else 0
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else 2
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else 1
        self.bos, self.eos, self.padding_side = bos, eos, padding_side

    @classmethod
    def from_file(cls, path: Path, **options) -> "SentencePieceTokenizer":
        return cls(spiece_model(path), **options)

    def __call__(self, texts: list[str], max_length: int, **_) -> SimpleNamespace:
        import torch

        ids, mask = [], []
        for text in texts:
            row = ([self.bos_id] if self.bos else []) + self.sp.encode(text)
            row = row[: max_length - 1] + [self.eos_id] if self.eos else row[:max_length]
            pad = [self.pad_id] * (max_length - len(row))
            ids.append(pad + row if self.padding_side == "left" else row + pad)
            ones, zeros = [1] * len(row), [0] * len(pad)
            mask.append(zeros + ones if self.padding_side == "left" else ones + zeros)
        return SimpleNamespace(input_ids=torch.tensor(ids, dtype=torch.int64),
                               attention_mask=torch.tensor(mask, dtype=torch.int64))
