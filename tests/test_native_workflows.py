"""The native example workflows (ComfyUI's own graphs with the TPU nodes inserted) fit the node definitions of the
ComfyUI in use and of this pack: every node type is known, every widget value is one the node takes, every link
joins an output to an input of the same type, and every TPU node sits right after the loader it takes from."""

import asyncio
import json

import pytest
from comfy_native import ROOT, comfyui_session, load_pack

NATIVE = sorted((ROOT / "workflows").glob("native_*.json"))
FILE_INPUTS = {"unet_name", "clip_name", "clip_name1", "clip_name2", "vae_name", "ckpt_name", "lora_name", "image"}
WIDGETS = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
TPU_NODES = {"TPUDiffusionModel": "MODEL", "TPUTextEncoder": "CLIP", "TPUVAE": "VAE"}
LOADERS = {"UNETLoader", "CLIPLoader", "DualCLIPLoader", "VAELoader", "CheckpointLoaderSimple"}


@pytest.fixture(scope="module")
def definitions():
    with comfyui_session():
        import nodes

        asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
        pack = load_pack()
        classes = {**nodes.NODE_CLASS_MAPPINGS, **pack.NODE_CLASS_MAPPINGS}
        yield {name: (cls.INPUT_TYPES(), tuple(getattr(cls, "RETURN_TYPES", ()))) for name, cls in classes.items()}


def test_there_are_native_workflows_for_the_families_people_run():
    names = {p.name for p in NATIVE}
    for expected in ("native_wan2.1_t2v_1.3B_tpu.json", "native_wan2.2_t2v_a14b_tpu.json",
                     "native_wan2.1_vace_14B_tpu.json", "native_hunyuan_video_t2v_tpu.json",
                     "native_ltxv_t2v_tpu.json"):
        assert expected in names
        assert (ROOT / "workflows" / expected.replace(".json", ".png")).is_file()  # its picture


def _check_widget(node: str, name: str, kind, options: dict, value):
    if isinstance(kind, list) or kind == "COMBO":
        choices = kind if isinstance(kind, list) else options.get("options", [])
        if name not in FILE_INPUTS:  # file lists depend on the machine
            assert value in choices, f"{node}.{name}: {value!r} not in {choices}"
        return
    if kind == "INT":
        assert isinstance(value, int) and not isinstance(value, bool), f"{node}.{name}: {value!r}"
    elif kind == "FLOAT":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{node}.{name}: {value!r}"
    elif kind == "BOOLEAN":
        assert isinstance(value, bool), f"{node}.{name}: {value!r}"
    elif kind == "STRING":
        assert isinstance(value, str), f"{node}.{name}: {value!r}"
    if kind in ("INT", "FLOAT"):
        assert options.get("min", value) <= value <= options.get("max", value), f"{node}.{name}: {value!r}"


@pytest.mark.parametrize("path", NATIVE, ids=lambda p: p.stem)
def test_a_native_workflow_fits_the_node_definitions(definitions, path):
    workflow = json.loads(path.read_text())
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {link[0]: link for link in workflow["links"]}
    for node in workflow["nodes"]:
        if node["type"] in ("Note", "MarkdownNote"):
            continue
        assert node["type"] in definitions, f"{path.name}: unknown node {node['type']}"
        inputs, outputs = definitions[node["type"]]
        ordered = list(inputs.get("required", {}).items()) + list(inputs.get("optional", {}).items())
        linked = {i["name"] for i in node.get("inputs", []) if i.get("link") is not None}
        values = list(node.get("widgets_values", []))
        for name, spec in ordered:
            kind, options = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
            widget = isinstance(kind, list) or kind in WIDGETS
            if not widget:
                assert name in linked or name in inputs.get("optional", {}), f"{node['type']}.{name} unconnected"
                continue
            assert values, f"{path.name}: {node['type']} has no value for {name}"
            value = values.pop(0)
            if name not in linked:
                _check_widget(node["type"], name, kind, options, value)
            if options.get("control_after_generate"):
                assert values.pop(0) in ("fixed", "randomize", "increment", "decrement")
            if options.get("image_upload"):
                values.pop(0)
        assert not values, f"{path.name}: {node['type']} has {len(values)} widget values left over"
        for slot, out in enumerate(node.get("outputs", [])):
            assert out["type"] == outputs[slot], f"{node['type']} output {slot}"
    for link_id, src, src_slot, dst, dst_slot, kind in workflow["links"]:
        assert nodes[src]["outputs"][src_slot]["type"] == kind
        target = nodes[dst]["inputs"][dst_slot]
        assert target["link"] == link_id and target["type"] == kind, f"{path.name}: link {link_id}"
    # every TPU node takes straight from a loader, and its output goes where the loader's would
    for node in workflow["nodes"]:
        if node["type"] in TPU_NODES:
            (source,) = [links[i["link"]] for i in node["inputs"] if i.get("link") is not None]
            assert nodes[source[1]]["type"] in LOADERS | {"LoraLoaderModelOnly"}, f"{path.name}: {node['type']}"
    used = {n["type"] for n in workflow["nodes"]}
    assert {"TPUDiffusionModel", "TPUTextEncoder", "TPUVAE"} <= used, f"{path.name}: {used}"
