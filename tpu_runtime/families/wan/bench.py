"""Wan's part of ``bench`` (``SPEC.bench``): loading a ComfyUI single-file transformer, merging LoRAs into tiny
transformers of several widths, and the published MagCache curve a model without its own ratios is benched with."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path


def file_load(size_mb: int, tools, dtypes=("bfloat16", "float32")) -> tuple[dict, str]:
    """Write a random Wan transformer of about ``size_mb`` MB (fp16, original key names), then load it with the
    family's loader in fresh processes (``tools.load_in_child(ref, path, dtype)``), once per run dtype: host seconds and
    peak host memory. Returns the results and their table."""
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from .files import wan_transformer_to_original

    work = Path(tempfile.mkdtemp(prefix="tpu_video_load_"))
    dim, ffn = 1536, 8960  # Wan 2.1 1.3B's width; layers chosen for the size
    per_layer = (8 * dim * dim + 2 * dim * ffn) * 2
    layers = max(1, round(size_mb * 2**20 / per_layer))
    with torch.device("meta"):
        meta = WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=ffn, num_layers=layers,
                                     text_dim=4096, freq_dim=256)
    tensors = {"model.diffusion_model." + wan_transformer_to_original(k):
               (torch.randn(tuple(v.shape)) * 0.02).to(torch.float16) for k, v in meta.state_dict().items()}
    path = work / "wan_transformer_fp16.safetensors"
    save_file(tensors, str(path))
    del tensors
    out = {"file_mb": path.stat().st_size / 2**20, "layers": layers}
    for dtype in dtypes:
        out[dtype] = tools.load_in_child(f"{__name__}:load_file", path, dtype)
    path.unlink()
    return out, _load_table(out)


def load_file(path: str, dtype: str) -> int:
    """The single-file transformer ``path`` loaded as the family loads it; the bytes loaded."""
    import torch
    from diffusers import WanTransformer3DModel

    from ...engine.weights import TensorSource, keep_fp32_modules, load_into_meta_module
    from .files import transformer_names

    torch_dtype = getattr(torch, dtype)
    config, names = transformer_names(Path(path))
    model = load_into_meta_module(lambda: WanTransformer3DModel(**config), TensorSource([Path(path)]), names,
                                  torch_dtype, "bench", keep_fp32=keep_fp32_modules(WanTransformer3DModel, torch_dtype))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _load_table(r: dict) -> str:
    lines = [f"\nsingle-file Wan transformer: {r['file_mb']:.0f} MiB fp16 ({r['layers']} layers of Wan 2.1 1.3B "
             "width), loaded by our loader in a fresh process",
             f"  {'run dtype':<10} {'host s':>7} {'weights MiB':>12} {'peak allocated MiB':>19} "
             f"{'peak mapped file MiB':>21}"]
    for dtype in ("bfloat16", "float32"):
        if dtype in r:
            x = r[dtype]
            lines.append(f"  {dtype:<10} {x['seconds']:>7.2f} {x['loaded_bytes'] / 2**20:>12.0f} "
                         f"{x['anon_increase_mib']:>19.0f} {x['file_pages_increase_mib']:>21.0f}")
    lines.append("  (allocated: anonymous memory the load added; mapped file: pages of the memory-mapped file, clean "
                 "page cache the kernel can drop)")
    return "\n".join(lines)


def lora_merge(widths=(256, 512, 1024), ranks=(4, 32, 128), layers: int = 4, repeats: int = 3) -> tuple[dict, str]:
    """Time merging a LoRA into tiny random Wan transformers of several widths (every attention and feed-forward
    linear of every block, the way the distillation LoRAs touch them) at several ranks: the first merge (file
    read, host copy of the loaded weights, merge programs compiled) and a change of strength (no compile)."""
    import numpy as np
    from safetensors.torch import load_file

    from ...engine.lora import LoraSpec
    from ...engine.runtime import compile_stats
    from .model import WanFamily
    from .tiny import TinyWanSpec, build_tiny_lora, build_tiny_wan

    work = Path(tempfile.mkdtemp(prefix="tpu_video_lora_"))
    rows = []
    for width in widths:
        folder = build_tiny_wan(work / f"wan_{width}", "2.1", spec=TinyWanSpec(heads=width // 128, layers=layers,
                                                                                ffn=4 * width))
        family = WanFamily(folder, dtype="float32")
        state = family.state("transformer")
        for rank in ranks:
            path = build_tiny_lora(folder / "transformer", work / f"lora_{width}_{rank}.safetensors", "comfy",
                                   rank=rank)
            family.release()  # a fresh start: the loaded weights, no host copies yet
            state = family.state("transformer")
            before = compile_stats()
            start = time.perf_counter()
            family.apply_loras({"transformer": (LoraSpec(str(path), 1.0),)})
            first = time.perf_counter() - start
            compiles = compile_stats().since(before).xla_compiles
            changes = []
            for i in range(repeats):
                start = time.perf_counter()
                family.apply_loras({"transformer": (LoraSpec(str(path), 0.5 + 0.1 * i),)})
                changes.append(time.perf_counter() - start)
            touched = family.lora_merger("transformer").touched
            lora = [t for k, t in load_file(str(path)).items() if not k.endswith(".alpha")]
            rows.append({"width": width, "rank": rank, "layers": layers, "weights_merged": len(touched),
                         "merged_params": int(sum(np.prod(state[n].shape) for n in touched)),
                         "lora_params": int(sum(t.numel() for t in lora)),
                         "first_merge_s": first, "first_merge_compiles": compiles,
                         "strength_change_s_median": statistics.median(changes)})
        family.release()
    out = {"rows": rows}
    return out, _lora_table(out)


def _lora_table(r: dict) -> str:
    lines = ["\nLoRA merge on tiny Wan transformers (all attention and feed-forward linears), float32",
             f"  {'width':>6} {'rank':>5} {'weights':>8} {'merged Mparams':>15} {'LoRA Mparams':>13} "
             f"{'first merge s':>14} {'compiles':>9} {'new strength s':>15}"]
    for x in r["rows"]:
        lines.append(f"  {x['width']:>6} {x['rank']:>5} {x['weights_merged']:>8} {x['merged_params'] / 1e6:>15.2f} "
                     f"{x['lora_params'] / 1e6:>13.3f} {x['first_merge_s']:>14.3f} {x['first_merge_compiles']:>9} "
                     f"{x['strength_change_s_median']:>15.3f}")
    return "\n".join(lines)


def stand_in_mag_ratios() -> tuple[str, dict]:
    """The MagCache ratios a model without published ones (a tiny random one) is benched with, so the skip
    pattern is a released model's: Wan 2.1 T2V 1.3B's published curve."""
    from . import magcache

    return ("Wan2.1-T2V-1.3B's published curve (stand-in: this model has none)",
            {"*": magcache.diffusers_list(magcache.WAN21_T2V_1_3B)})
