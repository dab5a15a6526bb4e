"""ComfyUI's own code in the tests: a session that imports a pinned ComfyUI checkout, and tiny random-weight
models built with ComfyUI's own classes and saved as the single files its loaders detect.

Two ComfyUI versions are tested: the trees ``../shared/comfyui`` (0.3.64) and ``../shared/comfyui-0.33`` (0.33.0)
beside this checkout (``COMFYUI_TREES``), or the one tree ``$TPU_VIDEO_COMFYUI`` names. ``COMFYUI`` is the default
tree of a session (``$TPU_VIDEO_COMFYUI`` or ``../shared/comfyui``). Tests that take the ``comfy`` fixture
(conftest.py) run once per tree; ``@pytest.mark.comfy_versions("0.33")`` keeps a test to the trees it names. The
rest of the suite keeps
ComfyUI out (``conftest._NoComfyUI``) and puts stand-ins into ``sys.modules``; ``comfyui_session`` sets those
aside, imports the real modules (ComfyUI's ``nodes.py`` as ``nodes``, so its node classes can be used) and puts
everything back afterwards. Our pack is imported the way ComfyUI imports a custom node: as a package of its own
name (``load_pack``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from tpu_runtime.bridge.tiny import random_state as randomise  # noqa: F401 - the tests' builders, re-exported
from tpu_runtime.bridge.tiny import save_diffusion_model, tiny_wan  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
COMFYUI_ENV = "TPU_VIDEO_COMFYUI"
SHARED = ROOT.parent / "shared"
COMFYUI = Path(os.environ.get(COMFYUI_ENV) or SHARED / "comfyui").resolve()


def comfyui_version(tree: Path) -> str:
    """The ComfyUI version of a checkout (its ``comfyui_version.py``), e.g. "0.33.0"."""
    text = (Path(tree) / "comfyui_version.py").read_text()
    for line in text.splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise RuntimeError(f"{tree} has no __version__ in comfyui_version.py")


def _trees() -> dict[str, Path]:
    if os.environ.get(COMFYUI_ENV):
        return {comfyui_version(COMFYUI): COMFYUI}
    found = {}
    for name in ("comfyui", "comfyui-0.33"):
        tree = (SHARED / name).resolve()
        if (tree / "comfy" / "sd.py").is_file():
            found[comfyui_version(tree)] = tree
    return found or {"missing": COMFYUI}


#: version -> ComfyUI tree, oldest first: the trees the bridge's tests run against.
COMFYUI_TREES = _trees()
NEWEST = list(COMFYUI_TREES)[-1]


def versions_param():
    """``params`` for a module fixture that opens a session per tree (ids ``comfy0.3.64``, ``comfy0.33.0``)."""
    import pytest

    return [pytest.param(v, id=f"comfy{v}") for v in COMFYUI_TREES]


def wanted(version: str, marker_args: tuple) -> bool:
    """Whether a test marked ``comfy_versions(*marker_args)`` runs on ``version``: a version prefix ("0.33"), or
    "newest"."""
    return any(version == NEWEST if a == "newest" else version.startswith(a) for a in marker_args)
PACK = "tpu_video_nodes_under_test"
_COMFY_TOP = ("comfy", "comfy_extras", "comfy_api", "comfy_execution", "comfy_config", "folder_paths",
              "node_helpers", "latent_preview", "nodes", "app", "utils", "server", "execution", "protocol",
              "comfyui_version", "middleware", "api_server", "comfy_api_nodes", "alembic_db", "hook_breaker_ac10a0",
              "cuda_malloc", PACK)


def _ours(name: str) -> bool:
    return name.split(".")[0] in _COMFY_TOP


@contextlib.contextmanager
def comfyui_session(tree: Path | str | None = None):
    """ComfyUI importable as the server would have it (``--cpu``), for the duration of the block: the checkout at
    ``tree`` (a folder, or a version of ``COMFYUI_TREES``; default ``COMFYUI``)."""
    tree = Path(COMFYUI_TREES.get(tree, tree) if isinstance(tree, str) else (tree or COMFYUI)).resolve()
    if not (tree / "comfy" / "sd.py").is_file():
        raise RuntimeError(f"ComfyUI's source is not at {tree}: set TPU_VIDEO_COMFYUI to a ComfyUI checkout")
    saved = {n: m for n, m in sys.modules.items() if _ours(n)}
    for name in saved:
        del sys.modules[name]
    finders = [f for f in sys.meta_path if type(f).__name__ == "_NoComfyUI"]
    for finder in finders:
        sys.meta_path.remove(finder)
    path = list(sys.path)
    sys.path.insert(0, str(tree))
    dont_write = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # the checkout may be read-only
    try:
        import comfy.cli_args

        comfy.cli_args.args.cpu = True
        import comfy.model_management  # noqa: F401 - probes the device with --cpu set
        yield
    finally:
        with contextlib.suppress(Exception):
            import comfy.model_management

            comfy.model_management.unload_all_models()
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
        sys.path[:] = path
        for finder in finders:
            sys.meta_path.insert(0, finder)
        sys.dont_write_bytecode = dont_write


def load_pack():
    """This checkout imported as ComfyUI imports a custom node folder (a package named after the folder)."""
    if PACK in sys.modules:
        return sys.modules[PACK]
    spec = importlib.util.spec_from_file_location(PACK, ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK] = module
    spec.loader.exec_module(module)
    return module


# --- tiny random-weight models (ComfyUI's classes; Wan's builders are the package's: bench uses them too) ----------
def tiny_hunyuan_video(hidden: int = 128, context: int = 64, double: int = 1, single: int = 1) -> torch.nn.Module:
    import dataclasses

    import comfy.ldm.hunyuan_video.model as hv
    import comfy.ops

    params = dict(in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=context, hidden_size=hidden,
                  mlp_ratio=4.0, num_heads=hidden // 128, depth=double, depth_single_blocks=single,
                  axes_dim=[16, 56, 56], theta=256, patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=True,
                  meanflow=False, byt5=False)
    # HunyuanVideo 1.5's options (newer ComfyUI), off: the original HunyuanVideo
    later = dict(use_cond_type_embedding=False, vision_in_dim=None, meanflow_sum=False)
    fields = {f.name for f in dataclasses.fields(hv.HunyuanVideoParams)}
    params.update({k: v for k, v in later.items() if k in fields})
    return hv.HunyuanVideo(image_model="hunyuan_video", operations=comfy.ops.disable_weight_init, **params)


def tiny_ltxv(head_dim: int = 4, layers: int = 2) -> torch.nn.Module:
    import comfy.ldm.lightricks.model as ltxv
    import comfy.ops

    return ltxv.LTXVModel(in_channels=128, cross_attention_dim=32 * head_dim, attention_head_dim=head_dim,
                          num_attention_heads=32, caption_channels=4096, num_layers=layers,
                          operations=comfy.ops.disable_weight_init)


def load(path: Path, **options):
    """The file through ComfyUI's own loader (Load Diffusion Model)."""
    import comfy.sd

    return comfy.sd.load_diffusion_model(str(path), model_options=options)


def sample(model, latent: torch.Tensor, positive, negative, *, steps: int = 4, cfg: float = 5.0,
           sampler: str = "euler", scheduler: str = "simple", seed: int = 42, denoise: float = 1.0):
    """KSampler's computation (``nodes.common_ksampler`` without the node around it)."""
    import comfy.sample

    latent = comfy.sample.fix_empty_latent_channels(model, latent)
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, steps, cfg, sampler, scheduler, positive, negative, latent,
                               denoise=denoise, seed=seed, disable_pbar=True)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest value of the reference ``b``."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
