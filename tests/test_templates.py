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
    FOLDERS, OBSERVING_NODES, diffusion_builder, expected_parts, w8a8, file_writer, insert_tpu_nodes, missing_builders, node_types, observe, reduce_sizes,
    tiny_lora, ui_to_api, video_templates, widget_files, write_audio, write_image, write_video,
)
from tpu_runtime.bridge.tiny import UMT5_FILE_CONFIG

SIZE = {"width": 32, "height": 32, "length": 5, "steps": 2}
# --- other templates: sizes some models need larger than SIZE ---
# Wan 2.2 S2V packs its motion frames 4x smaller again (a 4x8x8 patch of the latents): 64x64 frames at least.
# LTX-2's empty latent takes 64x64 frames at least (two latent pixels a side: 32x in space); 9 frames are two latent
# frames (8x in time), so that image to video generates one besides the image's.
TEMPLATE_SIZES = {"video_wan2_2_14B_s2v": {"width": 64, "height": 64},
                  **{name: {"width": 64, "height": 64, "length": 9} for name in (
                      "video_ltx2_3_i2v", "video_ltx2_3_t2v", "video_ltx2_3_ia2v", "video_ltx2_3_flf2v",
                      "video_ltx2_i2v", "video_ltx2_i2v_distilled", "video_ltx2_t2v", "video_ltx2_t2v_distilled",
                      "video_ltx2_i2v_lora", "video_ltx2_5_i2v", "video_ltx2_5_t2v", "video_ltx2_5_flf2v")}}
# What CI runs by default (each template costs about 1-3 minutes here, mostly the full-size Wan 2.1 VAE): on 0.3.64
# image to video with CLIP vision, Wan 2.2's two experts (first-last frame), VACE with a LoRA, Wan 2.2 TI2V-5B (its
# VAE keeps its caches on the module in 0.3.64); on 0.33 (its rewritten Wan VAE, kitchen ops, new loaders) the three
# most used local video templates: MiniMax H3 image to video, LTX-2.3 image to video (video with sound, Gemma 3, two
# stages with a latent upscaler), Wan 2.2 14B image to video (its two experts and LoRAs inside a subgraph).
# TPU_VIDEO_TEMPLATES=all runs every template the tree can run (docs/templates.md), or names some (comma-separated).
CI_TEMPLATES = {
    "0.3.": ("image_to_video_wan", "video_wan2_2_5B_ti2v"),
    "0.33": ("video_minimax_h3_i2v", "video_ltx2_3_i2v", "video_wan2_2_14B_i2v"),
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
# ComfyUI builds some models at a fixed size whatever their file holds (MiniMax H3's text encoder and VAEs, the Wan 2.2
# VAE): this custom node, written into the test's copy of the tree, makes it build them at the tiny sizes the test's
# files have (tpu_runtime/bridge/tiny.py); what ComfyUI reads from the weights is left alone.
TINY_FIXED_SIZES = """
from tpu_runtime.bridge import tiny

tiny.shrink_wan22_vae()
try:
    import comfy.ldm.minimax.model  # noqa: F401 - ComfyUI 0.33 and later
except ImportError:
    pass
else:
    tiny.shrink_minimax_h3()
# --- other templates ---
try:
    import comfy.ldm.sam3.detector  # noqa: F401 - SAM 3 / 3.1 (ComfyUI 0.33 and later)
except ImportError:
    pass
else:
    tiny.shrink_sam3()
try:
    import comfy.ldm.seedvr.model  # noqa: F401 - SeedVR2
except ImportError:
    pass
else:
    tiny.shrink_seedvr2()
try:
    import comfy.audio_encoders.audio_encoders  # noqa: F401 - wav2vec2 (Wan 2.2 S2V, InfiniteTalk)
except ImportError:
    pass
else:
    tiny.shrink_wav2vec2()
    tiny.shrink_wan_s2v()
try:
    import comfy.ldm.hunyuan_video.vae_refiner  # noqa: F401 - HunyuanVideo 1.5
except ImportError:
    pass
else:
    tiny.shrink_hunyuan_video_15()
try:
    import comfy.text_encoders.lt  # noqa: F401 - LTX-2's Gemma 3 12B
except ImportError:
    pass
else:
    tiny.shrink_gemma3_12b()
try:
    import comfy.text_encoders.gemma4  # noqa: F401 - LTX-2.5's Gemma 4 12B and E2B
except ImportError:
    pass
else:
    tiny.shrink_gemma4()
NODE_CLASS_MAPPINGS = {}
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
        (folder / "custom_nodes" / "tiny_fixed_size_models.py").write_text(TINY_FIXED_SIZES)
        (folder / "custom_nodes" / "template_test_observers.py").write_text(OBSERVING_NODES)
        # CLIP ViT-H as Wan's image models read it: 1280 features; two layers (a file names layer 30, as ComfyUI's
        # detection wants)
        self.vision = clip_vision_h_config(folder, **{**CLIP_VISION_H_FILE_CONFIG, "hidden_size": 1280,
                                                      "num_attention_heads": 16, "num_hidden_layers": 2})
        (folder / "comfy" / "clip_vision_config_h.json").write_text(json.dumps(self.vision))
        self._other_templates_configs(folder)
        self.port = _free_port()
        self.log = folder / "server.log"
        env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_VIDEO_CACHE_DIR=str(folder / "xla_cache"))
        env.pop("TPU_VIDEO_AUTO", None)
        self.process = start_server(folder, os.environ.get("TPU_VIDEO_COMFY_PYTHON", _python()), self.port, env,
                                    self.log)
        wait_until_up(self.port, self.process, self.log)
        self.info = http(self.port, "/object_info", timeout=120)
        self._seed = 10

    def _other_templates_configs(self, folder: Path) -> None:
        """Configuration files ComfyUI builds fixed-size models from, their layers cut (ByT5's glyph encoder, SigLIP
        384: HunyuanVideo 1.5's); the widths the diffusion models read stay."""
        from tpu_runtime.bridge.tiny import BYT5_SMALL_GLYPH_TINY, SIGLIP_384_TINY, json_config

        self.byt5 = self.siglip = None
        for attribute, relative, overrides in (
                ("byt5", "comfy/text_encoders/byt5_config_small_glyph.json", BYT5_SMALL_GLYPH_TINY),
                ("siglip", "comfy/clip_vision_siglip_384.json", SIGLIP_384_TINY)):
            if (folder / relative).is_file():
                config = json_config(folder, relative, **overrides)
                (folder / relative).write_text(json.dumps(config))
                setattr(self, attribute, config)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)

    # --- files ------------------------------------------------------------------------------------------------
    def provide(self, prompt: dict) -> None:
        """Every model and input file ``prompt`` names, built once."""
        with comfyui_session(self.version):
            for input_name, names in sorted(widget_files(prompt).items()):
                for name in sorted(names):  # the same seeds in every run
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
            audio = node["inputs"].get("audio")
            if node["class_type"] == "LoadAudio" and isinstance(audio, str) and not (
                    self.folder / "input" / audio).exists():
                self._seed += 1
                write_audio(self.folder / "input" / audio, self._seed)

    def _model(self, input_name: str, name: str, prompt: dict) -> None:
        writer = file_writer(input_name, name)
        folder = FOLDERS["clip_vision" if "clip_vision" in name else input_name]
        path = self.folder / "models" / folder / name
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self._seed += 1
        if writer == "wan_lora":
            from safetensors.torch import save_file

            unet = next(v for v in widget_files(prompt)["unet_name"])
            save_file(tiny_lora(diffusion_builder(unet)(), seed=self._seed), str(path))
        else:
            writer(path, self._seed, self)

    def clip_vision_file(self, path: Path, seed: int) -> None:
        from safetensors.torch import save_file
        from tpu_runtime.bridge.tiny import tiny_clip_vision

        model = tiny_clip_vision(self.vision, seed=seed, dtype=torch.float16)
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
    """node -> what was saved of it: ("decode", latent streams, frames) of a VAE decode, ("audio", waveform, latent
    streams) of an audio decode."""
    from PIL import Image
    from safetensors.torch import load_file

    out = {}
    for node in sorted(folder.iterdir()):
        audio = list(node.glob("audio_*.audio"))
        latents = [load_file(str(p)) for p in node.glob("latent_*.latent")]
        if audio:
            out[node.name] = ("audio", load_file(str(audio[0]))["waveform"], latents[0] if latents else {})
            continue
        (latent,) = node.glob("latent_*.latent")
        frames = [np.asarray(Image.open(p)) for p in sorted(node.glob("frame_*.png"))]
        out[node.name] = ("decode", load_file(str(latent)), np.stack(frames))
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


# int8 files (MiniMax H3's DiT and video decoder) run W8A8 in ComfyUI and on the runtime: each layer's input is
# quantized per row, and an input that float rounding moves across a half step takes the other int8 value on one side
# (docs/native.md). Such flips are rare, but a tiny model amplifies each one: measured on MiniMax H3's tiny int8 DiT,
# 1 seed in 6 flips and moves the latents by 3e-3 (the same float file: 5e-7 on every seed; ComfyUI's own run moves as
# much when its conditioning is perturbed by 1e-6); MiniMax H3 T2V's template moves by 1e-2 with the int8 file and by
# 2.5e-7 with the same DiT as a float file under the same name. Templates that load int8 files are held to this
# bound instead (the float path's 1e-4: tests/test_bridge_minimax.py).
W8A8_TOLERANCE = 2e-2


def compare(native: dict, other: dict, what: str, tolerance: float = 1e-4) -> tuple[float, int]:
    """Every decode's latents (each stream of an audio-video latent) and every audio decode's waveform within
    ``tolerance`` relative, frames within 2 of 255; the worst latent or waveform difference and the worst frame
    difference."""
    assert native and set(other) == set(native), (what, sorted(native), sorted(other))
    worst_latent, worst_frame = 0.0, 0
    for node, saved in native.items():
        if saved[0] == "audio":
            assert set(other[node][2]) == set(saved[2]), (what, node)
            for key, latent in saved[2].items():  # the latent it decodes
                difference = relative(other[node][2][key], latent)
                assert other[node][2][key].shape == latent.shape and difference < tolerance, (what, node, key,
                                                                                               difference)
                worst_latent = max(worst_latent, difference)
            difference = relative(other[node][1], saved[1])
            assert other[node][1].shape == saved[1].shape and difference < tolerance, (what, node, difference)
            worst_latent = max(worst_latent, difference)
            continue
        _, streams, frames = saved
        _, other_streams, other_frames = other[node]
        assert set(other_streams) == set(streams) and other_frames.shape == frames.shape, (what, node)
        for key, latent in streams.items():
            assert other_streams[key].shape == latent.shape, (what, node, key)
            difference = relative(other_streams[key], latent)
            assert difference < tolerance, (what, node, key, difference)
            worst_latent = max(worst_latent, difference)
        frame = int(np.abs(other_frames.astype(int) - frames.astype(int)).max())
        assert frame <= 2, (what, node, frame)
        worst_frame = max(worst_frame, frame)
    return worst_latent, worst_frame


def assert_parts_ran(log: Path, start: int, parts: set[str], run: str) -> None:
    """Every one of ``parts`` has its "compiled <part> ..." or "loaded <part> ..." line in what the server logged
    from byte ``start`` on (this run's)."""
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    missing = sorted(p for p in parts if f"compiled {p} for" not in text and f"loaded {p} for" not in text)
    assert not missing, f"{run}: no compiled/loaded line for {missing}"


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
            size = {**SIZE, **TEMPLATE_SIZES.get(name, {})}
            prompt = reduce_sizes(json.loads(json.dumps(template)), server.info, **size)
            server.provide(prompt)
            runs = {}
            for run, automatic in (("native", "off"), ("nodes", "off"), ("auto", "all")):
                variant = observe(json.loads(json.dumps(prompt)), f"tpl/{name}/{run}")
                if run == "nodes":
                    variant = insert_tpu_nodes(variant, server.info)
                logged = server.log.stat().st_size
                runs[run] = server.run(variant, automatic, f"tpl/{name}/{run}")
                if run != "native":
                    assert_parts_ran(server.log, logged, expected_parts(prompt), run)
            tolerance = W8A8_TOLERANCE if w8a8(prompt) else 1e-4
            found[name] = [compare(runs["native"], runs["nodes"], "TPU nodes inserted", tolerance),
                           compare(runs["native"], runs["auto"], "automatic mode", tolerance)]
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
    assert "runs on the TPU runtime" in text and "automatic mode: " in text


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


@pytest.mark.comfy_versions("0.33")
def test_the_documented_share_is_the_measured_one(server):
    """docs/templates.md's "By use" table lists every local video template with the use count the Templates browser
    has for it, says rightly whether it loads on this tree (0.33: its node types exist), and the share it states is
    the one its results give (the templates whose runs with the TPU nodes and in the automatic mode are both equal);
    the README's first section states the same share."""
    from comfy_templates import documented_results, equal_share, template_usage

    rows, stated = documented_results((ROOT / "docs" / "templates.md").read_text())
    usage = template_usage()
    assert set(rows) == set(usage), sorted(set(usage) ^ set(rows))
    for name, (uses, loads, _, _) in rows.items():
        assert uses == usage[name], name
        missing = node_types(video_templates()[name]) - set(server.info)
        assert loads == ("yes" if not missing else "no"), (name, sorted(missing))
    assert stated is not None and abs(stated - equal_share(rows)) < 0.05, (stated, equal_share(rows))
    assert f"**{stated}% of the use**" in (ROOT / "README.md").read_text(), "the README's first section states the share"
