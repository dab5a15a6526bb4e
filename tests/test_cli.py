"""The README's main job: `python -m tpu_runtime demo` writes a playable mp4 from a tiny random-weight model."""

import json
import subprocess
import sys

from conftest import subprocess_env

from tpu_runtime.tools.video import read_mp4


def test_demo_writes_playable_video(tmp_path):
    """As on a fresh clone: no JAX_PLATFORMS set, jax[tpu] installed, no TPU here. The run is quiet: no ERROR line
    (libtpu's start-up errors), no traceback, no accelerate suggestion, its own prompt not truncated."""
    out = tmp_path / "demo"
    env = subprocess_env(TPU_VIDEO_CACHE_DIR=tmp_path / "cache")
    env.pop("JAX_PLATFORMS")
    proc = subprocess.run([sys.executable, "-m", "tpu_runtime", "demo", "--output-dir", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout + proc.stderr
    for noise in (" ERROR ", "E0000", "Traceback", "accelerate", "truncated", "Writing model shards"):
        assert noise not in printed, printed[-3000:]
    assert "no TPU on this machine: JAX runs on cpu" in printed
    assert "RANDOM weights" in proc.stdout
    assert "Timing summary" in proc.stdout and "sample" in proc.stdout
    frames, meta = read_mp4(out / "output_video.mp4")
    assert frames.shape == (9, 64, 96, 3)
    for name in ("stage1_embeddings.safetensors", "stage2_latents.safetensors", "frames.safetensors"):
        assert (out / name).is_file()
    config = json.loads((out / "generation_config.json").read_text())
    assert config["timings"]["all"]["xla_compiles"] == {"encode": 1, "sample": 1, "decode": 1}
    assert (out / "tiny_random_cogvideox_2b" / "tiny_random_weights.txt").is_file()


def _exit_code(argv, capsys) -> tuple[int, str]:
    """The command line's exit status and what it wrote to stderr, run in this process (`python -m tpu_runtime`
    calls the same ``main``; the demos above start it as a process of its own)."""
    from tpu_runtime.tools.cli import main

    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_bad_input_exits_2_with_a_message(tiny_models, tmp_path, capsys):
    code, err = _exit_code(["generate", "--model", tiny_models["2b"], "--prompt", "a cat", "--height", "64",
                            "--width", "64", "--frames", "12", "--output-dir", tmp_path], capsys)
    assert code == 2
    assert "error: frames=12 must be 8*N+1 for CogVideoX-2b (nearest: 9 or 17; 49 is the native length)" in err
    assert "Traceback" not in err


def test_missing_model_exits_2(tmp_path, capsys):
    code, err = _exit_code(["generate", "--model", tmp_path / "none", "--prompt", "x", "--output-dir",
                            tmp_path / "o"], capsys)
    assert code == 2 and "does not exist" in err


def test_bench_writes_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "tpu_runtime", "bench", "--steps", "2", "--repeats", "1",
                           "--json", str(out)], env=subprocess_env(TPU_VIDEO_CACHE_DIR=tmp_path / "cache"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio (ours / diffusers)" in proc.stdout and "VAE GroupNorm" in proc.stdout
    result = json.loads(out.read_text())
    assert result["ours"]["xla_compiles_by_stage"] == {"encode": 1, "sample": 1, "decode": 1}
    # One program per stage and nothing else (no small programs per weight shape for the transfers).
    assert result["ours"]["xla_compiles_total"] == 3
    assert set(result["group_norm"]) == {"stock", "jnp_var"}
    # The decode against diffusers' eager VAE decode (9 frames: two latent batches, one program either way).
    assert result["vae_decode"]["loop"] == "batches" and result["vae_decode"]["diffusers_eager_s_median"] > 0
    assert result["diffusers_eager"]["runs_s"] and result["ratios"]["warm_ours_over_diffusers"] > 0
    assert result["ours"]["memory_analysis"]["decode"]["temp_size_in_bytes"] > 0


def test_bad_attention_settings_exit_2(tiny_models, tmp_path, capsys):
    code, err = _exit_code(["generate", "--model", tiny_models["2b"], "--prompt", "a cat", "--height", "64",
                            "--width", "64", "--frames", "9", "--block-kv", "300", "--output-dir", tmp_path], capsys)
    assert code == 2
    assert "block_kv=300 must be a multiple of block_kv_compute=256" in err
    code, err = _exit_code(["generate", "--model", tiny_models["2b"], "--prompt", "a cat", "--mesh", "dp=2,tp=4",
                            "--output-dir", tmp_path], capsys)
    assert code == 2 and "mesh dp=2,sp=1,tp=4 uses 8 devices but 1 are available" in err


def test_wan_demo_and_single_files_from_the_command_line(tiny_wan, tmp_path, capsys):
    """`demo --generation wan2.2-a14b`, then `generate` with ComfyUI's single files (both experts, scaled fp8)
    gives the same frames as `generate --model` on the folder, with Wan's options (the two in this process)."""
    import numpy as np

    from tpu_runtime.tools import stage_files
    from comfy_files import export_wan_files as export_comfy_files

    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "tpu_runtime", "demo", "--generation", "wan2.2-a14b",
                           "--steps", "2", "--output-dir", str(out)],
                          env=subprocess_env(TPU_VIDEO_CACHE_DIR=tmp_path / "cache"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RANDOM weights" in proc.stdout and "real Wan model" in proc.stdout
    frames, _ = read_mp4(out / "output_video.mp4")
    assert frames.shape == (9, 64, 96, 3)
    config = json.loads((out / "generation_config.json").read_text())
    assert config["family"] == "wan" and config["generation"] == "2.2-A14B" and config["fps"] == 16

    files = export_comfy_files(tiny_wan["2.2-A14B"], tmp_path / "files", "fp8_scaled")
    common = ["--prompt", "a cat", "--height", "64", "--width", "64", "--frames", "9", "--steps", "3",
              "--scheduler", "euler", "--shift", "6", "--guidance", "4", "--guidance-2", "2", "--dtype", "float32"]
    runs = {
        "files": ["--transformer", files["transformer"], "--transformer-2", files["transformer_2"],
                  "--text-encoder", files["text_encoder"], "--vae", files["vae"]],
        "folder": ["--model", tiny_wan["2.2-A14B"]],
    }
    for name, source in runs.items():
        code, err = _exit_code(["generate", *source, *common, "--output-dir", tmp_path / name], capsys)
        assert code == 0, err[-3000:]
    a, b = (stage_files.load_frames(tmp_path / name).numpy() for name in runs)
    assert np.abs(a - b).max() < 1e-5


def test_wan_bad_options_exit_2(tiny_wan, tmp_path, capsys):
    code, err = _exit_code(["generate", "--model", tiny_wan["2.1"], "--prompt", "a cat", "--height", "64", "--width",
                            "64", "--frames", "9", "--guidance-2", "3", "--output-dir", tmp_path], capsys)
    assert code == 2 and "guidance_2=3.0 applies only to two-expert" in err
    assert not (tmp_path / "stage1_embeddings.safetensors").exists(), "refused only after the encode stage ran"
    code, err = _exit_code(["generate", "--transformer", tmp_path / "x.safetensors", "--prompt", "a cat",
                            "--output-dir", tmp_path], capsys)
    assert code == 2 and "--text-encoder, --vae" in err
