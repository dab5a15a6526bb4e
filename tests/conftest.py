"""Shared fixtures: tiny random-weight CogVideoX folders (all three generations), built once per session.

JAX runs on CPU in tests: JAX_PLATFORMS is set before anything imports jax. The persistent compilation cache
goes to a temporary folder of this run, so tests never read a cache left by an earlier run: the first pytest process
makes it and xdist's workers, started by that process, inherit it (``_RUN_CACHE_ENV``), so a program one worker
compiled is loaded, not compiled again, by the other and by the processes the tests start. The process that made it
removes it at the end. The programs the runtime saves for later processes go there too (its ``programs/`` folder):
a process that needs a program another one of the run saved loads it (``CompileStats.programs_loaded``), traced and
compiled by no one. A test whose claim needs a cache of its own (a restarted process that compiles nothing, a
first run that compiles everything) gives its process one (``--cache-dir``, ``TPU_VIDEO_CACHE_DIR``); counts of
programs built in this process are ``backend_compiles``, which a hit in the shared cache does not lower.
"""

import importlib.abc
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA's CPU backend compiles the tests' programs without LLVM's optimisations: each runs a few times on tiny inputs,
# so compiling it was most of its cost (a tiny Wan generation: about 40% less CPU time; the frames move by ~1e-6).
# The TPU compiler that `plan` runs leaves it aside (its reports are the same). Every process the tests start gets
# it too (subprocess_env).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()
_RUN_CACHE_ENV = "TPU_VIDEO_TEST_RUN_CACHE"
_MADE_THE_RUN_CACHE = not os.environ.get(_RUN_CACHE_ENV)
if _MADE_THE_RUN_CACHE:
    os.environ[_RUN_CACHE_ENV] = tempfile.mkdtemp(prefix="tpu_video_test_cache_")
_SESSION_CACHE = os.environ[_RUN_CACHE_ENV]
os.environ["TPU_VIDEO_CACHE_DIR"] = _SESSION_CACHE

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _forget_the_folder_around_the_clone() -> None:
    """pytest puts the folder that holds this checkout first on sys.path: the checkout is a Python package
    (ComfyUI's __init__.py sits at its root) and pytest imports it when it sets up the first test. Whatever lies
    beside the clone must not shadow an import (a ComfyUI checkout named `comfy` did): the tests see the same
    modules wherever the clone sits."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT.parent]


_forget_the_folder_around_the_clone()


class _NoComfyUI(importlib.abc.MetaPathFinder):
    """ComfyUI's modules are never imported from wherever they happen to be installed: a test that needs ComfyUI
    puts an explicit stand-in into sys.modules (which is consulted before this finder)."""

    NAMES = ("comfy", "comfy_extras", "folder_paths")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.NAMES:
            raise ModuleNotFoundError(f"tests use explicit ComfyUI stand-ins, not an installed {name}", name=name)
        return None


sys.meta_path.insert(0, _NoComfyUI())

import pytest  # noqa: E402
import run_order  # noqa: E402
import time_budget  # noqa: E402

PROMPT = "a panda playing a guitar"
NEGATIVE = "blurry, low quality"
# Small sizes per generation: frames follow each generation's rule; 1.5 gets an odd latent frame count (5) so the
# padding frame is exercised.
SIZES = {"2b": (64, 96, 9), "5b": (64, 96, 9), "1.5": (64, 64, 17)}


def pytest_configure(config):
    config.addinivalue_line("markers", "comfy_versions(*versions): run a test of the native bridge only on the "
                            "ComfyUI trees named (a version prefix such as \"0.33\", or \"newest\")")
    time_budget.pytest_configure(config)
    config.pluginmanager.register(run_order, "tpu_video_run_order")


def pytest_unconfigure(config):
    if _MADE_THE_RUN_CACHE:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Tests of the native bridge run once per ComfyUI tree (their module's ``pack`` fixture is parametrized by
    version); ``comfy_versions`` deselects the trees a test does not name (a smaller pass for older versions)."""
    from comfy_native import wanted

    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("comfy_versions")
        version = getattr(getattr(item, "callspec", None), "params", {}).get("pack")
        (drop if marker and isinstance(version, str) and not wanted(version, marker.args) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _same_imports_wherever_the_clone_sits():
    _forget_the_folder_around_the_clone()  # again: pytest's package setup has just put it back
    yield


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from tpu_runtime.families.cogvideox.tiny import GENERATIONS, build_tiny_cogvideox

    base = tmp_path_factory.mktemp("tiny_models")
    return {g: build_tiny_cogvideox(base / f"cogvideox_{g}", g, seed=1) for g in GENERATIONS}


# Wan: 64x64 (a multiple of TI2V-5B's 32) and 9 frames (3 latent frames).
WAN_SIZE = (64, 64, 9)


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory):
    """Tiny random-weight Wan folders of every generation, in diffusers format."""
    from tpu_runtime.families.wan.tiny import WAN_GENERATIONS, build_tiny_wan

    base = tmp_path_factory.mktemp("tiny_wan")
    return {g: build_tiny_wan(base / f"wan_{g}", g, seed=2) for g in WAN_GENERATIONS}


@pytest.fixture(scope="session")
def runtime():
    from tpu_runtime.engine.runtime import get_runtime

    return get_runtime()


def subprocess_env(**extra):
    """Environment for a child process running the CLI from this checkout on CPU (the tests' compile flags kept
    where ``extra`` gives XLA_FLAGS of its own)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    env.update({k: str(v) for k, v in extra.items()})
    if "XLA_FLAGS" in extra:
        env["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {extra['XLA_FLAGS']}"
    return env


# Image-to-video: sizes of the tiny models (CogVideoX-5b-I2V has learned positions for its 64x64 only).
I2V_SIZES = {"cog-5b": (64, 64, 9), "cog-1.5": (64, 64, 17), "wan-i2v": (64, 64, 9)}


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """Three pictures, none of them the video's aspect ratio (diffusers stretches them to the video's size)."""
    import numpy as np
    from PIL import Image

    base = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(5)
    paths = {}
    for name, (h, w) in (("first", (40, 50)), ("last", (30, 70)), ("other", (50, 40))):
        pixels = (rng.random((h, w, 3)) * 255).astype(np.uint8)
        paths[name] = base / f"{name}.png"
        Image.fromarray(pixels).save(paths[name])
    return paths


@pytest.fixture(scope="session")
def i2v_models(tmp_path_factory):
    """Tiny random-weight image-to-video models of every kind (TI2V-5B is tiny_wan's)."""
    from tpu_runtime.families.cogvideox.tiny import build_tiny_cogvideox
    from tpu_runtime.families.wan.tiny import build_tiny_wan

    base = tmp_path_factory.mktemp("i2v_models")
    return {
        "cog-5b": build_tiny_cogvideox(base / "cog_5b_i2v", "5b", seed=3, image_to_video=True),
        "cog-1.5": build_tiny_cogvideox(base / "cog_15_i2v", "1.5", seed=3, image_to_video=True),
        "wan-i2v": build_tiny_wan(base / "wan21_i2v", "2.1", seed=3, image="i2v"),
        "wan-flf2v": build_tiny_wan(base / "wan21_flf2v", "2.1", seed=3, image="flf2v"),
        "wan-a14b": build_tiny_wan(base / "wan22_i2v_a14b", "2.2-A14B", seed=3, image="i2v"),
    }


# LTX-2: 64x96 (multiples of its 32) and 17 frames (3 latent frames; 18 latent sound frames at 24 fps).
LTX2_SIZE = (64, 96, 17)


@pytest.fixture(scope="session")
def tiny_ltx2(tmp_path_factory):
    """Tiny random-weight LTX-2.0 and 2.3 folders in diffusers format, each with its latent upsampler."""
    from tpu_runtime.families.ltx2.tiny import LTX2_GENERATIONS, build_tiny_ltx2

    base = tmp_path_factory.mktemp("tiny_ltx2")
    return {g: build_tiny_ltx2(base / f"ltx2_{g}", g, seed=6) for g in LTX2_GENERATIONS}
