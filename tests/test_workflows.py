"""Every example workflow fits the node definitions (types registered, widget values valid, links typed), and its
graph of our nodes runs headlessly on a tiny model of the same generation to frames and an mp4."""

import json
import uuid

import pytest
import torch
import numpy as np
from conftest import I2V_SIZES, ROOT, SIZES

from tpu_runtime.families.wan.tiny import build_tiny_lora, export_comfy_files
from tpu_runtime.tools.video import read_mp4, write_mp4

WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))
GENERATION = {"cogvideox_2b_t2v_tpu.json": "2b", "cogvideox_5b_t2v_tpu.json": "5b",
              "cogvideox1.5_5b_t2v_tpu.json": "1.5", "wan2.1_t2v_1.3B_tpu.json": "wan-2.1-1.3B",
              "wan2.1_t2v_14B_tpu.json": "wan-2.1-14B", "wan2.2_t2v_a14b_tpu.json": "wan-2.2-A14B",
              "wan2.2_t2v_a14b_lightx2v_4steps_tpu.json": "wan-2.2-A14B", "wan2.2_ti2v_5b_tpu.json": "wan-2.2-TI2V-5B",
              "wan2.2_t2v_a14b_magcache_tpu.json": "wan-2.2-A14B",
              "cogvideox_5b_i2v_tpu.json": "5b-I2V", "cogvideox1.5_5b_i2v_tpu.json": "1.5-I2V",
              "wan2.1_i2v_480p_14B_tpu.json": "wan-2.1-I2V-480P", "wan2.1_i2v_720p_14B_tpu.json": "wan-2.1-I2V-720P",
              "wan2.1_flf2v_720p_14B_tpu.json": "wan-2.1-FLF2V", "wan2.2_i2v_a14b_tpu.json": "wan-2.2-I2V-A14B",
              "wan2.2_ti2v_5b_i2v_tpu.json": "wan-2.2-TI2V-5B"}
NATIVE = {"2b": (720, 480, 49), "5b": (720, 480, 49), "1.5": (1360, 768, 81), "wan-2.1-1.3B": (832, 480, 81),
          "wan-2.1-14B": (1280, 720, 81), "wan-2.2-A14B": (1280, 720, 81), "wan-2.2-TI2V-5B": (1280, 704, 121),
          "5b-I2V": (720, 480, 49), "1.5-I2V": (1360, 768, 81), "wan-2.1-I2V-480P": (832, 480, 81),
          "wan-2.1-I2V-720P": (1280, 720, 81), "wan-2.1-FLF2V": (1280, 720, 81), "wan-2.2-I2V-A14B": (1280, 720, 81)}
TINY_WAN = {"wan-2.1-1.3B": "2.1", "wan-2.1-14B": "2.1", "wan-2.2-A14B": "2.2-A14B", "wan-2.2-TI2V-5B": "2.2-TI2V-5B"}
# Image-to-video generations: the tiny model of the same kind (conftest's i2v_models) and its size.
TINY_I2V = {"5b-I2V": "cog-5b", "1.5-I2V": "cog-1.5", "wan-2.1-I2V-480P": "wan-i2v", "wan-2.1-I2V-720P": "wan-i2v",
            "wan-2.1-FLF2V": "wan-flf2v", "wan-2.2-I2V-A14B": "wan-a14b"}
IMAGE_ENCODERS = ("TPUCogVideoXImageEncode", "TPUWanImageEncode")
STEP_CACHES = ("TPUCogVideoXStepCache", "TPUWanStepCache")
SAMPLERS = ("TPUCogVideoXSampler", "TPUWanSampler")
DECODERS = ("TPUCogVideoXDecode", "TPUWanDecode")

# ComfyUI core nodes the workflows use, as ComfyUI (comfy_extras/nodes_video.py, nodes.py) defines them.
CORE_NODES = {
    "CreateVideo": {"required": {"images": ("IMAGE",), "fps": ("FLOAT", {"min": 1.0, "max": 120.0})},
                    "optional": {"audio": ("AUDIO",)}, "outputs": ("VIDEO",)},
    "SaveVideo": {"required": {"video": ("VIDEO",), "filename_prefix": ("STRING", {}),
                               "format": (["auto", "mp4"],), "codec": (["auto", "h264"],)},
                  "optional": {}, "outputs": ()},
    "Note": {"required": {"text": ("STRING", {})}, "optional": {}, "outputs": ()},
    "LoadImage": {"required": {"image": (["example.png"], {"image_upload": True})}, "optional": {},
                  "outputs": ("IMAGE", "MASK")},
}
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
# Lists of the user's downloads: any name is valid.
DYNAMIC_COMBOS = {("TPUCogVideoXLoader", "model"), ("TPUWanLoader", "model"), ("TPUWanLoRA", "lora_name"),
                  ("TPUCogVideoXLoRA", "lora_name"), ("LoadImage", "image"),
                  *(("TPUWanModelFilesLoader", n)
                    for n in ("diffusion_model", "diffusion_model_2", "text_encoder", "vae", "clip_vision"))}


@pytest.fixture(scope="module")
def node_defs():
    from nodes import NODE_CLASS_MAPPINGS

    defs = {name: {**cls.INPUT_TYPES(), "outputs": cls.RETURN_TYPES} for name, cls in NODE_CLASS_MAPPINGS.items()}
    return {**defs, **CORE_NODES}


def _is_widget(spec) -> bool:
    return isinstance(spec[0], list) or spec[0] in WIDGET_TYPES


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
    sampler = next(n for n in wf["nodes"] if n["type"] in SAMPLERS)
    values = widget_values(sampler, node_defs[sampler["type"]])
    assert (values["width"], values["height"], values["frames"]) == NATIVE[gen]
    encoders = [n for n in wf["nodes"] if n["type"] in IMAGE_ENCODERS]
    assert len(encoders) == (gen in TINY_I2V or path.name == "wan2.2_ti2v_5b_i2v_tpu.json")
    for encoder in encoders:  # encoded at the sampler's size, from ComfyUI's Load Image
        size = widget_values(encoder, node_defs[encoder["type"]])
        assert (size["width"], size["height"], size["frames"]) == NATIVE[gen]
        image_link = encoder["inputs"][1]["link"]
        assert next(nodes[src]["type"] for lid, src, *_ in wf["links"] if lid == image_link) == "LoadImage"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_runs_headlessly_on_a_tiny_model(path, node_defs, tiny_models, tiny_wan, i2v_models, images,
                                                  tmp_path):
    """Execute the graph: our nodes for real (sizes shrunk, the tiny model swapped in), ComfyUI's Load Image,
    CreateVideo + SaveVideo stood in for (a test picture as ComfyUI's IMAGE; our mp4 writer with the fps)."""
    from nodes import NODE_CLASS_MAPPINGS
    from PIL import Image

    wf = json.loads(path.read_text())
    gen = GENERATION[path.name]
    tiny_i2v = TINY_I2V.get(gen)
    height, width, frames = SIZES.get(gen) or I2V_SIZES.get(tiny_i2v, (64, 64, 9))
    load_images = sorted(n["id"] for n in wf["nodes"] if n["type"] == "LoadImage")
    incoming = {(dst, dst_slot): (src, src_slot) for _, src, src_slot, dst, dst_slot, _ in wf["links"]}
    results: dict[int, tuple] = {}
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
            kwargs.update(model_path=str(i2v_models[tiny_i2v] if tiny_i2v else tiny_models[gen]), dtype="float32")
        if kind == "TPUWanModelFilesLoader":  # the same kind of files, made from a tiny model, under these names
            tiny = i2v_models[tiny_i2v] if tiny_i2v else tiny_wan[TINY_WAN[gen]]
            files = export_comfy_files(tiny, tmp_path / "files", "fp16")
            assert (kwargs["diffusion_model_2"] != "none") == ("transformer_2" in files)
            assert (kwargs["clip_vision"] != "none") == ("clip_vision" in files)
            kwargs.update(diffusion_model=str(files["transformer"]), text_encoder=str(files["text_encoder"]),
                          vae=str(files["vae"]), dtype="float32",
                          diffusion_model_2=str(files.get("transformer_2", "none")),
                          clip_vision=str(files.get("clip_vision", "none")))
        if kind == "LoadImage":  # as ComfyUI's: [1, H, W, 3] float in 0..1, and a mask
            picture = images["first" if node["id"] == load_images[0] else "last"]
            pixels = torch.from_numpy(np.asarray(Image.open(picture).convert("RGB")).copy()).float()[None] / 255
            results[node["id"]] = (pixels, torch.zeros(pixels.shape[:3]))
            continue
        if kind in IMAGE_ENCODERS:
            kwargs.update(width=width, height=height, frames=frames)
        if kind == "TPUWanLoRA":  # a LoRA of the same format for the tiny model, for the expert it names
            expert = "transformer_2" if kwargs["expert"] == "low noise" else "transformer"
            kwargs["lora_name"] = str(build_tiny_lora(tiny_wan[TINY_WAN[gen]] / expert,
                                                      tmp_path / "loras" / kwargs["lora_name"], "comfy"))
        if kind in STEP_CACHES:  # the tiny model has no published ratios: one a step, 8 steps
            assert kwargs["mag_ratios"] == "" or kwargs["method"] != "magcache"
            kwargs["mag_ratios"] = "1.0,0.99,0.99,0.99,0.99,0.99,0.99,0.99"
        if kind in SAMPLERS:
            cached = any(n["type"] in STEP_CACHES for n in wf["nodes"])
            kwargs.update(width=width, height=height, frames=frames, steps=min(kwargs["steps"], 8 if cached else 2))
        if kind == "CreateVideo":
            results[node["id"]] = ((kwargs["images"], kwargs["fps"]),)
            continue
        if kind == "SaveVideo":
            images, fps = kwargs["video"]
            write_mp4(images, tmp_path / "out.mp4", fps=int(fps))
            continue
        cls = NODE_CLASS_MAPPINGS[kind]
        results[node["id"]] = getattr(cls(), cls.FUNCTION)(**kwargs)
    decoded, meta = read_mp4(tmp_path / "out.mp4")
    assert decoded.shape == (frames, height, width, 3)
    image = next(results[n["id"]][0] for n in wf["nodes"] if n["type"] in DECODERS)
    assert isinstance(image, torch.Tensor) and image.shape == (frames, height, width, 3)
    for node in wf["nodes"]:  # a step cache's sampler skipped steps
        if node["type"] in STEP_CACHES:
            assert results[node["id"]][0].family.step_cache_report["skipped"] > 0
