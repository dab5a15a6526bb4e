"""Installed the way ComfyUI-Manager installs a pack from its git URL: ``cm-cli install <url>`` (the
``comfyui-manager`` package's command line) clones this checkout into custom_nodes/ of a fresh copy of ComfyUI 0.33
and installs requirements.txt into the environment that runs ComfyUI. torch, torchvision and torchaudio stay the
builds that were there (requirements.txt names none of them), and after a restart the server lists the pack's nodes,
loaded from the clone.

The URL is a ``file://localhost/...`` clone of this checkout's committed state (the Manager takes a URL with a host;
git reads the path on this machine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from comfy_native import ROOT, SHARED
from comfy_page import free_port
from comfy_server_trial import http, start_server, wait_until_up

TREE = SHARED / "comfyui-0.33"
TORCH = ("torch", "torchvision", "torchaudio")
INSTALL_MANAGER = "pip install -e \".[test]\" (or: pip install comfyui-manager)"


def torch_builds() -> dict[str, str]:
    """``pip freeze``'s lines for torch, torchvision and torchaudio."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    return {line.split("==")[0].lower(): line for line in frozen.splitlines()
            if line.split("==")[0].lower() in TORCH}


def cm_cli() -> str:
    found = shutil.which("cm-cli", path=str(Path(sys.executable).parent)) or shutil.which("cm-cli")
    if found is None:
        pytest.fail(f"ComfyUI-Manager's cm-cli is not installed: {INSTALL_MANAGER}")
    return found


def test_cm_cli_install_from_the_git_url_keeps_torch_and_the_nodes_load_after_a_restart(tmp_path):
    command = cm_cli()
    source = tmp_path / "tpu-video-nodes.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(ROOT), str(source)], check=True)
    comfy = tmp_path / "comfyui"
    shutil.copytree(TREE, comfy, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    (comfy / "custom_nodes").mkdir(exist_ok=True)
    before = torch_builds()
    assert set(before) == set(TORCH), before

    env = dict(os.environ, COMFYUI_PATH=str(comfy))
    url = f"file://localhost{source}"
    done = subprocess.run([command, "install", url, "--mode", "local", "--exit-on-fail"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "[INSTALLED]" in out, out[-3000:]
    installed = comfy / "custom_nodes" / "tpu-video-nodes"
    assert (installed / "__init__.py").is_file() and (installed / "requirements.txt").is_file()
    head = subprocess.run(["git", "-C", str(installed), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert head.strip() == subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                          text=True).stdout.strip()
    assert "requirements.txt" in out or "pip" in out  # the Manager installed the pack's requirements
    assert torch_builds() == before, (before, torch_builds())

    # the restart: a fresh server finds the pack in custom_nodes/ and lists its nodes, loaded from the clone
    port, log = free_port(), tmp_path / "server.log"
    server_env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_VIDEO_CACHE_DIR=str(tmp_path / "xla_cache"))
    server_env["PYTHONPATH"] = os.pathsep.join(p for p in server_env.get("PYTHONPATH", "").split(os.pathsep)
                                               if p and Path(p).resolve() != ROOT)
    server = start_server(comfy, sys.executable, port, server_env, log, ("--disable-auto-launch",))
    try:
        wait_until_up(port, server, log, timeout=240)
        info = http(port, "/object_info")
    finally:
        server.terminate()
        server.wait(timeout=30)
    text = log.read_text(errors="replace")
    ours = {name for name, node in info.items() if node.get("python_module") == "custom_nodes.tpu-video-nodes"}
    assert {"TPUCogVideoXSampler", "TPUWanSampler", "TPULTX2Sampler", "TPUDiffusionModel", "TPUVAE"} <= ours, \
        sorted(ours)
    assert len(ours) >= 25, sorted(ours)
    ours_lines = [line for line in text.splitlines() if str(installed) in line]  # ComfyUI's import-times list
    assert ours_lines and not any("IMPORT FAILED" in line for line in ours_lines), text[-3000:]
