"""A real ComfyUI server with this checkout under custom_nodes/ and its page in a headless Chromium, for the browser
test (test_page.py).

``serve`` copies a pinned ComfyUI tree to a temporary folder, links this checkout into its custom_nodes/, puts tiny
random-weight models into its model folders under the names the example workflows ask for, and starts
``main.py --cpu`` with the frontend that tree pins (``frontend_root``). ``open_page`` drives Debian's Chromium
through Playwright for Python (its own browser download is not needed: ``executable_path``). A missing browser,
Playwright or frontend fails the test with the command that installs it: the page is what this test is about.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from comfy_native import ROOT, comfyui_session, comfyui_version
from comfy_server_trial import http, start_server, wait_until_up

CHROMIUM = os.environ.get("TPU_VIDEO_CHROMIUM", "/usr/bin/chromium")
INSTALL_CHROMIUM = "apt-get update && apt-get install -y chromium"
INSTALL_PLAYWRIGHT = "pip install -e \".[test]\" (or: pip install playwright)"
FRONTEND_ENV = "TPU_VIDEO_FRONTEND"  # a folder that holds the comfyui_frontend_package a tree pins
PACK_FOLDER = "tpu-video-nodes"
WAN_NATIVE = {"diffusion_models": "wan2.1_t2v_1.3B_fp16.safetensors",
              "text_encoders": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "vae": "wan_2.1_vae.safetensors"}
COGVIDEOX_FOLDER = "CogVideoX-2b"
PAGE_SETTINGS = {"Comfy.TutorialCompleted": True, "Comfy.VersionCompatibility.DisableWarnings": True,
                 "LiteGraph.Node.TooltipDelay": 100, "Comfy.Workflow.ShowMissingModelsWarning": False,
                 "LiteGraph.Canvas.MinFontSizeForLOD": 1}  # legible screenshots of whole graphs


class Missing(RuntimeError):
    """What the browser test needs and this machine lacks, with the command that installs it."""


def pinned_frontend(tree: Path) -> str:
    """The comfyui-frontend-package version a ComfyUI tree's requirements.txt pins."""
    match = re.search(r"^comfyui-frontend-package==([\w.]+)", (tree / "requirements.txt").read_text(), re.M)
    if not match:
        raise RuntimeError(f"{tree}/requirements.txt pins no comfyui-frontend-package")
    return match.group(1)


def frontend_root(tree: Path) -> Path:
    """The static folder of the frontend ``tree`` pins: the installed package when it is that version, else one
    installed beside it with ``pip install --target`` (``$TPU_VIDEO_FRONTEND``, or the virtual environment's
    ``frontend-<version>`` folder, as .ci/run installs it)."""
    version = pinned_frontend(tree)
    places = [Path(p) for p in (os.environ.get(FRONTEND_ENV, ""),) if p]
    places.append(Path(sys.prefix) / f"frontend-{version}")
    with contextlib.suppress(ImportError):
        import comfyui_frontend_package
        from importlib.metadata import version as installed

        if installed("comfyui-frontend-package") == version:
            return Path(comfyui_frontend_package.__file__).parent / "static"
    for place in places:
        info = list(place.glob("comfyui_frontend_package-*.dist-info"))
        if info and info[0].name == f"comfyui_frontend_package-{version}.dist-info":
            return place / "comfyui_frontend_package" / "static"
    target = places[-1]
    raise Missing(f"ComfyUI {comfyui_version(tree)} pins comfyui-frontend-package=={version}, which is not installed: "
                  f"pip install --no-deps --target {target} comfyui-frontend-package=={version}")


def browser_ready() -> None:
    """Raise ``Missing`` (with the install command) without Playwright or the browser."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as error:
        raise Missing(f"Playwright for Python is not installed: {INSTALL_PLAYWRIGHT}") from error
    if not Path(CHROMIUM).is_file():
        raise Missing(f"Chromium is not at {CHROMIUM}: {INSTALL_CHROMIUM} (or set TPU_VIDEO_CHROMIUM)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tree(tree: Path, folder: Path) -> Path:
    """A copy of ``tree`` with this checkout as a custom node and tiny models under the example workflows' names:
    CogVideoX-2b (a diffusers folder) for the family's workflow, and ComfyUI's Wan 2.1 single files (diffusion
    model, umT5 text encoder, VAE) for the native ComfyUI-nodes workflow."""
    import torch

    from tpu_runtime.bridge.tiny import (
        UMT5_FILE_CONFIG, save_diffusion_model, save_umt5, save_wan_vae, tiny_wan, umt5_config,
    )
    from tpu_runtime.families.cogvideox.tiny import build_tiny_cogvideox

    shutil.copytree(tree, folder, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    (folder / "custom_nodes").mkdir(exist_ok=True)
    (folder / "custom_nodes" / PACK_FOLDER).symlink_to(ROOT)
    config = umt5_config(folder, **UMT5_FILE_CONFIG)  # the text encoder's file and its configuration agree
    (folder / "comfy" / "text_encoders" / "umt5_config_xxl.json").write_text(json.dumps(config, indent=2))
    # the page as a returning user has it: no first-run templates, no version warnings, quick tooltips
    user = folder / "user" / "default"
    user.mkdir(parents=True, exist_ok=True)
    (user / "comfy.settings.json").write_text(json.dumps(PAGE_SETTINGS))
    models = folder / "models"
    for kind in WAN_NATIVE:
        (models / kind).mkdir(parents=True, exist_ok=True)
    build_tiny_cogvideox(models / "diffusers" / COGVIDEOX_FOLDER, "2b", seed=1)
    with comfyui_session(folder):
        save_diffusion_model(tiny_wan("t2v"), models / "diffusion_models" / WAN_NATIVE["diffusion_models"], seed=1,
                             dtype=torch.float16)
        save_umt5(models / "text_encoders" / WAN_NATIVE["text_encoders"], config, seed=2)
        save_wan_vae(models / "vae" / WAN_NATIVE["vae"], seed=3)
    return folder


class Server:
    """``main.py --cpu`` of a built tree, its log, and the HTTP calls the tests make beside the page."""

    def __init__(self, folder: Path, frontend: Path, python: str):
        self.folder, self.port = folder, free_port()
        self.log = folder / "server.log"
        env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_VIDEO_CACHE_DIR=str(folder / "xla_cache"))
        env.pop("TPU_VIDEO_AUTO", None)  # the automatic mode as the page's setting says, not as this shell does
        env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                            if p and Path(p).resolve() != ROOT)
        self.process = start_server(folder, python, self.port, env, self.log,
                                    ("--front-end-root", str(frontend), "--disable-auto-launch"))
        wait_until_up(self.port, self.process, self.log, timeout=240)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str):
        return http(self.port, path)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


@contextlib.contextmanager
def open_page(playwright, url: str):
    """A headless Chromium (of ``playwright``, a started ``sync_playwright()``) on ``url``, the page loaded and
    ComfyUI's app up; yields (page, console) where console collects every console error and uncaught page error
    as text, with the script or resource it came from."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
    try:
        context = browser.new_context(viewport={"width": 1600, "height": 1000})
        page = context.new_page()
        console: list[str] = []
        page.on("console", lambda m: console.append(f"{m.text} @ {m.location.get('url', '')}")
                if m.type == "error" else None)
        page.on("pageerror", lambda e: console.append(f"uncaught: {e}"))
        page.goto(url)
        page.wait_for_function("() => window.app && window.app.graph && window.app.canvas", timeout=120_000)
        yield page, console
    finally:
        browser.close()


def wait_for_event(page, name: str, timeout: float = 300):
    """The detail of the next ``name`` event the page's API client recorded (``record_events``)."""
    page.wait_for_function(f"() => window.__tpu_events.some(e => e.type === {json.dumps(name)})",
                           timeout=timeout * 1000)
    return page.evaluate(f"() => window.__tpu_events.find(e => e.type === {json.dumps(name)}).detail")


def finished(page, timeout: float = 300) -> tuple[str, dict]:
    """How the running prompt ended (execution_success, execution_error or execution_interrupted) and its detail."""
    ends = "['execution_success', 'execution_error', 'execution_interrupted']"
    page.wait_for_function(f"() => window.__tpu_events.some(e => {ends}.includes(e.type))", timeout=timeout * 1000)
    return tuple(page.evaluate(f"() => {{ const e = window.__tpu_events.find(e => {ends}.includes(e.type));"
                               " return [e.type, e.detail]; }"))


def record_events(page) -> None:
    """From now on the page keeps every execution and progress event its API client receives, in order."""
    page.evaluate("""() => {
        window.__tpu_events = [];
        if (window.__tpu_recording) return;
        window.__tpu_recording = true;
        for (const type of ["execution_start", "executing", "progress", "progress_text", "executed",
                            "execution_success", "execution_error", "execution_interrupted"]) {
            window.app.api.addEventListener(type, (e) => window.__tpu_events.push({type, detail: e.detail,
                                                                                   at: performance.now()}));
        }
    }""")


def wait_until(condition, timeout: float, every: float = 0.5, what: str = "condition"):
    end = time.time() + timeout
    while time.time() < end:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"{what} not met in {timeout} s")
