"""The native bridge on 8 simulated CPU devices (every mesh equals ComfyUI's native run; weights split by the
rule tables, or by the generic placement for a model without rules) and across a restart (the persistent
compilation cache: a second process compiles nothing for the shapes the first one saw)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from comfy_native import comfyui_session, save_diffusion_model, tiny_wan
from conftest import subprocess_env

WORKER = str(Path(__file__).with_name("bridge_worker.py"))
MESHES = ["dp=1,sp=2,tp=4", "dp=2,sp=1,tp=4", "dp=1,sp=8,tp=1", "dp=2,sp=2,tp=2"]


@pytest.fixture(scope="module")
def four_head_wan(tmp_path_factory):
    with comfyui_session():
        return save_diffusion_model(tiny_wan("t2v", dim=512), tmp_path_factory.mktemp("wan4") / "wan.safetensors",
                                    seed=3)


def _run(args, devices=8, **env):
    extra = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"} if devices > 1 else {}
    proc = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True, timeout=900,
                          env=subprocess_env(**extra, **env), cwd=str(Path(WORKER).parent))
    line = next((l for l in proc.stdout.splitlines() if l.startswith("BRIDGE ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line[len("BRIDGE "):])


def test_meshes_of_eight_devices_equal_native(four_head_wan):
    report = _run([four_head_wan, *MESHES, "auto"])
    assert report["devices"] == 8
    for mesh, result in report["meshes"].items():
        assert result["relative"] < 1e-4, mesh
        assert result["programs"] == 1 and result["rules"] == "Wan"
        tp = result["mesh"]["tp"]
        assert result["q_spec"][0] == "tp"  # q split by its output rows over tp (whole when tp is 1)
        assert result["q_shard_elements"] * tp == result["q_elements"]
    assert report["meshes"]["auto"]["mesh"] == {"dp": 1, "sp": 2, "tp": 4}  # 4 heads on tp, the rest on sp


def test_generic_placement_without_rules(four_head_wan):
    generic = _run([four_head_wan, "dp=1,sp=2,tp=4", "dp=2,sp=1,tp=4", "--generic"])
    for mesh, result in generic["meshes"].items():
        assert result["rules"] == "generic"
        assert result["relative"] < 1e-4, mesh
        assert result["q_shard_elements"] * 4 == result["q_elements"]  # a large matrix split over tp


def test_a_restarted_process_compiles_nothing(four_head_wan, tmp_path):
    cache = tmp_path / "xla_cache"
    first = _run([four_head_wan, "auto"], devices=1, TPU_VIDEO_CACHE_DIR=cache)
    again = _run([four_head_wan, "auto"], devices=1, TPU_VIDEO_CACHE_DIR=cache)
    assert first["meshes"]["auto"]["xla_compiles"] >= 1
    assert again["meshes"]["auto"]["xla_compiles"] == 0
    assert again["meshes"]["auto"]["relative"] < 1e-4
