"""The README's main job: `python -m tpu_runtime demo` writes a playable mp4 from a tiny random-weight model."""

import json
import subprocess
import sys

from conftest import subprocess_env

from tpu_runtime.video import read_mp4


def test_demo_writes_playable_video(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "tpu_runtime", "demo", "--output-dir", str(out)],
                          env=subprocess_env(TPU_VIDEO_CACHE_DIR=tmp_path / "cache"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RANDOM weights" in proc.stdout
    assert "Timing summary" in proc.stdout and "sample" in proc.stdout
    frames, meta = read_mp4(out / "output_video.mp4")
    assert frames.shape == (9, 64, 96, 3)
    for name in ("stage1_embeddings.safetensors", "stage2_latents.safetensors", "frames.safetensors"):
        assert (out / name).is_file()
    config = json.loads((out / "generation_config.json").read_text())
    assert config["timings"]["all"]["xla_compiles"] == {"encode": 1, "sample": 1, "decode": 1}
    assert (out / "tiny_random_cogvideox_2b" / "tiny_random_weights.txt").is_file()


def test_bad_input_exits_2_with_a_message(tiny_models, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tpu_runtime", "generate", "--model", str(tiny_models["2b"]), "--prompt", "a cat",
         "--height", "64", "--width", "64", "--frames", "12", "--output-dir", str(tmp_path)],
        env=subprocess_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 2
    assert "error: frames=12 must be 8*N+1 for CogVideoX-2b (e.g. 9 or 49" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tpu_runtime", "generate", "--model", str(tmp_path / "none"), "--prompt", "x",
         "--output-dir", str(tmp_path / "o")],
        env=subprocess_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_bench_writes_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "tpu_runtime", "bench", "--steps", "2", "--repeats", "1",
                           "--json", str(out)], env=subprocess_env(TPU_VIDEO_CACHE_DIR=tmp_path / "cache"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio (ours / diffusers)" in proc.stdout and "VAE GroupNorm" in proc.stdout
    result = json.loads(out.read_text())
    assert result["ours"]["xla_compiles_by_stage"] == {"encode": 1, "sample": 1, "decode": 1}
    assert set(result["group_norm"]) == {"stock", "jnp_var"}
    assert result["diffusers_eager"]["runs_s"] and result["ratios"]["warm_ours_over_diffusers"] > 0
    assert result["ours"]["memory_analysis"]["decode"]["temp_size_in_bytes"] > 0


def test_bad_attention_settings_exit_2(tiny_models, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tpu_runtime", "generate", "--model", str(tiny_models["2b"]), "--prompt", "a cat",
         "--height", "64", "--width", "64", "--frames", "9", "--block-kv", "300", "--output-dir", str(tmp_path)],
        env=subprocess_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 2
    assert "block_kv=300 must be a multiple of block_kv_compute=256" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "tpu_runtime", "generate", "--model", str(tiny_models["2b"]), "--prompt", "a cat",
         "--mesh", "dp=2,tp=4", "--output-dir", str(tmp_path)],
        env=subprocess_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 2 and "mesh dp=2,sp=1,tp=4 uses 8 devices but 1 are available" in proc.stderr
