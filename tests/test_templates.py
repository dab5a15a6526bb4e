"""ComfyUI's official video templates (the October 2026 package) run unchanged in a real ComfyUI server on the runtime,
and equal ComfyUI's own run.

One server per ComfyUI tree (a copy of the tree with this checkout linked under custom_nodes/, tiny random-weight
models in its models/ folders under the file names the templates ask for, random pictures and clips under the input
names). Every video template of the package whose node types exist in the tree and whose model files the tiny
builders make (``comfy_templates.missing_builders``; docs/templates.md lists the others and why) runs three times
(``TPU_VIDEO_TEMPLATES=all``; by default those of ``CI_TEMPLATES`` for the tree, which cover the kinds of graph):

- natively (the automatic mode off in the settings store, as the settings dialog writes it);
- with TPU Diffusion Model, TPU Text Encoder, TPU VAE and TPU CLIP Vision inserted after every loader;
- unchanged with the automatic mode on (the setting switched to "all": the loaders run again, nothing cached from the
  native run is reused).

Sizes and steps are reduced (32x32, 5 frames, 2 steps); nodes and links stay as published. The latents each VAE
decode takes (SaveLatent) agree within 1e-4 relative and the decoded frames (SaveImage PNGs) within 2 of 255; the
server log names each part the automatic mode put on the runtime and each program compiled."""

import json
import os
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from comfy_native import COMFYUI_TREES, ROOT, comfyui_session, relative, versions_param
from comfy_server_trial import http, start_server, wait_for, wait_until_up
from comfy_templates import (
    diffusion_builder, insert_tpu_nodes, missing_builders, node_types, observe, reduce_sizes,
    tiny_lora, ui_to_api, video_templates, widget_files, write_image, write_video,
)
from tpu_runtime.bridge.tiny import UMT5_FILE_CONFIG

SIZE = {"width": 32, "height": 32, "length": 5, "steps": 2}
# What CI runs by default (each template costs about 1-2 minutes here, mostly the full-size Wan VAE): on 0.3.64 text to
# video, image to video with CLIP vision, Wan 2.2's two experts (first-last frame), VACE with a LoRA; on 0.33 (its
# rewritten Wan VAE, kitchen ops, new loaders) image to video with CLIP vision and VACE with a LoRA.
# TPU_VIDEO_TEMPLATES=all runs every template the tree can run (docs/templates.md), or names some (comma-separated).
CI_TEMPLATES = {
    "0.3.": ("text_to_video_wan", "image_to_video_wan", "video_wan2_2_14B_flf2v", "video_wan_vace_14B_t2v"),
    "0.33": ("image_to_video_wan", "video_wan_vace_14B_t2v"),
}
SETTING = "TPUVideo.AutomaticMode"
# ComfyUI 0.33 tells umT5-XXL from T5-XL and T5-base by its feed-forward width (10240; 0.3.64 reads the model width):
# a tiny umT5 keeps the XXL model width Wan's text embedding takes (4096) but not 10240 a layer. This custom node,
# written into the test's copy of the tree, makes that detection take the tiny width as XXL's; nothing else changes.
TINY_UMT5_DETECTION = f"""
import comfy.sd

_detect = comfy.sd.detect_te_model


def detect_te_model(sd):
    weight = sd.get("encoder.block.23.layer.1.DenseReluDense.wi_1.weight")
    if weight is not None and tuple(weight.shape) == ({UMT5_FILE_CONFIG['d_ff']}, 4096):
        return comfy.sd.TEModel.T5_XXL
    return _detect(sd)


comfy.sd.detect_te_model = detect_te_model
NODE_CLASS_MAPPINGS = {{}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A copy of one ComfyUI tree, started once, with the tiny models built as the templates ask for them."""

    def __init__(self, version: str, folder: Path):
        from tpu_runtime.bridge.tiny import (
            CLIP_VISION_H_FILE_CONFIG, UMT5_FILE_CONFIG, clip_vision_h_config, umt5_config,
        )

        self.version, self.folder = version, folder
        shutil.copytree(COMFYUI_TREES[version], folder, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        (folder / "custom_nodes").mkdir(exist_ok=True)  # 0.33's tree has none
        (folder / "custom_nodes" / "tpu-video-nodes").symlink_to(ROOT)
        self.umt5 = umt5_config(folder, **UMT5_FILE_CONFIG)
        (folder / "comfy" / "text_encoders" / "umt5_config_xxl.json").write_text(json.dumps(self.umt5))
        (folder / "custom_nodes" / "tiny_text_encoder_detection.py").write_text(TINY_UMT5_DETECTION)
        # CLIP ViT-H as Wan's image models read it: 1280 features; two layers (a file names layer 30, as ComfyUI's
        # detection wants)
        self.vision = clip_vision_h_config(folder, **{**CLIP_VISION_H_FILE_CONFIG, "hidden_size": 1280,
                                                      "num_attention_heads": 16, "num_hidden_layers": 2})
        (folder / "comfy" / "clip_vision_config_h.json").write_text(json.dumps(self.vision))
        self.port = _free_port()
        self.log = folder / "server.log"
        env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_VIDEO_CACHE_DIR=str(folder / "xla_cache"))
        env.pop("TPU_VIDEO_AUTO", None)
        self.process = start_server(folder, os.environ.get("TPU_VIDEO_COMFY_PYTHON", _python()), self.port, env,
                                    self.log)
        wait_until_up(self.port, self.process, self.log)
        self.info = http(self.port, "/object_info", timeout=120)
        self._seed = 10

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)

    # --- files ------------------------------------------------------------------------------------------------
    def provide(self, prompt: dict) -> None:
        """Every model and input file ``prompt`` names, built once."""
        with comfyui_session(self.version):
            for input_name, names in widget_files(prompt).items():
                for name in names:
                    self._model(input_name, name, prompt)
        for node in prompt.values():
            image = node["inputs"].get("image")
            if node["class_type"] == "LoadImage" and not (self.folder / "input" / image).exists():
                self._seed += 1
                write_image(self.folder / "input" / image, self._seed)
            video = node["inputs"].get("file")
            if node["class_type"] == "LoadVideo" and not (self.folder / "input" / video).exists():
                self._seed += 1
                write_video(self.folder / "input" / video, self._seed)

    def _model(self, input_name: str, name: str, prompt: dict) -> None:
        from tpu_runtime.bridge.tiny import save_diffusion_model, save_umt5, save_wan_vae

        if "clip_vision" in name:  # Load CLIP Vision's input is named clip_name too
            input_name = "clip_vision"
        folder = {"unet_name": "diffusion_models", "clip_name": "text_encoders", "vae_name": "vae",
                  "lora_name": "loras", "clip_vision": "clip_vision"}[input_name]
        path = self.folder / "models" / folder / name
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self._seed += 1
        if input_name == "unet_name":
            save_diffusion_model(diffusion_builder(name)(), path, seed=self._seed, dtype=torch.float16)
        elif input_name == "clip_name":
            save_umt5(path, self.umt5, seed=self._seed)
        elif input_name == "vae_name":
            save_wan_vae(path, seed=self._seed)
        elif input_name == "lora_name":
            from safetensors.torch import save_file

            unet = next(v for v in widget_files(prompt)["unet_name"])
            save_file(tiny_lora(diffusion_builder(unet)(), seed=self._seed), str(path))
        else:
            self._clip_vision(path)

    def _clip_vision(self, path: Path) -> None:
        from safetensors.torch import save_file
        from tpu_runtime.bridge.tiny import tiny_clip_vision

        model = tiny_clip_vision(self.vision, seed=self._seed, dtype=torch.float16)
        state = {k: v.contiguous() for k, v in model.get_sd().items()}
        state["vision_model.encoder.layers.30.layer_norm1.weight"] = torch.ones(1280, dtype=torch.float16)
        save_file(state, str(path))

    # --- runs -------------------------------------------------------------------------------------------------
    def run(self, prompt: dict, automatic: str, prefix: str) -> dict:
        import urllib.error

        http(self.port, f"/settings/{SETTING}", automatic)
        try:
            queued = http(self.port, "/prompt", {"prompt": prompt})
        except urllib.error.HTTPError as error:  # the server's validation: say which node and input
            raise AssertionError(f"prompt refused: {error.read().decode()[:3000]}") from None
        result = wait_for(self.port, queued["prompt_id"], 900)
        status = result["status"]
        errors = [m[1] for m in status.get("messages", []) if m[0] == "execution_error"]
        assert status["status_str"] == "success", (
            "; ".join(f"{e.get('node_type')}: {e.get('exception_type')}: {e.get('exception_message')}"[:1200]
                      for e in errors) or json.dumps(status)[-3000:])
        return _outputs(self.folder / "output" / prefix)


def _outputs(folder: Path) -> dict:
    from PIL import Image
    from safetensors.torch import load_file

    out = {}
    for node in sorted(folder.iterdir()):
        (latent,) = node.glob("latent_*.latent")
        frames = [np.asarray(Image.open(p)) for p in sorted(node.glob("frame_*.png"))]
        out[node.name] = (load_file(str(latent))["latent_tensor"], np.stack(frames))
    return out


def _python() -> str:
    import sys

    return sys.executable


@pytest.fixture(scope="module", params=versions_param())
def pack(request) -> str:
    """The ComfyUI tree's version (the harness's per-tree fixture is named ``pack``: ``comfy_versions`` reads it)."""
    return request.param


@pytest.fixture(scope="module")
def server(pack, tmp_path_factory):
    started = Server(pack, tmp_path_factory.mktemp("templates") / "comfyui")
    try:
        yield started
    finally:
        started.stop()


def runnable(server: Server) -> tuple[dict, dict]:
    """(name -> API prompt of every template the test runs, name -> why each other video template is left out)."""
    chosen, left = {}, {}
    default = next(names for prefix, names in CI_TEMPLATES.items() if server.version.startswith(prefix))
    wanted = os.environ.get("TPU_VIDEO_TEMPLATES", ",".join(default))
    only = set() if wanted == "all" else {n for n in wanted.split(",") if n}
    for name, workflow in sorted(video_templates().items()):
        if only and name not in only:
            continue
        missing = sorted(node_types(workflow) - set(server.info))
        if missing:
            left[name] = f"node types not in ComfyUI {server.version}: {', '.join(missing)}"
        else:
            prompt = ui_to_api(workflow, server.info)
            files = missing_builders(prompt)
            if files:
                left[name] = f"no tiny model for {', '.join(files)}"
            else:
                chosen[name] = prompt
    return chosen, left


def compare(native: dict, other: dict, what: str) -> tuple[float, int]:
    """Every decode's latents within 1e-4 relative and frames within 2 of 255; the worst of each."""
    assert native and set(other) == set(native), (what, sorted(native), sorted(other))
    worst_latent, worst_frame = 0.0, 0
    for node, (latent, frames) in native.items():
        other_latent, other_frames = other[node]
        assert other_latent.shape == latent.shape and other_frames.shape == frames.shape, (what, node)
        difference = relative(other_latent, latent)
        frame = int(np.abs(other_frames.astype(int) - frames.astype(int)).max())
        assert difference < 1e-4, (what, node, difference)
        assert frame <= 2, (what, node, frame)
        worst_latent, worst_frame = max(worst_latent, difference), max(worst_frame, frame)
    return worst_latent, worst_frame


@pytest.mark.timeout(3600)  # every template (TPU_VIDEO_TEMPLATES=all) takes longer than the suite's 15 minutes a test
def test_official_video_templates_equal_native_with_the_tpu_nodes_and_in_the_automatic_mode(server):
    chosen, left = runnable(server)
    print(f"\nComfyUI {server.version}: {len(chosen)} templates run; left out:")
    for name, why in left.items():
        print(f"  {name}: {why}")
    assert chosen, "no template runs"
    failures, timings, found = {}, {}, {}
    for name, template in chosen.items():
        started = time.time()
        try:
            prompt = reduce_sizes(json.loads(json.dumps(template)), server.info, **SIZE)
            server.provide(prompt)
            runs = {}
            for run, automatic in (("native", "off"), ("nodes", "off"), ("auto", "all")):
                variant = observe(json.loads(json.dumps(prompt)), f"tpl/{name}/{run}")
                if run == "nodes":
                    variant = insert_tpu_nodes(variant, server.info)
                runs[run] = server.run(variant, automatic, f"tpl/{name}/{run}")
            found[name] = [compare(runs["native"], runs["nodes"], "TPU nodes inserted"),
                           compare(runs["native"], runs["auto"], "automatic mode")]
        except Exception as error:  # noqa: BLE001 - every template is tried; the failures are listed together
            failures[name] = f"{type(error).__name__}: {str(error)[:1500]}"
        timings[name] = time.time() - started
        http(server.port, "/free", {"unload_models": True, "free_memory": True})
    for name, seconds in timings.items():
        worst = ", ".join(f"{run} {latent:.0e} / {frame}" for run, (latent, frame) in zip(("nodes", "auto"),
                                                                                        found.get(name, [])))
        print(f"  {name}: {seconds:.0f} s {'FAILED' if name in failures else 'equal'} "
              f"(worst latent difference / frame difference in 1/255: {worst})")
    assert not failures, json.dumps(failures, indent=1)
    text = server.log.read_text()
    assert "automatic mode: WanModel from UNETLoader runs on the TPU runtime" in text
    assert "compiled WanModel for inputs" in text or "loaded WanModel" in text


def test_subgraphs_are_flattened_as_the_frontend_does():
    """Every video template that wraps its graph in subgraphs (nested ones too) flattens to plain nodes: no instance
    left, every link between nodes that exist, every linked input's link there, the same node types the subgraphs
    hold, and an instance's output feeding what the instance fed (Wan 2.2 T2V's video reaches SaveVideo)."""
    from comfy_templates import flatten_subgraphs

    wrapped = {name: w for name, w in video_templates().items() if w.get("definitions", {}).get("subgraphs")}
    assert len(wrapped) > 20
    for name, workflow in wrapped.items():
        flat = flatten_subgraphs(workflow)
        ids = {n["id"] for n in flat["nodes"]}
        links = {link[0]: link for link in flat["links"]}
        subgraphs = {s["id"] for s in workflow["definitions"]["subgraphs"]}
        live = [n for n in flat["nodes"] if n.get("mode", 0) not in (2, 4)]
        assert not any(n["type"] in subgraphs for n in live), name
        assert all(link[1] in ids and link[3] in ids for link in flat["links"]), name
        assert all(i["link"] in links for n in flat["nodes"] for i in n.get("inputs", []) if i.get("link") is not None)
        assert {n["type"] for n in live} - {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"} == node_types(workflow)
    flat = flatten_subgraphs(wrapped["video_wan2_2_14B_t2v"])
    nodes = {n["id"]: n for n in flat["nodes"]}
    links = {link[0]: link for link in flat["links"]}
    (save,) = [n for n in flat["nodes"] if n["type"] == "SaveVideo"]
    feeding = nodes[links[save["inputs"][0]["link"]][1]]
    assert feeding["type"] == "CreateVideo" and ":" in str(feeding["id"])
