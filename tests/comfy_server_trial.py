"""Try the pack in a real ComfyUI server, as a new user would (run by hand; CI has no ComfyUI).

    python tests/comfy_server_trial.py --comfy COMFYUI_CHECKOUT --python COMFY_VENV_PYTHON [--port 8188]
        [--family cogvideox|wan|ltx2|both|all] [--slice]

It links this folder into COMFYUI_CHECKOUT/custom_nodes, builds tiny random-weight models where ComfyUI keeps
them (CogVideoX-2b as a diffusers folder in models/diffusers; Wan 2.1 as ComfyUI's single files in
models/diffusion_models, models/text_encoders and models/vae), starts `main.py --cpu` on 127.0.0.1, checks that
our nodes appear in /object_info, and per family turns the example workflow (sizes shrunk) into an API prompt,
runs it through POST /prompt until Save Video writes an mp4, checks that a bad input is reported on the node,
runs a long prompt, presses Cancel (POST /interrupt) after its first steps, checks that the next prompt still
succeeds and that /free releases our weights. Then the Wan 2.1 I2V workflow runs from ComfyUI's Load Image (a
picture placed in ComfyUI's input folder; tiny I2V single files and clip_vision in models/) to a saved mp4.
--family ltx2 runs LTX-2 with sound (a tiny LTX-2 diffusers folder, latent_upsampler/ inside, in models/diffusers):
the image-to-video workflow from Load Image and the two-stage text-to-video workflow (stage 1, Upsample, the
distilled LoRA from models/loras, stage 2)
each to an mp4 that must hold an audio stream, then the bad input, Cancel and /free checks. `both` is CogVideoX and
Wan as before, `all` adds LTX-2. Prints a line per check and exits non-zero on the first failure.

--slice makes it a two-process slice on this machine: the server is process 0 (TPU_VIDEO_MULTIHOST=1) and
`python -m tpu_runtime worker` process 1, 4 CPU devices each, so every prompt runs on one 8-device mesh across
both; at the end it checks that the worker ran the calls and stops when the server does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def http(port: int, path: str, payload: dict | None = None, timeout: float = 30):
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body else None


def ui_to_api(workflow: dict, object_info: dict, overrides: dict[str, dict]) -> dict:
    """ComfyUI's UI workflow format to the API prompt format, with widget values mapped by /object_info.
    ``overrides`` is keyed by node class (every node of it) or by node id (that node alone, applied last: two
    samplers of one workflow get different sizes)."""
    links = {link[0]: link for link in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        if node["type"] == "Note":
            continue
        info = object_info[node["type"]]
        inputs, values = {}, list(node.get("widgets_values", []))
        for section in ("required", "optional"):
            for name, spec in info["input"].get(section, {}).items():
                kind, opts = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
                is_widget = (isinstance(kind, list) or kind in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")) \
                    and not opts.get("forceInput")
                if is_widget and values:
                    inputs[name] = values.pop(0)
                    if name in ("seed", "noise_seed") or opts.get("control_after_generate"):
                        values.pop(0)
        for inp in node.get("inputs", []):
            if inp.get("link") is not None:
                _, src, src_slot, *_ = links[inp["link"]]
                inputs[inp["name"]] = [str(src), src_slot]
        inputs.update(overrides.get(node["type"], {}))
        inputs.update(overrides.get(str(node["id"]), {}))
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def start_server(comfy: Path, python: str, port: int, env: dict, log_path: Path,
                 extra_args: tuple = ()) -> subprocess.Popen:
    """``main.py --cpu`` of the ComfyUI checkout ``comfy`` on 127.0.0.1:``port`` (and ``extra_args``), its output in
    ``log_path``."""
    log = open(log_path, "w")
    return subprocess.Popen([python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), *extra_args],
                            cwd=comfy, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_until_up(port: int, server: subprocess.Popen, log_path: Path, timeout: float = 180) -> None:
    """Until the server answers (or has exited, or ``timeout`` seconds have passed: then raise with its log)."""
    end = time.time() + timeout
    while time.time() < end and server.poll() is None:
        try:
            http(port, "/system_stats")
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server did not start; its log ends:\n{log_path.read_text()[-3000:]}")


def wait_for(port: int, prompt_id: str, timeout: float) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        history = http(port, f"/history/{prompt_id}")
        if prompt_id in history:
            return history[prompt_id]
        time.sleep(1)
    raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout} s")


FAMILIES = {
    "cogvideox": {
        "workflow": "27 CogVideoX 2B text to video.json", "prefix": "TPUCogVideoX", "loader": "TPUCogVideoXLoader",
        "sampler": "TPUCogVideoXSampler", "model_label": "CogVideoX-2b-tiny",
        "load_marker": "loaded CogVideoX-2b-tiny/transformer",
        "nodes": ["TPUCogVideoXDecode", "TPUCogVideoXImageEncode", "TPUCogVideoXLoRA", "TPUCogVideoXLoader",
                  "TPUCogVideoXSampler", "TPUCogVideoXStepCache", "TPUCogVideoXTextEncode"],
        "small": {"TPUCogVideoXLoader": {"model": "CogVideoX-2b-tiny", "dtype": "float32"},
                  "TPUCogVideoXSampler": {"width": 96, "height": 64, "length": 9, "steps": 3}},
        "bad_frames": (10, "length=10 must be 8*N+1 for CogVideoX-2b"),
        "long": {"width": 720, "height": 480, "length": 49, "steps": 200},
    },
    "wan": {
        "workflow": "09 Wan 2.1 1.3B text to video.json", "prefix": "TPUWan", "loader": "TPUWanModelFilesLoader",
        "sampler": "TPUWanSampler", "model_label": "wan_transformer_fp16",
        "load_marker": "loaded transformer from wan_transformer_fp16.safetensors",
        "nodes": ["TPUWanDecode", "TPUWanImageEncode", "TPUWanLoRA", "TPUWanLoader", "TPUWanModelFilesLoader",
                  "TPUWanSampler", "TPUWanStepCache", "TPUWanTextEncode"],
        "small": {"TPUWanModelFilesLoader": {"diffusion_model": "wan_transformer_fp16.safetensors",
                                             "text_encoder": "umt5_fp16.safetensors",
                                             "vae": "wan_vae_bf16.safetensors", "dtype": "float32"},
                  "TPUWanSampler": {"width": 64, "height": 64, "length": 9, "steps": 3}},
        "bad_frames": (10, "length=10 must be 4*N+1 for Wan 2.1"),
        "long": {"width": 832, "height": 480, "length": 81, "steps": 200},
    },
}


LTX2 = {
    "i2v": "17 LTX-2 image to video with sound.json",
    "t2v": "16 LTX-2 two-stage text to video with sound.json", "model_label": "LTX-2-tiny",
    "nodes": ["TPULTX2Decode", "TPULTX2ImageEncode", "TPULTX2LoRA", "TPULTX2Loader", "TPULTX2ModelFilesLoader",
              "TPULTX2Sampler", "TPULTX2TextEncode", "TPULTX2Upsample"],
    "size": {"width": 96, "height": 64, "length": 17},
    # The two-stage workflow's samplers by node id: stage 1 at half size, stage 2 (stage2 sigmas, 3 steps) at twice it.
    "stage1": "3", "stage2": "5",
    # Stage 2's model comes through the LoRA node: a tiny LoRA in the original names under the distilled LoRA's name.
    "lora": "ltx-2-19b-distilled-lora-384.safetensors",
    "bad_frames": (20, "length=20 must be 8*N+1 for LTX-2"),
    "long": {"width": 768, "height": 512, "length": 121, "steps": 200},
}


def build_models(comfy: Path, python: str, families: list[str]) -> None:
    """Tiny random-weight models where ComfyUI keeps real ones."""
    models = comfy / "models"
    if "ltx2" in families:
        code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
                "from tpu_runtime.families.ltx2.tiny import build_tiny_ltx2;"
                "d = Path(sys.argv[2]) / 'diffusers' / 'LTX-2-tiny';"
                "(d / 'model_index.json').exists() or build_tiny_ltx2(d, '2.0', seed=0);"
                "from tpu_runtime.families.ltx2.tiny import build_tiny_lora;"
                "build_tiny_lora(d / 'transformer', Path(sys.argv[2]) / 'loras' / sys.argv[3])")
        subprocess.run([python, "-c", code, str(ROOT), str(models), LTX2["lora"]], check=True)
    code = (
        "import sys, shutil; from pathlib import Path; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests'];"
        "from tpu_runtime.families.cogvideox.tiny import build_tiny_cogvideox;"
        "from tpu_runtime.families.wan.tiny import build_tiny_wan;"
        "from comfy_files import export_wan_files as export_comfy_files;"
        "m = Path(sys.argv[2]); cog = m / 'diffusers' / 'CogVideoX-2b-tiny';"
        "cog.exists() or build_tiny_cogvideox(cog, '2b');"
        "wan = m / 'wan_tiny_build';"
        "files = export_comfy_files(build_tiny_wan(wan, '2.1'), m / 'wan_tiny_files', 'fp16');"
        "[shutil.move(str(files[k]), str(m / d / files[k].name)) for k, d in (('transformer', 'diffusion_models'),"
        " ('text_encoder', 'text_encoders'), ('vae', 'vae'))];"
        "files = export_comfy_files(build_tiny_wan(m / 'wan_i2v_tiny_build', '2.1', image='i2v'), m / 'wan_i2v_files',"
        " 'fp16');"
        "(m / 'clip_vision').mkdir(exist_ok=True);"
        "[shutil.move(str(files[k]), str(m / d / ('i2v_' + files[k].name))) for k, d in (('transformer',"
        " 'diffusion_models'), ('text_encoder', 'text_encoders'), ('vae', 'vae'), ('clip_vision', 'clip_vision'))]"
    )
    if {"cogvideox", "wan"} & set(families):
        subprocess.run([python, "-c", code, str(ROOT), str(models)], check=True)
    # A picture in ComfyUI's input folder, where Load Image lists it: not the video's aspect ratio.
    code = ("import sys, numpy as np; from PIL import Image; rng = np.random.default_rng(0);"
            "Image.fromarray((rng.random((48, 80, 3)) * 255).astype(np.uint8)).save(sys.argv[1])")
    (comfy / "input").mkdir(exist_ok=True)
    subprocess.run([python, "-c", code, str(comfy / "input" / "tpu_trial_first.png")], check=True)


def i2v_trial(port: int, comfy: Path, info: dict) -> None:
    """The Wan 2.1 I2V workflow from Load Image (a picture in ComfyUI's input folder) to a saved mp4, with the
    single files and clip_vision picked from ComfyUI's folders; then an image encoded at another size than the
    sampler's is reported on the sampler."""
    assert "tpu_trial_first.png" in info["LoadImage"]["input"]["required"]["image"][0]
    assert "i2v_clip_vision_fp16.safetensors" in info["TPUWanModelFilesLoader"]["input"]["optional"]["clip_vision"][0]
    workflow = json.loads((ROOT / "workflows" / "10 Wan 2.1 14B image to video 480p.json").read_text())
    size = {"width": 64, "height": 64, "length": 9}
    small = {"TPUWanModelFilesLoader": {"diffusion_model": "i2v_wan_transformer_fp16.safetensors",
                                        "text_encoder": "i2v_umt5_fp16.safetensors",
                                        "vae": "i2v_wan_vae_bf16.safetensors", "dtype": "float32",
                                        "clip_vision": "i2v_clip_vision_fp16.safetensors"},
             "LoadImage": {"image": "tpu_trial_first.png"}, "TPUWanImageEncode": size,
             "TPUWanSampler": {**size, "steps": 3}, "SaveVideo": {"filename_prefix": "video/tpu_trial_i2v"}}
    out_dir = comfy / "output" / "video"
    before = set(out_dir.glob("tpu_trial_i2v*.mp4")) if out_dir.exists() else set()
    result = wait_for(port, http(port, "/prompt", {"prompt": ui_to_api(workflow, info, small)})["prompt_id"], 600)
    assert result["status"]["status_str"] == "success", result["status"]
    new = set(out_dir.glob("tpu_trial_i2v*.mp4")) - before
    assert new, "no mp4 written"
    print("[i2v] Load Image -> Wan Image Encode -> sampler -> decode ran to", sorted(new)[0].name,
          f"({sorted(new)[0].stat().st_size} bytes)")
    bad = ui_to_api(workflow, info, {**small, "TPUWanSampler": {**size, "length": 13, "steps": 3}})
    result = wait_for(port, http(port, "/prompt", {"prompt": bad})["prompt_id"], 300)
    messages = json.dumps(result["status"].get("messages", []))
    assert result["status"]["status_str"] == "error" and "the image was encoded for 64x64x9" in messages, messages
    print("[i2v] a sampler set to another size than the image encoding's is reported on the sampler:",
          "the image was encoded for 64x64x9")


def run_to_mp4(port: int, comfy: Path, prompt: dict, prefix: str, timeout: float = 900) -> Path:
    """Queue ``prompt`` (its SaveVideo writes video/``prefix``*), wait for success and return the new mp4."""
    out_dir = comfy / "output" / "video"
    before = set(out_dir.glob(f"{prefix}*.mp4")) if out_dir.exists() else set()
    result = wait_for(port, http(port, "/prompt", {"prompt": prompt})["prompt_id"], timeout)
    assert result["status"]["status_str"] == "success", result["status"]
    new = set(out_dir.glob(f"{prefix}*.mp4")) - before
    assert new, "no mp4 written"
    return sorted(new)[0]


def mp4_streams(path: Path) -> dict:
    """The mp4's frames and audio codec, as read back by the pack's own reader (imageio-ffmpeg)."""
    sys.path.insert(0, str(ROOT))
    from tpu_runtime.tools.video import read_mp4

    frames, meta = read_mp4(path)
    return {"frames": frames.shape, "audio_codec": meta.get("audio_codec"), "fps": meta.get("fps")}


def ltx2_trial(port: int, comfy: Path, info: dict) -> None:
    """LTX-2 with sound: image to video from Load Image, two-stage text to video (stage 1 → Upsample → stage 2),
    each to an mp4 with an audio stream; a bad frame count on the sampler; Cancel; /free."""
    f = LTX2
    ours = sorted(k for k in info if k.startswith("TPULTX2"))
    assert ours == f["nodes"], ours
    print("[ltx2] nodes in /object_info:", ours)
    assert f["model_label"] in info["TPULTX2Loader"]["input"]["required"]["model"][0], \
        info["TPULTX2Loader"]["input"]["required"]["model"]
    print("[ltx2] the loader lists", f["model_label"], "from models/diffusers")
    size = f["size"]
    loader = {"TPULTX2Loader": {"model": f["model_label"], "dtype": "float32"}}

    i2v = json.loads((ROOT / "workflows" / f["i2v"]).read_text())
    small = {**loader, "LoadImage": {"image": "tpu_trial_first.png"}, "TPULTX2ImageEncode": size,
             "TPULTX2Sampler": {**size, "steps": 3}, "SaveVideo": {"filename_prefix": "video/tpu_trial_ltx2_i2v"}}
    started = time.time()
    mp4 = run_to_mp4(port, comfy, ui_to_api(i2v, info, small), "tpu_trial_ltx2_i2v")
    streams = mp4_streams(mp4)
    assert streams["audio_codec"], streams
    print(f"[ltx2] i2v: Load Image -> Image Encode -> sampler -> decode -> Create Video ran to {mp4.name} "
          f"({mp4.stat().st_size} bytes, {time.time() - started:.0f} s): frames {streams['frames']}, "
          f"audio {streams['audio_codec']}")

    t2v = json.loads((ROOT / "workflows" / f["t2v"]).read_text())
    two = {**loader, f["stage1"]: {**size, "steps": 3},
           f["stage2"]: {"width": 2 * size["width"], "height": 2 * size["height"], "length": size["length"]},
           "SaveVideo": {"filename_prefix": "video/tpu_trial_ltx2_t2v"}}
    assert f["lora"] in info["TPULTX2LoRA"]["input"]["required"]["lora_name"][0], "the LoRA is not listed"
    prompt = ui_to_api(t2v, info, two)
    assert prompt[f["stage2"]]["inputs"]["sigmas"] == "stage2" and prompt[f["stage2"]]["inputs"]["steps"] == 3
    lora = next(k for k, v in prompt.items() if v["class_type"] == "TPULTX2LoRA")
    assert prompt[f["stage2"]]["inputs"]["model"] == [lora, 0] and prompt[lora]["inputs"]["lora_name"] == f["lora"]
    started = time.time()
    mp4 = run_to_mp4(port, comfy, prompt, "tpu_trial_ltx2_t2v")
    streams = mp4_streams(mp4)
    assert streams["audio_codec"], streams
    assert streams["frames"][1:3] == (2 * size["height"], 2 * size["width"]), streams
    print(f"[ltx2] two-stage t2v: stage 1 {size['width']}x{size['height']} -> Upsample -> distilled LoRA -> stage 2 "
          f"{2 * size['width']}x{2 * size['height']} (stage2 sigmas, 3 steps) ran to {mp4.name} "
          f"({mp4.stat().st_size} bytes, {time.time() - started:.0f} s): frames {streams['frames']}, "
          f"audio {streams['audio_codec']}")

    frames, message = f["bad_frames"]
    bad = ui_to_api(t2v, info, {**two, f["stage1"]: {**two[f["stage1"]], "length": frames}})
    result = wait_for(port, http(port, "/prompt", {"prompt": bad})["prompt_id"], 120)
    error = next(m[1] for m in result["status"]["messages"] if m[0] == "execution_error")
    assert error["node_type"] == "TPULTX2Sampler" and error["node_id"] == f["stage1"], error
    assert error["exception_message"].startswith(message), error
    print(f"[ltx2] bad input shown on the node: {error['exception_type'].split('.')[-1]}: "
          f"{error['exception_message'].strip()}")

    long_prompt = ui_to_api(t2v, info, {**two, f["stage1"]: {**f["long"], "seed": 7}})
    pid = http(port, "/prompt", {"prompt": long_prompt})["prompt_id"]
    time.sleep(25)
    started = time.time()
    http(port, "/interrupt", {})
    result = wait_for(port, pid, 300)
    messages = [m[0] for m in result["status"].get("messages", [])]
    assert "execution_interrupted" in messages, result["status"]
    print(f"[ltx2] Cancel stopped the 200-step prompt within {time.time() - started:.1f} s:",
          result["status"]["status_str"], messages)
    steps_done = [line for line in (comfy / "trial_server.log").read_text().splitlines() if "interrupted" in line]
    print("  log:", steps_done[-1].strip() if steps_done else "(no interrupt line)")
    again = ui_to_api(t2v, info, {**two, f["stage1"]: {**two[f["stage1"]], "seed": 3}})
    mp4 = run_to_mp4(port, comfy, again, "tpu_trial_ltx2_t2v")
    print("[ltx2] next prompt after Cancel succeeded:", mp4.name)
    marker = f"loaded {f['model_label']}/transformer"
    loads_before = (comfy / "trial_server.log").read_text().count(marker)
    http(port, "/free", {"unload_models": True, "free_memory": True})
    time.sleep(3)
    again = ui_to_api(t2v, info, {**two, f["stage1"]: {**two[f["stage1"]], "seed": 5}})
    run_to_mp4(port, comfy, again, "tpu_trial_ltx2_t2v")
    loads_after = (comfy / "trial_server.log").read_text().count(marker)
    assert loads_after == loads_before + 1, (loads_before, loads_after)
    print("[ltx2] /free released our weights: the next prompt reloaded them and succeeded")


def trial(family: str, port: int, comfy: Path, info: dict) -> None:
    f = FAMILIES[family]
    ours = sorted(k for k in info if k.startswith(f["prefix"]))
    assert ours == f["nodes"], ours
    print(f"[{family}] nodes in /object_info:", ours)
    workflow = json.loads((ROOT / "workflows" / f["workflow"]).read_text())
    small = {**f["small"], "SaveVideo": {"filename_prefix": f"video/tpu_trial_{family}"}}
    sampler = f["sampler"]
    prompt = ui_to_api(workflow, info, small)
    out_dir = comfy / "output" / "video"
    before = set(out_dir.glob(f"tpu_trial_{family}*.mp4")) if out_dir.exists() else set()
    result = wait_for(port, http(port, "/prompt", {"prompt": prompt})["prompt_id"], 600)
    assert result["status"]["status_str"] == "success", result["status"]
    new = set(out_dir.glob(f"tpu_trial_{family}*.mp4")) - before
    assert new, "no mp4 written"
    print(f"[{family}] workflow ran to", sorted(new)[0].name, f"({sorted(new)[0].stat().st_size} bytes)")

    frames, message = f["bad_frames"]
    bad = ui_to_api(workflow, info, {**small, sampler: {**small[sampler], "length": frames}})
    result = wait_for(port, http(port, "/prompt", {"prompt": bad})["prompt_id"], 120)
    error = next(m[1] for m in result["status"]["messages"] if m[0] == "execution_error")
    assert error["node_type"] == sampler, error
    assert error["exception_message"].startswith(message), error
    print(f"[{family}] bad input shown on the node: {error['exception_type'].split('.')[-1]}: "
          f"{error['exception_message'].strip()}")

    # The native size on the tiny model: seconds a step on 2 CPU cores, 200 steps.
    long_prompt = ui_to_api(workflow, info, {**small, sampler: {**f["long"], "seed": 7}})
    pid = http(port, "/prompt", {"prompt": long_prompt})["prompt_id"]
    time.sleep(25)
    started = time.time()
    http(port, "/interrupt", {})
    result = wait_for(port, pid, 300)
    messages = [m[0] for m in result["status"].get("messages", [])]
    assert "execution_interrupted" in messages, result["status"]
    print(f"[{family}] Cancel stopped the 200-step prompt within {time.time() - started:.1f} s:",
          result["status"]["status_str"], messages)
    steps_done = [line for line in (comfy / "trial_server.log").read_text().splitlines() if "interrupted" in line]
    print("  log:", steps_done[-1].strip() if steps_done else "(no interrupt line)")
    again = ui_to_api(workflow, info, {**small, sampler: {**small[sampler], "seed": 3}})
    result = wait_for(port, http(port, "/prompt", {"prompt": again})["prompt_id"], 600)
    assert result["status"]["status_str"] == "success", result["status"]
    print(f"[{family}] next prompt after Cancel succeeded")
    marker = f["load_marker"]  # the server log's line for a transformer read from its file
    loads_before = (comfy / "trial_server.log").read_text().count(marker)
    http(port, "/free", {"unload_models": True, "free_memory": True})
    time.sleep(3)
    # "Unload models" must have dropped our device copy: the next prompt loads the transformer again.
    again = ui_to_api(workflow, info, {**small, sampler: {**small[sampler], "seed": 5}})
    result = wait_for(port, http(port, "/prompt", {"prompt": again})["prompt_id"], 600)
    assert result["status"]["status_str"] == "success", result["status"]
    loads_after = (comfy / "trial_server.log").read_text().count(marker)
    assert loads_after == loads_before + 1, (loads_before, loads_after)
    print(f"[{family}] /free released our weights: the next prompt reloaded them and succeeded")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfy", required=True, type=Path)
    ap.add_argument("--python", required=True)
    ap.add_argument("--port", type=int, default=8188)
    ap.add_argument("--family", choices=["cogvideox", "wan", "ltx2", "both", "all"], default="both",
                    help="both: CogVideoX and Wan; all: those and LTX-2")
    ap.add_argument("--slice", action="store_true", help="the server plus one worker process (see above)")
    args = ap.parse_args()
    comfy, port = args.comfy.resolve(), args.port
    families = {"both": ["cogvideox", "wan"], "all": ["cogvideox", "wan", "ltx2"]}.get(args.family, [args.family])

    link = comfy / "custom_nodes" / "tpu-video-nodes"
    if not link.exists():
        link.parent.mkdir(exist_ok=True)  # a checkout without custom_nodes/ (a release archive) gets one
        link.symlink_to(ROOT)
    build_models(comfy, args.python, families)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    worker = None
    if args.slice:
        env.update(TPU_VIDEO_MULTIHOST="1", TPU_VIDEO_COORDINATOR=f"127.0.0.1:{port + 1}", TPU_VIDEO_PROCESSES="2",
                   TPU_VIDEO_PROCESS_ID="0", JAX_NUM_CPU_DEVICES="4")
        worker_log = open(comfy / "trial_worker.log", "w")
        worker = subprocess.Popen([args.python, "-m", "tpu_runtime", "worker", "--process-id", "1"], cwd=ROOT,
                                  env=dict(env, TPU_VIDEO_PROCESS_ID="1"), stdout=worker_log,
                                  stderr=subprocess.STDOUT)
    server = start_server(comfy, args.python, port, env, comfy / "trial_server.log")
    try:
        wait_until_up(port, server, comfy / "trial_server.log")
        print("server started")
        text = (comfy / "trial_server.log").read_text()
        ours = [line for line in text.splitlines() if "tpu-video-nodes" in line]
        assert ours and not any("IMPORT FAILED" in line for line in ours), "pack failed to import:\n" + text
        print("pack imported:", ours[0].strip())
        info = http(port, "/object_info")
        if "cogvideox" in families or "wan" in families:
            assert "CogVideoX-2b-tiny" in info["TPUCogVideoXLoader"]["input"]["required"]["model"][0]
            files = info["TPUWanModelFilesLoader"]["input"]["required"]
            assert "wan_transformer_fp16.safetensors" in files["diffusion_model"][0], files["diffusion_model"]
            print("loaders list the tiny models from ComfyUI's model folders")
        for family in families:
            if family == "ltx2":
                ltx2_trial(port, comfy, info)
            else:
                trial(family, port, comfy, info)
            if family == "wan":
                i2v_trial(port, comfy, info)
        if worker is not None:
            server.terminate()
            server.wait(timeout=30)
            code = worker.wait(timeout=60)
            calls = (comfy / "trial_worker.log").read_text().count(" call ")
            assert calls > 0 and "in 2 processes" in (comfy / "trial_server.log").read_text()
            print(f"slice: the worker ran {calls} calls of the server on the 8-device mesh and stopped with it "
                  f"(exit {code})")
        return 0
    finally:
        for proc in (server, worker):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
