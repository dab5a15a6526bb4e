"""A native Wan workflow in a real ComfyUI server (the pinned snapshot, ``main.py --cpu``) with all three TPU nodes
(TPU Diffusion Model, TPU Text Encoder, TPU VAE) runs to saved frames and a saved animation, and equals the same
workflow without them.

The snapshot is copied to a temporary folder with this checkout linked into its custom_nodes/. Its model folders
get tiny random-weight files in ComfyUI's own layouts: a Wan 2.1 diffusion model, a umT5 text encoder (24 blocks
reading 4096 features, as ComfyUI's detection wants them, the rest reduced: the copy's umT5 configuration file says
so), and a Wan 2.1 VAE at the size ComfyUI builds it. The same prompt runs without and with the TPU nodes: the
sampled latents (SaveLatent, exact floats) agree within 1e-4 relative and the decoded frames (SaveImage PNGs,
8 bits) within one level; both also write an animated WebP (the video)."""

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from comfy_native import COMFYUI, ROOT, comfyui_session, relative
from comfy_server_trial import http, start_server, wait_for, wait_until_up

WIDTH, HEIGHT, LENGTH = 32, 32, 5  # 2 latent frames of 4x4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    """A copy of the snapshot with this checkout as a custom node and tiny models in its folders."""
    from tpu_runtime.bridge.tiny import (
        UMT5_FILE_CONFIG, save_diffusion_model, save_umt5, save_wan_vae, tiny_wan, umt5_config,
    )

    folder = tmp_path_factory.mktemp("server") / "comfyui"
    shutil.copytree(COMFYUI, folder, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    (folder / "custom_nodes").mkdir(exist_ok=True)
    (folder / "custom_nodes" / "tpu-video-nodes").symlink_to(ROOT)
    config = umt5_config(folder, **UMT5_FILE_CONFIG)
    (folder / "comfy" / "text_encoders" / "umt5_config_xxl.json").write_text(json.dumps(config, indent=2))
    models = folder / "models"
    with comfyui_session():
        save_diffusion_model(tiny_wan("t2v"), models / "diffusion_models" / "tiny_wan.safetensors", seed=1,
                             dtype=torch.float16)
        save_umt5(models / "text_encoders" / "tiny_umt5.safetensors", config, seed=2)
        save_wan_vae(models / "vae" / "wan_2.1_vae.safetensors", seed=3)
    return folder


def workflow(tpu: bool, prefix: str) -> dict:
    """The API prompt: Load Diffusion Model -> [TPU Diffusion Model] -> KSampler; Load CLIP (wan) -> [TPU Text
    Encoder] -> CLIP Text Encode x2; Load VAE -> [TPU VAE] -> VAE Decode -> Save Image and Save Animated WEBP; the
    latents saved too."""
    model, clip, vae = (["2", 0], ["4", 0], ["10", 0]) if tpu else (["1", 0], ["3", 0], ["9", 0])
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan.safetensors", "weight_dtype": "default"}},
        "3": {"class_type": "CLIPLoader", "inputs": {"clip_name": "tiny_umt5.safetensors", "type": "wan"}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox running through fresh snow", "clip": clip}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry, low quality", "clip": clip}},
        "7": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": WIDTH, "height": HEIGHT, "length": LENGTH, "batch_size": 1}},
        "8": {"class_type": "KSampler", "inputs": {
            "model": model, "seed": 7, "steps": 3, "cfg": 5.0, "sampler_name": "uni_pc", "scheduler": "simple",
            "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0], "denoise": 1.0}},
        "9": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_2.1_vae.safetensors"}},
        "11": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": vae}},
        "12": {"class_type": "SaveImage", "inputs": {"images": ["11", 0], "filename_prefix": f"{prefix}/frame"}},
        "13": {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["11", 0], "filename_prefix": f"{prefix}/video",
                                                             "fps": 16.0, "lossless": True, "quality": 100,
                                                             "method": "default"}},
        "14": {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": f"{prefix}/latent"}},
    }
    if tpu:
        prompt.update({
            "2": {"class_type": "TPUDiffusionModel", "inputs": {"model": ["1", 0]}},
            "4": {"class_type": "TPUTextEncoder", "inputs": {"clip": ["3", 0]}},
            "10": {"class_type": "TPUVAE", "inputs": {"vae": ["9", 0]}},
        })
    return prompt


def _outputs(folder: Path) -> dict:
    from PIL import Image
    from safetensors.torch import load_file

    frames = [np.asarray(Image.open(p)) for p in sorted(folder.glob("frame_*.png"))]
    (latent,) = folder.glob("latent_*.latent")
    (video,) = folder.glob("video_*.webp")
    with Image.open(video) as animation:
        video_frames = animation.n_frames
    return {"frames": np.stack(frames), "latent": load_file(str(latent))["latent_tensor"],
            "video_frames": video_frames}


def test_a_native_workflow_with_the_three_tpu_nodes_equals_it_without_them(comfy):
    port = _free_port()
    log = comfy / "server.log"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_VIDEO_CACHE_DIR=str(comfy / "xla_cache"))
    server = start_server(comfy, os.environ.get("TPU_VIDEO_COMFY_PYTHON", _python()), port, env, log)
    try:
        wait_until_up(port, server, log)
        info = http(port, "/object_info/TPUVAE")
        assert info["TPUVAE"]["display_name"] == "TPU VAE", info
        results = {}
        for name, tpu in (("native", False), ("tpu", True)):
            started = time.time()
            answer = http(port, "/prompt", {"prompt": workflow(tpu, f"bridge_{name}")})
            result = wait_for(port, answer["prompt_id"], 600)
            assert result["status"]["status_str"] == "success", json.dumps(result["status"])[-3000:]
            results[name] = _outputs(comfy / "output" / f"bridge_{name}")
            results[name]["seconds"] = time.time() - started
        text = log.read_text()
    finally:
        server.terminate()
        server.wait(timeout=30)
    native, tpu = results["native"], results["tpu"]
    assert native["latent"].shape == (1, 16, 2, 4, 4)
    assert relative(tpu["latent"], native["latent"]) < 1e-4
    assert native["frames"].shape == tpu["frames"].shape == (LENGTH, HEIGHT, WIDTH, 3)
    difference = np.abs(tpu["frames"].astype(int) - native["frames"].astype(int))
    assert difference.max() <= 1 and difference.mean() < 0.01, (difference.max(), difference.mean())
    assert native["frames"].std() > 1  # not a blank video
    assert native["video_frames"] == tpu["video_frames"] == LENGTH
    # each stage ran on the runtime: the text model, the diffusion model and the VAE decoder were placed and compiled
    for label in ("T5 (umt5xxl)", "WanModel", "WanVAE.decoder"):
        assert re.search(rf"{re.escape(label)}: \d+ weights placed", text), label
    assert text.count("preparing WanVAE.decoder") == 2  # two latent frames: the first-chunk and later programs
    print(f"native {native['seconds']:.0f} s, with the TPU nodes {tpu['seconds']:.0f} s (compiles included)")


def _python() -> str:
    import sys

    return sys.executable
