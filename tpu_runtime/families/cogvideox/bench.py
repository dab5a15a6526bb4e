"""CogVideoX's part of ``bench`` (``SPEC.bench``): loading a transformer folder with the family's loader (built on
``meta``, each tensor assigned once) against diffusers' ``from_pretrained`` as users without accelerate run it."""

from __future__ import annotations

import tempfile
from pathlib import Path


def folder_load(size_mb: int, tools, dtypes=("bfloat16", "float32")) -> tuple[dict, str]:
    """Write a random CogVideoX transformer folder of about ``size_mb`` MB (float32 safetensors, diffusers layout),
    then load it in fresh processes (``tools.load_in_child(ref, path, dtype, no_accelerate=False)``), once per run
    dtype, both ways. Returns the results and their table."""
    from diffusers import CogVideoXTransformer3DModel

    work = Path(tempfile.mkdtemp(prefix="tpu_video_load_"))
    heads, head_dim = 16, 64  # a narrow CogVideoX-5b: RoPE, 1024 wide; layers chosen for the size
    dim = heads * head_dim
    layers = max(1, round(size_mb * 2**20 / ((4 * dim * dim + 8 * dim * dim + 12 * 512 * dim) * 4)))
    model = CogVideoXTransformer3DModel(num_attention_heads=heads, attention_head_dim=head_dim, num_layers=layers,
                                        use_rotary_positional_embeddings=True, text_embed_dim=1024)
    folder = work / "transformer"
    model.save_pretrained(folder)
    del model
    out = {"folder_mb": sum(f.stat().st_size for f in folder.iterdir()) / 2**20, "layers": layers}
    for dtype in dtypes:
        out[dtype] = {"ours": tools.load_in_child(f"{__name__}:load_folder", folder, dtype),
                      "from_pretrained": tools.load_in_child(f"{__name__}:load_with_from_pretrained", folder, dtype,
                                                       no_accelerate=True)}
    return out, _table(out)


def load_folder(path: str, dtype: str) -> int:
    """The transformer folder ``path`` loaded as the family loads its transformer; the bytes loaded."""
    import json

    import torch
    from diffusers import CogVideoXTransformer3DModel

    from ...engine.components import builder
    from ...engine.weights import TensorSource, keep_fp32_modules, load_into_meta_module, safetensors_files

    torch_dtype = getattr(torch, dtype)
    config = json.loads((Path(path) / "config.json").read_text())
    source = TensorSource(safetensors_files(Path(path)))
    model = load_into_meta_module(builder(CogVideoXTransformer3DModel, config), source, {k: k for k in source.keys()},
                                  torch_dtype, "bench",
                                  keep_fp32=keep_fp32_modules(CogVideoXTransformer3DModel, torch_dtype))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def load_with_from_pretrained(path: str, dtype: str) -> int:
    """The transformer folder ``path`` loaded by diffusers' own ``from_pretrained``, for comparison."""
    import torch
    from diffusers import CogVideoXTransformer3DModel

    model = CogVideoXTransformer3DModel.from_pretrained(path, dtype=getattr(torch, dtype))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _table(r: dict) -> str:
    lines = [f"\nCogVideoX transformer folder: {r['folder_mb']:.0f} MiB float32 ({r['layers']} layers, 1024 wide), "
             "each load in a fresh process",
             f"  {'run dtype':<10} {'loader':<28} {'host s':>7} {'peak allocated MiB':>19} {'mentions accelerate':>20}"]
    for dtype in ("bfloat16", "float32"):
        for way, label in (("ours", "ours (meta, one copy)"), ("from_pretrained", "diffusers from_pretrained")):
            if dtype in r:
                x = r[dtype][way]
                lines.append(f"  {dtype:<10} {label:<28} {x['seconds']:>7.2f} {x['anon_increase_mib']:>19.0f} "
                             f"{str(x['mentions_accelerate']):>20}")
    return "\n".join(lines)
