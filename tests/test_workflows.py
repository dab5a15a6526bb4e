"""Every example workflow fits the node definitions (types registered, widget values valid, links typed), and its
graph of our nodes runs headlessly on a tiny model of the same generation to frames and an mp4 (with its sound
track where the model makes one)."""

import json
import uuid

import numpy as np
import pytest
import torch
from conftest import I2V_SIZES, LTX2_SIZE, ROOT, SIZES
from workflow_files import uses_bridge_nodes

from tpu_runtime.families.ltx2.tiny import build_tiny_lora as build_ltx2_lora
from comfy_files import export_wan_files as export_comfy_files
from tpu_runtime.families.wan.tiny import build_tiny_lora
from tpu_runtime.tools.video import read_mp4, write_mp4, write_wav

# The families' workflows (the native bridge's, ComfyUI's own graphs with the TPU nodes, are
# test_native_workflows.py's)
WORKFLOWS = sorted(p for p in (ROOT / "workflows").glob("*.json") if not uses_bridge_nodes(p))
GENERATION = {"27 CogVideoX 2B text to video.json": "2b", "23 CogVideoX 5B text to video.json": "5b",
              "24 CogVideoX 1.5 5B text to video.json": "1.5",
              "09 Wan 2.1 1.3B text to video.json": "wan-2.1-1.3B",
              "08 Wan 2.1 14B text to video.json": "wan-2.1-14B",
              "01 Wan 2.2 14B text to video.json": "wan-2.2-A14B",
              "02 Wan 2.2 14B text to video in 4 steps.json": "wan-2.2-A14B",
              "05 Wan 2.2 5B text to video.json": "wan-2.2-TI2V-5B",
              "03 Wan 2.2 14B text to video with MagCache.json": "wan-2.2-A14B",
              "25 CogVideoX 5B image to video.json": "5b-I2V",
              "26 CogVideoX 1.5 5B image to video.json": "1.5-I2V",
              "10 Wan 2.1 14B image to video 480p.json": "wan-2.1-I2V-480P",
              "11 Wan 2.1 14B image to video 720p.json": "wan-2.1-I2V-720P",
              "12 Wan 2.1 14B first and last frame to video.json": "wan-2.1-FLF2V",
              "04 Wan 2.2 14B image to video.json": "wan-2.2-I2V-A14B",
              "06 Wan 2.2 5B image to video.json": "wan-2.2-TI2V-5B",
              "16 LTX-2 two-stage text to video with sound.json": "ltx-2",
              "17 LTX-2 image to video with sound.json": "ltx-2",
              "15 LTX-2 text to video with sound.json": "ltx-2"}
NATIVE = {"2b": (720, 480, 49), "5b": (720, 480, 49), "1.5": (1360, 768, 81), "wan-2.1-1.3B": (832, 480, 81),
          "wan-2.1-14B": (1280, 720, 81), "wan-2.2-A14B": (1280, 720, 81), "wan-2.2-TI2V-5B": (1280, 704, 121),
          "5b-I2V": (720, 480, 49), "1.5-I2V": (1360, 768, 81), "wan-2.1-I2V-480P": (832, 480, 81),
          "wan-2.1-I2V-720P": (1280, 720, 81), "wan-2.1-FLF2V": (1280, 720, 81), "wan-2.2-I2V-A14B": (1280, 720, 81),
          "ltx-2": (768, 512, 121)}
TINY_WAN = {"wan-2.1-1.3B": "2.1", "wan-2.1-14B": "2.1", "wan-2.2-A14B": "2.2-A14B", "wan-2.2-TI2V-5B": "2.2-TI2V-5B"}
# Image-to-video generations: the tiny model of the same kind (conftest's i2v_models) and its size.
TINY_I2V = {"5b-I2V": "cog-5b", "1.5-I2V": "cog-1.5", "wan-2.1-I2V-480P": "wan-i2v", "wan-2.1-I2V-720P": "wan-i2v",
            "wan-2.1-FLF2V": "wan-flf2v", "wan-2.2-I2V-A14B": "wan-a14b"}
# LTX-2 (video with sound; text or image to video in one model): conftest's tiny_ltx2 of the same generation.
TINY_LTX2 = {"ltx-2": "2.0"}
# Workflows that start from a picture with a model that also makes video from text alone.
IMAGE_WORKFLOWS = ("06 Wan 2.2 5B image to video.json", "17 LTX-2 image to video with sound.json")
IMAGE_ENCODERS = ("TPUCogVideoXImageEncode", "TPUWanImageEncode", "TPULTX2ImageEncode")
STEP_CACHES = ("TPUCogVideoXStepCache", "TPUWanStepCache")
SAMPLERS = ("TPUCogVideoXSampler", "TPUWanSampler", "TPULTX2Sampler")
UPSAMPLERS = ("TPULTX2Upsample",)
DECODERS = ("TPUCogVideoXDecode", "TPUWanDecode", "TPULTX2Decode")
# Sigma schedules of a fixed number of steps (kept in headless runs).
FIXED_SIGMAS = ("distilled", "stage2")

# ComfyUI core nodes the workflows use, as ComfyUI (comfy_extras/nodes_video.py, nodes.py) defines them.
CORE_NODES = {
    "CreateVideo": {"required": {"images": ("IMAGE",), "fps": ("FLOAT", {"min": 1.0, "max": 120.0})},
                    "optional": {"audio": ("AUDIO",)}, "outputs": ("VIDEO",)},
    "SaveVideo": {"required": {"video": ("VIDEO",), "filename_prefix": ("STRING", {}),
                               "format": (["auto", "mp4"],), "codec": (["auto", "h264"],)},
                  "optional": {}, "outputs": ()},
    "Note": {"required": {"text": ("STRING", {})}, "optional": {}, "outputs": ()},
    "PrimitiveFloat": {"required": {"value": ("FLOAT", {})}, "optional": {}, "outputs": ("FLOAT",)},
    "LoadImage": {"required": {"image": (["example.png"], {"image_upload": True})}, "optional": {},
                  "outputs": ("IMAGE", "MASK")},
}
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
# Lists of the user's downloads: any name is valid.
DYNAMIC_COMBOS = {("TPUCogVideoXLoader", "model"), ("TPUWanLoader", "model"), ("TPUWanLoRA", "lora_name"),
                  ("TPUCogVideoXLoRA", "lora_name"), ("TPULTX2Loader", "model"), ("TPULTX2LoRA", "lora_name"),
                  ("LoadImage", "image"),
                  *(("TPUWanModelFilesLoader", n)
                    for n in ("diffusion_model", "diffusion_model_2", "text_encoder", "vae", "clip_vision"))}


@pytest.fixture(scope="module")
def node_defs():
    from nodes import NODE_CLASS_MAPPINGS

    defs = {name: {**cls.INPUT_TYPES(), "outputs": cls.RETURN_TYPES} for name, cls in NODE_CLASS_MAPPINGS.items()}
    return {**defs, **CORE_NODES}


def _is_widget(spec) -> bool:
    forced = len(spec) > 1 and (spec[1] or {}).get("forceInput")
    return (isinstance(spec[0], list) or spec[0] in WIDGET_TYPES) and not forced


def _widget_inputs(definition):
    for section in ("required", "optional"):
        for name, spec in definition.get(section, {}).items():
            if _is_widget(spec):
                yield name, spec


def widget_values(node, definition) -> dict:
    """Map a UI node's widgets_values to input names, in ComfyUI's order (seed's control value and the image
    upload button's value skipped)."""
    values, out = list(node["widgets_values"]), {}
    for name, spec in _widget_inputs(definition):
        out[name] = values.pop(0)
        if len(spec) > 1 and spec[1].get("control_after_generate"):
            assert values.pop(0) in ("fixed", "increment", "decrement", "randomize")
        if len(spec) > 1 and spec[1].get("image_upload"):
            assert values.pop(0) == "image"
    assert not values, f"{node['type']}: {len(values)} widget values left over"
    return out


def test_there_is_one_workflow_per_generation():
    assert {p.name for p in WORKFLOWS} == set(GENERATION)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_fits_node_definitions(path, node_defs):
    wf = json.loads(path.read_text())
    assert wf["version"] == 0.4
    uuid.UUID(wf["id"])  # ComfyUI's frontend rejects a workflow whose id is not a UUID
    nodes = {n["id"]: n for n in wf["nodes"]}
    for node in wf["nodes"]:
        assert node["type"] in node_defs, f"unregistered node type {node['type']}"
        definition = node_defs[node["type"]]
        for name, value in widget_values(node, definition).items():
            spec = dict(_widget_inputs(definition))[name]
            kind, opts = spec[0], (spec[1] if len(spec) > 1 else {})
            if isinstance(kind, list):
                assert (node["type"], name) in DYNAMIC_COMBOS or value in kind, (node["type"], name, value)
            elif kind == "INT":
                assert isinstance(value, int) and opts.get("min", value) <= value <= opts.get("max", value)
            elif kind == "FLOAT":
                assert isinstance(value, (int, float)) and opts.get("min", value) <= value <= opts.get("max", value)
            elif kind == "STRING":
                assert isinstance(value, str)
            elif kind == "BOOLEAN":
                assert isinstance(value, bool)
    assert any(n["type"] == "Note" and "models/diffusers" in n["widgets_values"][0] for n in wf["nodes"])
    for link_id, src, src_slot, dst, dst_slot, link_type in wf["links"]:
        out_type = node_defs[nodes[src]["type"]]["outputs"][src_slot]
        target = nodes[dst]["inputs"][dst_slot]
        assert target["link"] == link_id and link_id in nodes[src]["outputs"][src_slot]["links"]
        definition = node_defs[nodes[dst]["type"]]
        in_spec = {**definition["required"], **definition.get("optional", {})}[target["name"]]
        assert out_type == link_type == in_spec[0] == target["type"], (link_id, out_type, link_type, in_spec)
    gen = GENERATION[path.name]
    samplers = [n for n in wf["nodes"] if n["type"] in SAMPLERS]
    values = {n["id"]: widget_values(n, node_defs[n["type"]]) for n in samplers}
    for sampler in samplers:  # a refining sampler: the Upsample node's latents, at twice its first stage's size
        refined = _source(wf, sampler, "samples")
        if refined is None:
            continue
        upsample, _ = refined
        assert upsample["type"] in UPSAMPLERS, upsample["type"]
        first, _ = _source(wf, upsample, "samples")
        before, after = values[first["id"]], values[sampler["id"]]
        assert (after["width"], after["height"]) == (2 * before["width"], 2 * before["height"])
        assert after["length"] == before["length"] and after["frame_rate"] == before["frame_rate"]
        assert (after["sigmas"], after["steps"]) == ("stage2", 3) and before["sigmas"] == "default"
    decoders = [n for n in wf["nodes"] if n["type"] in DECODERS]
    assert len(decoders) == 1
    final, _ = _source(wf, decoders[0], "samples")  # the sampler the decoder reads makes the native size
    assert final["type"] in SAMPLERS
    size = values[final["id"]]
    assert (size["width"], size["height"], size["length"]) == NATIVE[gen]
    create = next(n for n in wf["nodes"] if n["type"] == "CreateVideo")
    audio_out = [slot for slot, kind in enumerate(node_defs[decoders[0]["type"]]["outputs"]) if kind == "AUDIO"]
    if audio_out:  # the model's sound track goes into the video
        assert _source(wf, create, "audio") == (decoders[0], audio_out[0])
    else:
        assert _source(wf, create, "audio") is None
    encoders = [n for n in wf["nodes"] if n["type"] in IMAGE_ENCODERS]
    assert len(encoders) == (gen in TINY_I2V or path.name in IMAGE_WORKFLOWS)
    for encoder in encoders:  # encoded at the sampler's size, from ComfyUI's Load Image
        size = widget_values(encoder, node_defs[encoder["type"]])
        assert (size["width"], size["height"], size["length"]) == NATIVE[gen]
        image_link = encoder["inputs"][1]["link"]
        assert next(nodes[src]["type"] for lid, src, *_ in wf["links"] if lid == image_link) == "LoadImage"


def _targets(wf, node, slot):
    """The (node, input name) pairs ``node``'s output ``slot`` is linked into."""
    nodes = {n["id"]: n for n in wf["nodes"]}
    for _, src, src_slot, dst, dst_slot, _ in wf["links"]:
        if src == node["id"] and src_slot == slot:
            yield nodes[dst], nodes[dst]["inputs"][dst_slot]["name"]


def _source(wf, node, input_name):
    """The (node, output slot) linked into ``node``'s input ``input_name``; None when nothing is."""
    link = next((i.get("link") for i in node["inputs"] if i["name"] == input_name), None)
    if link is None:
        return None
    _, src, src_slot, *_ = next(entry for entry in wf["links"] if entry[0] == link)
    return next(n for n in wf["nodes"] if n["id"] == src), src_slot


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_runs_headlessly_on_a_tiny_model(path, node_defs, images, request, tmp_path):
    """Execute the graph: our nodes for real (sizes shrunk, the tiny model swapped in), ComfyUI's Load Image,
    CreateVideo + SaveVideo stood in for (a test picture as ComfyUI's IMAGE; our mp4 writer with the fps, and the
    sound track muxed in when an AUDIO reaches CreateVideo). A two-stage workflow keeps its sizes' relation: the
    first sampler at the tiny size, the refining one at twice it."""
    from nodes import NODE_CLASS_MAPPINGS
    from PIL import Image

    wf = json.loads(path.read_text())
    gen = GENERATION[path.name]
    tiny_i2v = TINY_I2V.get(gen)
    tiny_ltx2 = TINY_LTX2.get(gen)
    if tiny_ltx2:
        height, width, frames = LTX2_SIZE
    else:
        height, width, frames = SIZES.get(gen) or I2V_SIZES.get(tiny_i2v, (64, 64, 9))
    # the smallest sampler of the workflow runs at the tiny size; the others at the same multiple of it
    smallest = min((widget_values(n, node_defs[n["type"]]) for n in wf["nodes"] if n["type"] in SAMPLERS),
                   key=lambda v: v["width"])
    load_images = sorted(n["id"] for n in wf["nodes"] if n["type"] == "LoadImage")
    incoming = {(dst, dst_slot): (src, src_slot) for _, src, src_slot, dst, dst_slot, _ in wf["links"]}
    results: dict[int, tuple] = {}
    sizes: dict[int, tuple] = {}  # sampler id -> (frames, height, width) it ran at
    for node in sorted(wf["nodes"], key=lambda n: n["order"]):
        kind = node["type"]
        if kind == "Note":
            continue
        kwargs = widget_values(node, node_defs[kind])
        for slot, inp in enumerate(node["inputs"]):
            if inp.get("link") is not None:
                src, src_slot = incoming[(node["id"], slot)]
                kwargs[inp["name"]] = results[src][src_slot]
        if kind == "TPUCogVideoXLoader":
            model = request.getfixturevalue("i2v_models")[tiny_i2v] if tiny_i2v else \
                request.getfixturevalue("tiny_models")[gen]
            kwargs.update(model_path=str(model), dtype="float32")
        if kind == "TPULTX2Loader":  # the tiny folder holds its latent_upsampler/: the upsampler input stays empty
            assert kwargs["upsampler"] == ""
            kwargs.update(model_path=str(request.getfixturevalue("tiny_ltx2")[tiny_ltx2]), dtype="float32")
        if kind == "TPUWanModelFilesLoader":  # the same kind of files, made from a tiny model, under these names
            tiny = request.getfixturevalue("i2v_models")[tiny_i2v] if tiny_i2v else \
                request.getfixturevalue("tiny_wan")[TINY_WAN[gen]]
            files = export_comfy_files(tiny, tmp_path / "files", "fp16")
            assert (kwargs["diffusion_model_2"] != "none") == ("transformer_2" in files)
            assert (kwargs["clip_vision"] != "none") == ("clip_vision" in files)
            kwargs.update(diffusion_model=str(files["transformer"]), text_encoder=str(files["text_encoder"]),
                          vae=str(files["vae"]), dtype="float32",
                          diffusion_model_2=str(files.get("transformer_2", "none")),
                          clip_vision=str(files.get("clip_vision", "none")))
        if kind == "PrimitiveFloat":  # ComfyUI's Float node: its value
            results[node["id"]] = (kwargs["value"],)
            continue
        if kind == "LoadImage":  # as ComfyUI's: [1, H, W, 3] float in 0..1, and a mask
            picture = images["first" if node["id"] == load_images[0] else "last"]
            pixels = torch.from_numpy(np.asarray(Image.open(picture).convert("RGB")).copy()).float()[None] / 255
            results[node["id"]] = (pixels, torch.zeros(pixels.shape[:3]))
            continue
        if kind in IMAGE_ENCODERS:
            kwargs.update(width=width, height=height, length=frames)
        if kind == "TPUWanLoRA":  # a LoRA of the same format for the tiny model, for the expert it names
            expert = "transformer_2" if kwargs["expert"] == "low noise" else "transformer"
            tiny = request.getfixturevalue("tiny_wan")[TINY_WAN[gen]]
            kwargs["lora_name"] = str(build_tiny_lora(tiny / expert, tmp_path / "loras" / kwargs["lora_name"], "comfy"))
        if kind == "TPULTX2LoRA":  # a LoRA in the original names (as Lightricks' distilled one) for the tiny model
            tiny = request.getfixturevalue("tiny_ltx2")[tiny_ltx2]
            kwargs["lora_name"] = str(build_ltx2_lora(tiny / "transformer", tmp_path / "loras" / kwargs["lora_name"]))
        if kind in STEP_CACHES:  # the tiny model has no published ratios: one a step, 8 steps
            assert kwargs["mag_ratios"] == "" or kwargs["method"] != "magcache"
            kwargs["mag_ratios"] = "1.0,0.99,0.99,0.99,0.99,0.99,0.99,0.99"
        if kind in SAMPLERS:
            cached = any(n["type"] in STEP_CACHES for n in wf["nodes"])
            own = widget_values(node, node_defs[kind])  # its size as saved (a linked input keeps its widget value)
            scale = own["width"] // smallest["width"]
            assert (own["width"], own["height"]) == (scale * smallest["width"], scale * smallest["height"])
            fixed = kwargs.get("sigmas") in FIXED_SIGMAS  # a schedule of its own number of steps: kept
            steps = kwargs["steps"] if fixed else min(kwargs["steps"], 8 if cached else 2)
            kwargs.update(width=scale * width, height=scale * height, length=frames, steps=steps)
            sizes[node["id"]] = (frames, scale * height, scale * width)
        if kind == "CreateVideo":
            results[node["id"]] = ((kwargs["images"], kwargs["fps"], kwargs.get("audio")),)
            continue
        if kind == "SaveVideo":
            video, fps, audio = kwargs["video"]
            wav = None
            if audio is not None:  # as ComfyUI's SaveVideo: the AUDIO's first (only) clip as the sound track
                wav = write_wav(audio["waveform"][0], tmp_path / "out.wav", audio["sample_rate"])
            write_mp4(video, tmp_path / "out.mp4", fps=int(fps), audio=wav)
            continue
        cls = NODE_CLASS_MAPPINGS[kind]
        results[node["id"]] = getattr(cls(), cls.FUNCTION)(**kwargs)
    decoder = next(n for n in wf["nodes"] if n["type"] in DECODERS)
    final = sizes[_source(wf, decoder, "samples")[0]["id"]]  # the size of the sampler the decoder reads
    decoded, meta = read_mp4(tmp_path / "out.mp4")
    assert decoded.shape == (*final, 3)
    image = results[decoder["id"]][0]
    assert isinstance(image, torch.Tensor) and image.shape == (*final, 3)
    create = next(n for n in wf["nodes"] if n["type"] == "CreateVideo")
    audio = results[create["id"]][0][2]
    if "AUDIO" in node_defs[decoder["type"]]["outputs"]:  # the sound reached CreateVideo and the mp4
        assert audio is results[decoder["id"]][1]
        waveform, rate = audio["waveform"], audio["sample_rate"]
        assert isinstance(waveform, torch.Tensor) and waveform.ndim == 3 and waveform.shape[0] == 1
        assert waveform.shape[1] in (1, 2) and waveform.shape[2] > 0 and waveform.abs().max() > 0
        assert isinstance(rate, int) and rate > 0
        assert meta.get("audio_codec") == "aac"
    else:
        assert audio is None and "audio_codec" not in meta
    for node in wf["nodes"]:  # a step cache's sampler skipped steps
        if node["type"] in STEP_CACHES:
            assert results[node["id"]][0].family.step_cache_report["skipped"] > 0
