"""The native example workflows (ComfyUI's own graphs with the TPU nodes inserted) fit the node definitions of each
ComfyUI tree they are for and of this pack: every node type is known, every widget value is one the node takes (0.33's
dynamic combos and their sub-widgets too; widgets a newer ComfyUI added may be left to their defaults, as its
frontend fills them), every link joins an output to an input of the same type, and every TPU node sits right after
the loader it takes from. Workflows of models new in a ComfyUI version are checked against the trees from that version
on (and need it: an older tree lacks one of their nodes); the others against every tree."""

import asyncio
import json

import pytest
from comfy_native import COMFYUI_TREES, comfyui_session, load_pack
from workflow_files import uses_bridge_nodes, workflows

NATIVE = [p for p in workflows() if uses_bridge_nodes(p)]
# workflow -> the ComfyUI version that first has its nodes (LTX-2, HunyuanVideo 1.5: 0.33)
SINCE = {"18 LTX-2 text to video with sound - ComfyUI nodes.json": "0.33",
         "19 LTX-2 image to video with sound - ComfyUI nodes.json": "0.33",
         "20 HunyuanVideo 1.5 text to video - ComfyUI nodes.json": "0.33"}
FILE_INPUTS = {"unet_name", "clip_name", "clip_name1", "clip_name2", "vae_name", "ckpt_name", "lora_name", "image",
               "text_encoder"}
WIDGETS = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
DYNAMIC = "COMFY_DYNAMICCOMBO_V3"  # a combo whose chosen option brings widgets of its own (0.33's SaveVideo format)
TPU_NODES = {"TPUDiffusionModel": "MODEL", "TPUTextEncoder": "CLIP", "TPUVAE": "VAE"}
LOADERS = {"UNETLoader", "CLIPLoader", "DualCLIPLoader", "VAELoader", "CheckpointLoaderSimple",
           "LTXAVTextEncoderLoader", "LTXVAudioVAELoader"}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


def _trees_for(path) -> list[str]:
    since = SINCE.get(path.name)
    return [v for v in COMFYUI_TREES if since is None or _version(v) >= _version(since)]


CASES = [pytest.param(path, version, id=f"{path.stem}-comfy{version}")
         for path in NATIVE for version in _trees_for(path)]
_DEFINITIONS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def definitions():
    """version -> {node type: (INPUT_TYPES, RETURN_TYPES)} of that tree's nodes and this pack's (read once a tree)."""

    def of(version: str) -> dict:
        if version not in _DEFINITIONS:
            with comfyui_session(version):
                import nodes

                asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
                pack = load_pack()
                classes = {**nodes.NODE_CLASS_MAPPINGS, **pack.NODE_CLASS_MAPPINGS}
                _DEFINITIONS[version] = {name: (cls.INPUT_TYPES(), tuple(getattr(cls, "RETURN_TYPES", ())))
                                         for name, cls in classes.items()}
        return _DEFINITIONS[version]

    return of


def test_there_are_native_workflows_for_the_families_people_run():
    names = {p.name for p in NATIVE}
    expected = ("13 Wan 2.1 1.3B text to video - ComfyUI nodes.json",
                "07 Wan 2.2 14B text to video - ComfyUI nodes.json",
                "14 Wan 2.1 VACE 14B reference to video - ComfyUI nodes.json",
                "21 HunyuanVideo text to video - ComfyUI nodes.json",
                "22 LTX-Video 2B text to video - ComfyUI nodes.json")
    assert set(expected) <= names
    assert set(SINCE) <= names  # LTX-2 with sound (text and image to video), HunyuanVideo 1.5


@pytest.mark.parametrize("path", [p for p in NATIVE if p.name in SINCE], ids=lambda p: p.stem)
def test_newer_workflows_need_their_version(definitions, path):
    """A workflow kept to newer trees uses a node the older ones lack (else it should be checked on all of them)."""
    older = [v for v in COMFYUI_TREES if v not in _trees_for(path)]
    if not older:
        pytest.skip("no older ComfyUI tree beside this checkout")  # TPU_VIDEO_COMFYUI names one tree
    used = {n["type"] for n in json.loads(path.read_text())["nodes"]}
    for version in older:
        assert used - set(definitions(version)), f"{path.name} loads in ComfyUI {version}: check it there too"


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


def _widgets(node: str, spec: dict, linked: set, values: list, where: str) -> None:
    """Take ``node``'s widget values for the inputs of ``spec`` (required, then optional) from ``values``, checking
    each; a dynamic combo's chosen option's own inputs follow it. Optional widgets after the last value keep their
    defaults (a workflow saved before ComfyUI added them)."""
    for group in ("required", "optional"):
        for name, entry in spec.get(group, {}).items():
            kind, options = entry[0], (entry[1] if len(entry) > 1 else {}) or {}
            kind = options.get("widgetType", kind) if isinstance(kind, str) and "," in kind else kind
            if not (isinstance(kind, list) or kind in WIDGETS or kind == DYNAMIC):
                assert name in linked or group == "optional", f"{where}: {node}.{name} unconnected"
                continue
            if not values and group == "optional":
                return
            assert values, f"{where}: {node} has no value for {name}"
            value = values.pop(0)
            if kind == DYNAMIC:
                chosen = {o["key"]: o.get("inputs", {}) for o in options["options"]}
                assert value in chosen, f"{where}: {node}.{name}: {value!r} not in {list(chosen)}"
                _widgets(node, chosen[value], linked, values, where)
                continue
            if name not in linked:
                _check_widget(node, name, kind, options, value)
            if options.get("control_after_generate"):
                assert values.pop(0) in ("fixed", "randomize", "increment", "decrement")
            if options.get("image_upload"):
                values.pop(0)


@pytest.mark.parametrize("path,version", CASES)
def test_a_native_workflow_fits_the_node_definitions(definitions, path, version):
    workflow = json.loads(path.read_text())
    known = definitions(version)
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {link[0]: link for link in workflow["links"]}
    where = f"{path.name} (ComfyUI {version})"
    for node in workflow["nodes"]:
        if node["type"] in ("Note", "MarkdownNote"):
            continue
        assert node["type"] in known, f"{where}: unknown node {node['type']}"
        inputs, outputs = known[node["type"]]
        linked = {i["name"] for i in node.get("inputs", []) if i.get("link") is not None}
        values = list(node.get("widgets_values", []))
        _widgets(node["type"], inputs, linked, values, where)
        assert not values, f"{where}: {node['type']} has {len(values)} widget values left over"
        for slot, out in enumerate(node.get("outputs", [])):
            assert out["type"] == outputs[slot], f"{where}: {node['type']} output {slot}"
    for link_id, src, src_slot, dst, dst_slot, kind in workflow["links"]:
        assert nodes[src]["outputs"][src_slot]["type"] == kind
        target = nodes[dst]["inputs"][dst_slot]
        assert target["link"] == link_id and target["type"] == kind, f"{where}: link {link_id}"
    # every TPU node takes straight from a loader, and its output goes where the loader's would
    for node in workflow["nodes"]:
        if node["type"] in TPU_NODES:
            (source,) = [links[i["link"]] for i in node["inputs"] if i.get("link") is not None]
            assert nodes[source[1]]["type"] in LOADERS | {"LoraLoaderModelOnly"}, f"{where}: {node['type']}"
    used = {n["type"] for n in workflow["nodes"]}
    assert {"TPUDiffusionModel", "TPUTextEncoder", "TPUVAE"} <= used, f"{path.name}: {used}"
