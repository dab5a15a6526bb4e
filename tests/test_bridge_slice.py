"""TPU Diffusion Model and TPU VAE on a slice of two processes (4 CPU devices each): ComfyUI (the newest tree) runs
in the first process only, the second is `python -m tpu_runtime worker` (it never imports ComfyUI); every model call
of ComfyUI's sampler runs on the 8-device mesh across both (with the TPU node, and in the automatic mode), and so does
every chunk of a causal Wan VAE's decode, its caches kept on the devices of both processes between chunks; all equal
ComfyUI's native run."""

import subprocess
import sys
from pathlib import Path

from comfy_native import COMFYUI_TREES, NEWEST, comfyui_session, save_diffusion_model, tiny_wan
from test_multihost import _free_port, _report, _slice_env

JOB = str(Path(__file__).with_name("bridge_slice_job.py"))


def test_comfyuis_sampler_on_a_two_process_slice(tmp_path):
    with comfyui_session(NEWEST):
        model = save_diffusion_model(tiny_wan("t2v", dim=512), tmp_path / "wan.safetensors", seed=3)
    port = _free_port()
    worker_dir = tmp_path / "second_host"
    worker_dir.mkdir()
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([sys.executable, "-m", "tpu_runtime", "worker", "--process-id", "1"], cwd=worker_dir,
                              env=_slice_env(port, 1), stdout=log, stderr=subprocess.STDOUT)
    try:
        driver = subprocess.run([sys.executable, JOB, str(model), "dp=2,sp=1,tp=4", "dp=1,sp=2,tp=4"],
                                cwd=str(Path(JOB).parent), capture_output=True, text=True,
                                env={**_slice_env(port, 0), "TPU_VIDEO_COMFYUI": str(COMFYUI_TREES[NEWEST])},
                                timeout=900)
        report = _report(driver, tmp_path / "worker.log")
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
        log.close()
    worker_log = (tmp_path / "worker.log").read_text()
    assert report["processes"] == 2 and report["devices"] == 8
    for mesh, result in report["meshes"].items():
        assert result["relative"] < 1e-4, (mesh, result)
        # two samplings of 4 steps, cond and uncond one batch: 8 calls, one program (the second seed compiles nothing)
        assert result["programs"] == 1 and result["calls"] == 8 and result["finite"]
    # the automatic mode runs a loader's model on the slice as the node does
    assert report["automatic"]["relative"] < 1e-4 and report["automatic"]["calls"] == 4
    # the worker ran every model call of both meshes and of the automatic mode's
    runs = sum(r["calls"] for r in report["meshes"].values()) + report["automatic"]["calls"]
    assert worker_log.count("bridge WanModel run") == runs
    assert worker_log.count("bridge WanModel program") == 3  # one program a mesh (the automatic mode's: auto), once
    vae = report["vae"]  # 5 latent frames: several decoder calls, the caches of each kept on both processes
    assert vae["relative"] < 1e-4 and vae["calls"] >= 3, vae
    assert worker_log.count(f"bridge {vae['label']} run") == vae["calls"]
    assert worker_log.count(f"bridge {vae['label']} program") == vae["programs"] <= 3
