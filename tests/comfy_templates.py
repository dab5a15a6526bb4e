"""ComfyUI's official workflow templates in the tests: where the installed package keeps them, their video templates,
their conversion from the UI format to the API prompt a server runs (as ComfyUI's frontend converts them), and tiny
random-weight models and input files under the names the templates ask for.

The templates come from Comfy-Org's ``comfyui-workflow-templates-json`` package (the October 2026 release, 0.1.123,
part of ``comfyui-workflow-templates`` 0.11.97), installed by the test extra; nothing of it is copied here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

PACKAGE = "comfyui_workflow_templates_json"
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
PRIMITIVES = {"PrimitiveInt", "PrimitiveFloat"}  # value nodes of the backend (a PrimitiveNode is the frontend's)
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"  # a combo whose chosen option brings widgets of its own (ComfyUI 0.33)
MODEL_TYPES = ("MODEL", "CLIP", "VAE", "CLIP_VISION", "AUDIO_ENCODER")
TPU_NODES = {"MODEL": "TPUDiffusionModel", "CLIP": "TPUTextEncoder", "VAE": "TPUVAE", "CLIP_VISION": "TPUCLIPVision",
             "AUDIO_ENCODER": "TPUAudioEncoder"}


def templates_dir() -> Path:
    try:
        import comfyui_workflow_templates_json as package
    except ImportError as error:
        raise RuntimeError("the workflow templates are not installed: pip install "
                           "comfyui-workflow-templates-json==0.1.123 (the test extra)") from error
    return Path(package.__file__).parent / "templates"


SAMPLERS = {"KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced"}


def video_templates() -> dict[str, dict]:
    """name -> workflow of every template in the package's Video category that runs locally (not a paid API's), and
    of its Video Tools category those that sample a video model (SeedVR2's upscaler; not the depth, segmentation or
    frame interpolation tools)."""
    folder = templates_dir()
    index = json.loads((folder / "index.json").read_text())
    out = {}
    for title in ("Video", "Video Tools"):
        category = next(c for c in index if c.get("type") == "video" and c.get("title") == title)
        for entry in category["templates"]:
            path = folder / f"{entry['name']}.json"
            if path.is_file() and not entry["name"].startswith("api_") and "API" not in entry.get("tags", []):
                workflow = json.loads(path.read_text())
                if title == "Video" or node_types(workflow) & SAMPLERS:
                    out[entry["name"]] = workflow
    return out


def template_usage() -> dict[str, int]:
    """name -> the Templates browser's use count (``usage`` in the package's index.json) of every local video
    template (those of ``video_templates``)."""
    index = json.loads((templates_dir() / "index.json").read_text())
    video = next(c for c in index if c.get("type") == "video" and c.get("title") == "Video")
    local = set(video_templates())
    return {e["name"]: int(e.get("usage", 0)) for e in video["templates"] if e["name"] in local}


def documented_results(text: str) -> tuple[dict[str, tuple], float | None]:
    """The "By use" table of docs/templates.md (template -> (uses, loads on 0.33, with the TPU nodes, automatic
    mode)) and the share it states."""
    import re as _re

    rows = {}
    section = text.split("## By use", 1)[1] if "## By use" in text else ""
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1].replace(",", "").isdigit():
            rows[cells[0].strip("`")] = (int(cells[1].replace(",", "")), cells[2], cells[3], cells[4])
    found = _re.search(r"\*\*(\d+(?:\.\d+)?)% of the use\*\*", section)
    return rows, float(found.group(1)) if found else None


def equal_share(rows: dict[str, tuple]) -> float:
    """The percentage of the use of the templates that load on 0.33 whose runs with the TPU nodes and in the automatic
    mode are both equal to ComfyUI's own run."""
    loads = {name: r for name, r in rows.items() if r[1] == "yes"}
    equal = sum(r[0] for r in loads.values() if r[2].startswith("equal") and r[3].startswith("equal"))
    return 100.0 * equal / max(1, sum(r[0] for r in loads.values()))


def node_types(workflow: dict) -> set[str]:
    """The node types a template runs (subgraphs expanded; muted and bypassed nodes and the frontend's own left out)."""
    subgraphs = {s["id"]: s for s in workflow.get("definitions", {}).get("subgraphs", [])}
    found: set[str] = set()

    def walk(nodes):
        for node in nodes:
            if node.get("mode", 0) in (2, 4):
                continue
            if node["type"] in subgraphs:
                walk(subgraphs[node["type"]]["nodes"])
            else:
                found.add(node["type"])

    walk(workflow["nodes"])
    return found - FRONTEND_ONLY


def flatten_subgraphs(workflow: dict) -> dict:
    """The workflow with every subgraph instance replaced by the subgraph's nodes, as ComfyUI's frontend flattens
    one before it queues a prompt: inner nodes get ids ``instance:inner``, a link into a subgraph input continues to
    the inner inputs it feeds (an unlinked subgraph input leaves the inner widget's own value), a link out of a
    subgraph output starts at the inner output that feeds it; nested subgraphs are flattened in turn. Values the
    instance shows for its promoted widgets (``proxyWidgets``) are set on the inner widgets. A muted or bypassed
    instance stays as it is (the conversion drops it, or passes its inputs through, as any such node)."""
    subgraphs = {s["id"]: s for s in workflow.get("definitions", {}).get("subgraphs", [])}
    nodes = [dict(n) for n in workflow["nodes"]]
    links = [list(link) for link in workflow["links"]]
    while True:
        instance = next((n for n in nodes if n["type"] in subgraphs and n.get("mode", 0) not in (2, 4)), None)
        if instance is None:
            break
        graph, prefix = subgraphs[instance["type"]], f"{instance['id']}:"
        inner = {n["id"]: dict(n, id=prefix + str(n["id"])) for n in graph["nodes"]}
        proxies = instance.get("properties", {}).get("proxyWidgets") or []
        shown = instance.get("widgets_values") or []
        for (node_id, widget), value in zip(proxies, shown if len(shown) == len(proxies) else []):
            target = inner.get(int(node_id)) if str(node_id).lstrip("-").isdigit() else None
            if target is not None:
                target["_overrides"] = {**target.get("_overrides", {}), widget: value}
        outer_in = {}  # subgraph input slot -> (origin id, origin slot) of the outer link into it
        for slot, put in enumerate(instance.get("inputs", [])):
            link = next((link for link in links if link[0] == put.get("link")), None)
            index = next((i for i, g in enumerate(graph["inputs"]) if g["name"] == put["name"]), slot)
            if link is not None:
                outer_in[index] = (link[1], link[2])
        inner_out = {}  # subgraph output slot -> (inner node id, slot)
        new_links = []
        unlinked = {}  # an unlinked subgraph input slot -> the inner (node, input slot)s it feeds
        for link in graph["links"]:
            link_id, origin, origin_slot, target, target_slot, kind = (
                (link["id"], link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"],
                 link.get("type")) if isinstance(link, dict) else link[:6])
            if target == -20:
                inner_out[target_slot] = (prefix + str(origin), origin_slot)
                continue
            if origin == -10:
                if origin_slot not in outer_in:
                    unlinked.setdefault(origin_slot, []).append((target, target_slot))
                    continue
                origin, origin_slot = outer_in[origin_slot]
            else:
                origin = prefix + str(origin)
            new_links.append([prefix + str(link_id), origin, origin_slot, prefix + str(target), target_slot, kind])
        for node in inner.values():  # inner inputs point at the renamed links; those from an unlinked input drop
            node["inputs"] = [dict(i, link=(prefix + str(i["link"]) if i.get("link") is not None else None))
                              for i in node.get("inputs", [])]
        kept = {link[0] for link in new_links}
        for node in inner.values():
            for put in node["inputs"]:
                if put["link"] is not None and put["link"] not in kept:
                    put["link"] = None
        # An unlinked subgraph input shows the widget of an inner node it feeds (its promoted widget); inner inputs
        # it feeds that are sockets, not widgets (a math expression's values), take that widget's value.
        for feeds in unlinked.values():
            widget = next(((t, inner[t]["inputs"][slot]["widget"]["name"]) for t, slot in feeds
                           if t in inner and slot < len(inner[t]["inputs"])
                           and inner[t]["inputs"][slot].get("widget")), None)
            for target, slot in feeds:
                put = inner[target]["inputs"][slot] if target in inner and slot < len(inner[target]["inputs"]) else {}
                if widget is not None and not put.get("widget"):
                    put["_widget_of"] = [prefix + str(widget[0]), widget[1]]
        for link in links:  # links out of the instance start at the inner output behind it
            if link[1] == instance["id"] and link[2] in inner_out:
                link[1], link[2] = inner_out[link[2]]
        links = [link for link in links if link[3] != instance["id"] and link[1] != instance["id"]] + new_links
        nodes = [n for n in nodes if n is not instance] + list(inner.values())
        kept = {link[0] for link in links}  # an output nothing inside feeds (a template's loose end) feeds nothing
        nodes = [dict(n, inputs=[dict(i, link=None) if i.get("link") is not None and i["link"] not in kept else i
                                 for i in n.get("inputs", [])]) for n in nodes]
    return {**workflow, "nodes": nodes, "links": links, "definitions": {}}


# --- UI format -> API prompt ---------------------------------------------------------------------------------------
def _widget_names(info: dict) -> list[tuple[str, bool]]:
    """(input name, followed by a control widget) of a node's widget inputs, in the order the frontend lays them."""
    names = []
    for section in ("required", "optional"):
        for name, spec in info["input"].get(section, {}).items():
            kind = spec[0]
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            # an input of several types shows the widget of the first (``widgetType``: LTXV Empty Latent Audio's
            # frame rate, FLOAT,INT)
            if isinstance(kind, list) or kind in WIDGET_TYPES or kind == DYNAMIC_COMBO or (
                    options.get("widgetType") in WIDGET_TYPES):
                control = bool(options.get("control_after_generate")) or (
                    kind == "INT" and name in ("seed", "noise_seed"))
                names.append((name, control))
    return names


def _take_widgets(info_inputs: dict, values: list, inputs: dict, prefix: str = "") -> None:
    """Fill ``inputs`` from a node's list of widget values as the frontend lays them: a dynamic combo (0.33's SaveVideo
    ``format``) is followed by its chosen option's own widgets, named ``combo.widget`` in the API prompt."""
    for name, control in _widget_names({"input": info_inputs}):
        if not values:
            return
        value = inputs[prefix + name] = values.pop(0)
        if control and values and values[0] in ("fixed", "increment", "decrement", "randomize"):
            values.pop(0)
        spec = info_inputs.get("required", {}).get(name) or info_inputs.get("optional", {}).get(name)
        if spec[0] == DYNAMIC_COMBO:
            chosen = {o["key"]: o.get("inputs", {}) for o in spec[1]["options"]}
            _take_widgets(chosen.get(value, {}), values, inputs, f"{prefix}{name}.")


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """The API prompt of a UI workflow (subgraphs flattened first, as the frontend does): muted nodes dropped,
    bypassed nodes passed through (an output takes the input of its type), Reroute followed, PrimitiveNode values put
    into the widgets they feed."""
    workflow = flatten_subgraphs(workflow)
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {link[0]: link for link in workflow["links"]}  # id, from node, from slot, to node, to slot, type

    def source(link_id):
        """(node id, slot) an input really takes after Reroutes and bypassed nodes, or ("value", v) for a primitive."""
        _, node_id, slot, _, _, kind = links[link_id]
        node = nodes[node_id]
        if node["type"] == "Reroute":
            return source(node["inputs"][0]["link"])
        if node["type"] == "PrimitiveNode":
            return ("value", node["widgets_values"][0])
        if node.get("mode", 0) == 4:  # bypassed: the first input of the output's type
            for inp in node.get("inputs", []):
                if inp.get("link") is not None and inp["type"] == kind:
                    return source(inp["link"])
            return None
        return (str(node_id), slot)

    prompt = {}
    for node in workflow["nodes"]:
        if node["type"] in FRONTEND_ONLY or node.get("mode", 0) in (2, 4):
            continue
        info = object_info[node["type"]]
        values = node.get("widgets_values", [])
        inputs = {}
        if isinstance(values, dict):
            inputs.update({k: v for k, v in values.items() if k in {n for n, _ in _widget_names(info)}})
        else:
            _take_widgets(info["input"], list(values), inputs)
        # The frontend also writes the values by name: they decide where an input the positional list does not
        # account for (a widget of several types, LTXV Empty Latent Audio's frame rate) moves the others.
        named = node.get("widgets_values_named")
        if isinstance(named, dict):
            declared = {n for section in ("required", "optional") for n in info["input"].get(section, {})}
            inputs.update({k: v for k, v in named.items() if k in declared})
        inputs.update(node.get("_overrides", {}))  # a subgraph instance's values for its promoted widgets
        for inp in node.get("inputs", []):
            if inp.get("link") is None:
                continue
            found = source(inp["link"])
            if found is None:
                continue
            inputs[inp["name"]] = found[1] if found[0] == "value" else list(found)
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    for node in workflow["nodes"]:  # sockets fed by a subgraph's promoted widget (flatten_subgraphs)
        for inp in node.get("inputs", []):
            source_node = prompt.get(inp.get("_widget_of", [None])[0])
            if str(node["id"]) in prompt and source_node is not None:
                prompt[str(node["id"])]["inputs"][inp["name"]] = source_node["inputs"].get(inp["_widget_of"][1])
    return _without_dangling(prompt)


def _without_dangling(prompt: dict) -> dict:
    """Drop links to nodes that are not in the prompt (the frontend leaves such inputs out)."""
    for node in prompt.values():
        for name, value in list(node["inputs"].items()):
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[0] not in prompt:
                del node["inputs"][name]
    return prompt


# --- making a template small, observing it, inserting the TPU nodes ------------------------------------------------
def reduce_sizes(prompt: dict, object_info: dict, width: int, height: int, length: int, steps: int) -> dict:
    """Every node's width / height / length widgets and step counts set small (a two-expert split scaled along). A
    size a primitive node feeds is set on that node (VACE outpainting's); one computed by other nodes (a resolution
    selector, a math expression from a duration, a switch between step counts: MiniMax H3's, Wan 2.2's subgraphs)
    becomes the widget's own small value, the nodes that computed it left without a consumer."""
    for node in prompt.values():
        inputs = node["inputs"]
        names = {n for n, _ in _widget_names(object_info[node["class_type"]])}
        for name, value in (("width", width), ("height", height), ("length", length)):
            source = inputs.get(name)
            if isinstance(source, list) and prompt.get(source[0], {}).get("class_type") in PRIMITIVES:
                prompt[source[0]]["inputs"]["value"] = value  # a primitive node feeding the size (VACE outpainting)
            elif name in names:
                inputs[name] = value
        if "steps" in names and isinstance(inputs.get("steps"), (int, list)):
            old = inputs["steps"] if isinstance(inputs["steps"], int) else None
            inputs["steps"] = steps
            for name in ("start_at_step", "end_at_step"):
                if old and isinstance(inputs.get(name), int) and inputs[name] <= old:
                    inputs[name] = round(inputs[name] * steps / old)
    _spread_computed_frame_indices(prompt, length)
    return _without_unused(prompt)


def _spread_computed_frame_indices(prompt: dict, length: int) -> None:
    """Guide frames placed at an index other nodes compute (MiniMax H3's multi-frame reference: seconds x 24 fps,
    frames 36, 72 and 120 of the full-length video) would fall outside the reduced video: they become literals spread
    over its frames in the order the template places them (``_literal_value`` of the computing nodes where it can be
    read, else the nodes' order), so each guide still lands on a frame of its own after the first."""
    computed = [(node, node["inputs"]["frame_idx"]) for node in prompt.values()
                if isinstance(node["inputs"].get("frame_idx"), list)]
    order = sorted(range(len(computed)), key=lambda i: (_literal_value(prompt, computed[i][1]) or 0, i))
    for rank, i in enumerate(order):
        computed[i][0]["inputs"]["frame_idx"] = round((rank + 1) * (length - 1) / len(computed))


def _literal_value(prompt: dict, source: list):
    """The number a primitive node, or a ComfyMathExpression over primitive nodes, gives (None where it is computed
    from anything else)."""
    node = prompt.get(source[0], {})
    if node.get("class_type") in PRIMITIVES:
        return node["inputs"].get("value")
    if node.get("class_type") != "ComfyMathExpression":
        return None
    values = {}
    for name, value in node["inputs"].items():
        if name.startswith("values."):
            value = _literal_value(prompt, value) if isinstance(value, list) else value
            if value is None:
                return None
            values[name.split(".", 1)[1]] = value
    try:
        return float(eval(node["inputs"]["expression"], {"__builtins__": {}, "round": round, "min": min,  # noqa: S307
                                                          "max": max, "abs": abs}, values))
    except Exception:  # noqa: BLE001 - an expression this reader does not know: the node's order decides
        return None


def _without_unused(prompt: dict) -> dict:
    """The prompt without the value nodes nothing takes any more (ComfyUI would not run them either, but a node with
    no consumer left is just noise in the prompt)."""
    while True:
        used = {v[0] for node in prompt.values() for v in node["inputs"].values()
                if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)}
        dead = [k for k, node in prompt.items() if k not in used and node["class_type"] in VALUE_NODES]
        if not dead:
            return prompt
        for key in dead:
            del prompt[key]


# Nodes that only compute a value for other nodes' inputs (no output of their own).
VALUE_NODES = {"PrimitiveInt", "PrimitiveFloat", "PrimitiveBoolean", "PrimitiveString", "PrimitiveStringMultiline",
               "ComfyMathExpression", "ComfySwitchNode", "ResolutionSelector", "GetImageSize", "MathExpression|pysssss"}


AUDIO_DECODES = ("VAEDecodeAudio", "LTXVAudioVAEDecode")


def observe(prompt: dict, prefix: str) -> dict:
    """The latents every VAE decode takes (every stream of an audio-video latent, as exact floats), the frames it
    gives (8-bit PNGs), the waveform every audio decode gives and the latent it takes, saved to compare (``OBSERVING_NODES``); the
    template's own nodes and links are left as they are."""
    for node_id, node in list(prompt.items()):
        if node["class_type"] in ("VAEDecode", "VAEDecodeTiled"):
            prompt[f"{node_id}_latent"] = {"class_type": "TemplateTestSaveLatent", "inputs": {
                "samples": node["inputs"]["samples"], "filename_prefix": f"{prefix}/n{node_id}/latent"}}
            prompt[f"{node_id}_frames"] = {"class_type": "SaveImage", "inputs": {
                "images": [node_id, 0], "filename_prefix": f"{prefix}/n{node_id}/frame"}}
        elif node["class_type"] in AUDIO_DECODES:
            prompt[f"{node_id}_audio"] = {"class_type": "TemplateTestSaveAudio", "inputs": {
                "audio": [node_id, 0], "filename_prefix": f"{prefix}/n{node_id}/audio"}}
            if isinstance(node["inputs"].get("samples"), list):
                prompt[f"{node_id}_latent"] = {"class_type": "TemplateTestSaveLatent", "inputs": {
                    "samples": node["inputs"]["samples"], "filename_prefix": f"{prefix}/n{node_id}/latent"}}
    return prompt


# The test's own saving nodes (written into the test's copy of the tree): every stream of a latent (ComfyUI's
# SaveLatent takes one tensor, not an audio-video pair) and an audio's waveform, as safetensors.
OBSERVING_NODES = """
import os

import folder_paths
from safetensors.torch import save_file


def _path(prefix, suffix):
    path = os.path.join(folder_paths.get_output_directory(), prefix + suffix)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


class TemplateTestSaveLatent:
    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "filename_prefix": ("STRING", {"default": "latent"})}}

    def save(self, samples, filename_prefix):
        value = samples["samples"]
        streams = value.unbind() if getattr(value, "is_nested", False) else [value]
        save_file({f"stream_{i}": t.contiguous().float() for i, t in enumerate(streams)},
                  _path(filename_prefix, "_00001_.latent"))
        return {}


class TemplateTestSaveAudio:
    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"audio": ("AUDIO",), "filename_prefix": ("STRING", {"default": "audio"})}}

    def save(self, audio, filename_prefix):
        save_file({"waveform": audio["waveform"].contiguous().float()}, _path(filename_prefix, "_00001_.audio"))
        return {}


NODE_CLASS_MAPPINGS = {"TemplateTestSaveLatent": TemplateTestSaveLatent, "TemplateTestSaveAudio": TemplateTestSaveAudio}
"""


def loader_outputs(class_type: str, object_info: dict) -> list[tuple[int, str]]:
    """(slot, type) of a loader's model outputs: a node with no MODEL / CLIP / VAE / CLIP_VISION input."""
    info = object_info[class_type]
    takes = {spec[0] for section in ("required", "optional") for spec in info["input"].get(section, {}).values()
             if isinstance(spec[0], str)}
    if takes & set(MODEL_TYPES):
        return []
    return [(i, t) for i, t in enumerate(info["output"]) if t in MODEL_TYPES]


def insert_tpu_nodes(prompt: dict, object_info: dict, kinds=MODEL_TYPES) -> dict:
    """The TPU nodes (diffusion model, text encoder, VAE, CLIP vision, audio encoder) right after every loader, every
    consumer of a loader's model output rewired
    (``kinds``: only those of these output types, to tell which part makes a difference)."""
    for node_id, node in list(prompt.items()):
        for slot, kind in loader_outputs(node["class_type"], object_info):
            if kind not in kinds:
                continue
            tpu_id = f"{node_id}_tpu{slot}"
            for other in prompt.values():
                for name, value in other["inputs"].items():
                    if value == [node_id, slot]:
                        other["inputs"][name] = [tpu_id, 0]
            prompt[tpu_id] = {"class_type": TPU_NODES[kind], "inputs": {kind.lower(): [node_id, slot]}}
    return prompt


# --- tiny models and inputs under the templates' names --------------------------------------------------------------
def _wan(kind: str, **extra):
    from tpu_runtime.bridge.tiny import tiny_wan

    return lambda: tiny_wan(kind, layers=1, **extra)


def _tiny(builder: str, **options):
    """A builder of ``tpu_runtime.bridge.tiny`` by name (imported when ComfyUI's code is)."""

    def build():
        from tpu_runtime.bridge import tiny

        return getattr(tiny, builder)(**options)

    return build


# Diffusion model file names (regular expressions) -> the tiny model of its architecture, as ComfyUI's detection reads
# it from the weights (model type, input channels).
DIFFUSION_MODELS = (
    (r"wan2\.1_vace_", _wan("vace")),
    (r"wan2\.1_t2v_", _wan("t2v")),
    (r"wan2\.1_flf2v_", _wan("i2v", in_dim=36, flf_pos_embed_token_number=514)),
    (r"wan2\.1_(i2v|fun_inp)_|I2V-ATI", _wan("i2v", in_dim=36)),
    (r"wan2\.1_fun_control_", _wan("i2v", in_dim=48)),
    (r"wan2\.2_t2v_(high|low)_noise_14B", _wan("t2v")),
    (r"wan2\.2_(i2v|fun_inpaint)_(high|low)_noise_14B", _wan("t2v", in_dim=36)),
    (r"wan2\.2_fun_control_(high|low)_noise_14B", _wan("t2v", in_dim=52)),
    (r"wan2\.2_ti2v_5B", _wan("t2v", in_dim=48, out_dim=48)),  # Wan 2.2 TI2V-5B: 48 latent channels in and out
    (r"wan2\.2_fun_control_5B", _wan("t2v", in_dim=148, out_dim=48)),  # + control and image latents, the mask
    (r"wan2\.2_fun_inpaint_5B", _wan("t2v", in_dim=100, out_dim=48)),  # + the image latent and the mask
    # --- other templates (SCAIL-2, SeedVR2, Bernini-R, Wan Animate 2, HunyuanVideo 1.5, ...) ---
    (r"wan2\.1_14B_SCAIL_2_", _tiny("tiny_scail")),  # written by MODEL_FILES; its LoRAs read this
    (r"wan2\.2_bernini_r_(high|low)_noise", _wan("t2v")),  # Wan 2.2 A14B T2V with in-context references
    (r"wan2\.2_s2v_14B_", _tiny("tiny_wan_s2v")),  # written by MODEL_FILES; its LoRA reads this
)


def diffusion_builder(name: str):
    return next((build for pattern, build in DIFFUSION_MODELS if re.search(pattern, name)), None)


def widget_files(prompt: dict) -> dict[str, set[str]]:
    """loader input name -> the file names a prompt asks for."""
    found: dict[str, set[str]] = {}
    for node in prompt.values():
        for name, value in node["inputs"].items():
            if isinstance(value, str) and re.search(r"\.(safetensors|pt|pth|ckpt|gguf)$", value):
                found.setdefault(name, set()).add(value)
    return found


FOLDERS = {"unet_name": "diffusion_models", "clip_name": "text_encoders", "vae_name": "vae", "text_encoder": "text_encoders",
           "model_name": "latent_upscale_models",
           "lora_name": "loras", "ckpt_name": "checkpoints", "clip_vision": "clip_vision",
           "audio_encoder_name": "audio_encoders", "clip_name1": "text_encoders", "clip_name2": "text_encoders"}


def _umt5(path, seed, server):
    from tpu_runtime.bridge.tiny import save_umt5

    save_umt5(path, server.umt5, seed=seed)


def _wan21_vae(path, seed, server):
    from tpu_runtime.bridge.tiny import save_wan_vae

    save_wan_vae(path, seed=seed)


def _wan22_vae(path, seed, server):
    from tpu_runtime.bridge.tiny import save_wan22_vae

    save_wan22_vae(path, seed=seed)


def _clip_vision_h(path, seed, server):
    server.clip_vision_file(path, seed)


def _minimax(writer_name: str):
    """A MiniMax H3 file, written at the tiny sizes a test's server builds MiniMax H3's fixed-size parts at."""

    def write(path, seed, server):
        from tpu_runtime.bridge import tiny

        with tiny.minimax_h3_reduced():
            getattr(tiny, writer_name)(path, seed)

    return write


def _minimax_lora(path, seed, server):
    from safetensors.torch import save_file
    from tpu_runtime.bridge.tiny import QWEN3VL_32B_TINY, minimax_h3_lora, tiny_minimax_h3

    module = tiny_minimax_h3(curve=True, text_dim=QWEN3VL_32B_TINY["hidden_size"])
    save_file(minimax_h3_lora(module, seed=seed), str(path))


def _dit(builder: str, **options):
    """A diffusion model file of a tiny builder in the layout its name says: blocks int8 ConvRot
    (``save_int8_convrot_blocks``) for an ``int8_convrot`` file, float16 otherwise (fp16, bf16 and fp8 names: the
    tests' loaders read all alike)."""

    def write(path, seed, server):
        from tpu_runtime.bridge.tiny import save_diffusion_model, save_int8_convrot_blocks

        module = _tiny(builder, **options)()
        if "int8_convrot" in path.name:
            save_int8_convrot_blocks(module, path, seed)
        else:
            save_diffusion_model(module, path, seed=seed, dtype=torch.float16)

    return write


def _sam3(path, seed, server):
    from tpu_runtime.bridge import tiny

    with tiny.sam3_reduced():
        tiny.save_sam3(path, seed)


def _seedvr2(part: str):
    """SeedVR2's DiT (int8 ConvRot blocks) or VAE, at the tiny sizes a test's server builds them at."""

    def write(path, seed, server):
        from tpu_runtime.bridge import tiny

        with tiny.seedvr2_reduced():
            if part == "dit":
                tiny.save_int8_convrot_blocks(tiny.tiny_seedvr2(), path, seed)
            else:
                tiny.save_seedvr2_vae(path, seed)

    return write


def _hunyuan_video_15(part: str):
    """HunyuanVideo 1.5's text encoders, image encoder and VAE, at the tiny sizes a test's server builds them at
    (``server.byt5``, ``server.siglip``: the configurations its ComfyUI copy holds)."""

    def write(path, seed, server):
        from tpu_runtime.bridge import tiny

        with tiny.hunyuan_video_15_reduced():
            if part == "qwen":
                tiny.save_qwen25_7b(path, seed)
            elif part == "byt5":
                tiny.save_byt5_small_glyph(path, server.byt5, seed)
            elif part == "siglip":
                tiny.save_siglip_384(path, server.siglip, seed)
            else:
                tiny.save_hunyuan_video_15_vae(path, seed)

    return write


def _ltx23(part: str):
    """LTX-2.3's (and LTX-2's: ``checkpoint 2.0``) checkpoint, Gemma 3 12B (nvfp4 matrices unless the name is the
    plain one), latent upscaler and LoRAs, at the tiny sizes a test's server builds Gemma 3 at (the rest is read from
    the files)."""

    def write(path, seed, server):
        from safetensors.torch import save_file
        from tpu_runtime.bridge import tiny

        with tiny.gemma3_12b_reduced():
            if part == "checkpoint":
                tiny.save_ltx23_checkpoint(path, seed)
            elif part == "checkpoint 2.0":
                tiny.save_ltx23_checkpoint(path, seed, generation="2.0")
            elif part == "gemma":
                tiny.save_gemma3_12b(path, seed, quantized="fp4" in path.name)
            elif part == "gemma_lora":
                save_file(tiny.gemma3_12b_lora(seed), str(path))
            elif part == "upsampler":
                tiny.save_ltx23_upsampler(path, seed)
            else:
                save_file(tiny.ltx23_lora(seed, generation=part.split()[-1] if " " in part else "2.3"), str(path))

    return write


def _ltx25(part: str):
    """LTX-2.5's transformer, VAEs (separate files), Gemma 4 12B (with LTX's projection) and E2B (the prompt
    enhancer), at the tiny sizes a test's server builds Gemma 4 at (the rest is read from the files)."""

    def write(path, seed, server):
        from tpu_runtime.bridge import tiny

        with tiny.gemma4_reduced():
            getattr(tiny, f"save_{part}")(path, seed)

    return write


def _wav2vec2(released_width: int):
    def write(path, seed, server):
        from tpu_runtime.bridge.tiny import save_wav2vec2

        save_wav2vec2(path, seed, released_width)

    return write


# (loader input, file name pattern, writer(path, seed, server), the parts its model runs as on the runtime): every
# other file a template asks for, built tiny in the layout its name says (quantized ones quantized as the released
# files are). A part is the label the runtime's "compiled <part> ..." / "loaded <part> ..." lines give it; one marked
# IMAGE runs only in a template that feeds an image to the model (image to video, references).
IMAGE = "?image"
MODEL_FILES = (
    ("clip_name", r"^umt5_xxl_.*\.safetensors$", _umt5, ()),
    ("vae_name", r"^(wan_2\.1_vae|Wan2_1_VAE_bf16)\.safetensors$", _wan21_vae, ("WanVAE.decoder",)),
    ("vae_name", r"^wan2\.2_vae\.safetensors$", _wan22_vae, ("WanVAE.decoder", "WanVAE.encoder" + IMAGE)),
    ("clip_vision", r"^clip_vision_h\.safetensors$", _clip_vision_h, ()),
    ("unet_name", r"^minimax_h3_(fl2va|ref2va)_pruned_int8_convrot\.safetensors$", _minimax("save_minimax_h3_dit"),
     ("MiniMaxH3Model", "MiniMaxH3Model.preprocess_text_embeds")),
    ("clip_name", r"^qwen3vl_32b_minimax_h3_nvfp4_awq\.safetensors$", _minimax("save_minimax_h3_text_encoder"),
     ("MiniMaxQwen3VL (qwen3vl_32b)", "Qwen3VLVisionModel (qwen3vl_32b)" + IMAGE)),
    ("vae_name", r"^minimax_h3_video_vae_int8_convrot\.safetensors$", _minimax("save_minimax_h3_video_vae"),
     ("MiniMaxH3VideoVAE.decoder", "MiniMaxH3VideoVAE.encoder" + IMAGE)),
    ("vae_name", r"^minimax_h3_audio_vae_fp32\.safetensors$", _minimax("save_minimax_h3_audio_vae"),
     ("MiniMaxH3AudioVAE.decoder",)),
    ("lora_name", r"^minimax_h3_(fl2v|ref2v)_turbo_.*\.safetensors$", _minimax_lora, ()),
    # --- other templates (SCAIL-2, SeedVR2, Bernini-R, Wan Animate 2, HunyuanVideo 1.5, ...) ---
    ("unet_name", r"^wan2\.1_14B_SCAIL_2_(fp16|int8_convrot)\.safetensors$", _dit("tiny_scail"), ("SCAIL2WanModel",)),
    ("ckpt_name", r"^sam3\.1_multiplex_fp16\.safetensors$", _sam3, ("ViTDet", "CLIPTextModel (sam3_clip)")),
    ("unet_name", r"^seedvr2_3b_int8_convrot\.safetensors$", _seedvr2("dit"), ("NaDiT",)),
    ("unet_name", r"^wan_animate_2_distill_int8_convrot\.safetensors$", _dit("tiny_wan_animate"),
     ("AnimateWanModel",)),
    ("unet_name", r"^wan2\.2_s2v_14B_fp8_scaled\.safetensors$", _dit("tiny_wan_s2v"), ("WanModel_S2V",)),
    ("audio_encoder_name", r"^wav2vec2_large_english_fp16\.safetensors$", _wav2vec2(1024), ("Wav2Vec2Model",)),
    ("audio_encoder_name", r"^wav2vec2-chinese-base_fp16\.safetensors$", _wav2vec2(768), ("Wav2Vec2Model",)),
    ("unet_name", r"^hunyuanvideo1\.5_720p_(i2v|t2v)_fp16\.safetensors$", _dit("tiny_hunyuan_video_15"),
     ("HunyuanVideo",)),
    ("clip_name1", r"^qwen_2\.5_vl_7b(_fp8_scaled)?\.safetensors$", _hunyuan_video_15("qwen"),
     ("Qwen25_7BVLI (qwen25_7b)",)),
    # ByT5 encodes only the text a prompt quotes (glyphs to draw): the templates' prompts quote none
    ("clip_name2", r"^byt5_small_glyphxl_fp16\.safetensors$", _hunyuan_video_15("byt5"), ()),
    ("clip_vision", r"^sigclip_vision_patch14_384\.safetensors$", _hunyuan_video_15("siglip"),
     ("CLIPVisionModelProjection",)),
    ("vae_name", r"^hunyuanvideo15_vae_fp16\.safetensors$", _hunyuan_video_15("vae"),
     ("AutoencodingEngine.decoder", "AutoencodingEngine.encoder" + IMAGE)),
    ("vae_name", r"^seedvr2_ema_vae_fp16\.safetensors$", _seedvr2("vae"),
     ("VideoAutoencoderKLWrapper.slicing_decode", "VideoAutoencoderKLWrapper.slicing_encode")),
    # --- LTX-2.3 ---
    ("ckpt_name", r"^ltx-2\.3-22b-(dev|distilled)(-fp8)?\.safetensors$", _ltx23("checkpoint"),
     ("LTXAVModel", "LTXAVModel.preprocess_text_embeds", "VideoVAE.decoder", "VideoVAE.encoder" + IMAGE,
      "AudioVAE.decode")),
    ("text_encoder", r"^gemma_3_12B_it(_fp4_mixed|_fp8_scaled)?\.safetensors$", _ltx23("gemma"),
     ("Gemma3_12B (gemma3_12b)",)),
    ("model_name", r"^ltx-2\.3-spatial-upscaler-x2-.*\.safetensors$", _ltx23("upsampler"), ()),
    ("lora_name", r"^ltx-2\.3-22b-distilled-lora|^ltx_2\.3_22b_distilled_.*lora", _ltx23("lora"), ()),
    ("lora_name", r"^gemma-3-12b-it-.*lora", _ltx23("gemma_lora"), ()),
    # --- LTX-2 (its checkpoints name its 19B transformer; the same Gemma 3 files) ---
    ("ckpt_name", r"^ltx-2-19b-(dev|distilled)(-fp8)?\.safetensors$", _ltx23("checkpoint 2.0"),
     ("LTXAVModel", "LTXAVModel.preprocess_text_embeds", "VideoVAE.decoder", "VideoVAE.encoder" + IMAGE,
      "AudioVAE.decode")),
    ("model_name", r"^ltx-2-spatial-upscaler-x2-.*\.safetensors$", _ltx23("upsampler"), ()),
    ("lora_name", r"^ltx-2-19b-distilled-lora-384\.safetensors$|^ltx2-squish\.safetensors$", _ltx23("lora 2.0"), ()),
    # --- LTX-2.5 (its transformer and VAEs in files of their own, Gemma 4) ---
    ("unet_name", r"^ltx-2\.5-22b-(dev|distilled)-transformer-comfy-int8-convrot\.safetensors$",
     _ltx25("ltx25_transformer"), ("LTXAVModel", "LTXAVModel.preprocess_text_embeds")),
    ("vae_name", r"^ltx-2\.5-video-vae-bf16\.safetensors$", _ltx25("ltx25_video_vae"),
     ("VideoVAE.decoder", "VideoVAE.encoder" + IMAGE)),
    ("vae_name", r"^ltx-2\.5-audio-vae-bf16\.safetensors$", _ltx25("ltx25_audio_vae"), ("AudioVAE.decode",)),
    ("clip_name", r"^gemma4-12b-with-proj-ltx-2\.5-comfy-int8-convrot\.safetensors$",
     _ltx25("gemma4_12b_with_projection"), ("Gemma4_12B (gemma3_12b)",)),
    # E2B is the prompt enhancer: its text is generated (TextGenerateLTX2Prompt, off in the templates), not encoded
    ("clip_name", r"^gemma4_e2b_it_int8_convrot\.safetensors$", _ltx25("gemma4_e2b"), ()),
    ("model_name", r"^ltx-2\.5-latent-spatial-upscaler-x2-.*\.safetensors$", _ltx23("upsampler"), ()),
)


def expected_parts(prompt: dict) -> set[str]:
    """The parts of a prompt's models that must run on the runtime (each must have its compiled/loaded line)."""
    images = any(n["class_type"] in ("LoadImage", "LoadVideo") for n in prompt.values())
    found = set()
    for input_name, names in widget_files(prompt).items():
        for name in names:
            entry = _file_entry(input_name, name)
            for part in entry[3] if entry else ():
                if not part.endswith(IMAGE):
                    found.add(part)
                elif images:
                    found.add(part[: -len(IMAGE)])
    return found


def w8a8(prompt: dict) -> bool:
    """Whether a prompt loads int8 files, whose layers ComfyUI and the runtime both run W8A8 (see ``compare``)."""
    return any("int8" in name for names in widget_files(prompt).values() for name in names)


def _file_entry(input_name: str, name: str):
    if "clip_vision" in name:  # Load CLIP Vision's input is named clip_name too
        input_name = "clip_vision"
    return next((e for e in MODEL_FILES if e[0] == input_name and re.search(e[1], name)), None)


def file_writer(input_name: str, name: str):
    """writer(path, seed, server) for a file a template's loader input asks for, or None: no tiny builder."""
    entry = _file_entry(input_name, name)
    found = entry[2] if entry else None
    if found is not None:
        return found
    if input_name == "unet_name" and diffusion_builder(name) is not None:
        def write(path, seed, server):
            from tpu_runtime.bridge.tiny import save_diffusion_model

            save_diffusion_model(diffusion_builder(name)(), path, seed=seed, dtype=torch.float16)
        return write
    if input_name == "lora_name" and re.search(r"Wan21_CausVid|wan2\.\d_.*lora|lightx2v_", name):
        return "wan_lora"  # made for the template's Wan model (the server knows which)
    return None


def missing_builders(prompt: dict) -> list[str]:
    """The model files of a prompt no tiny builder here makes (the reason a template is not in the test)."""
    return [name for input_name, names in widget_files(prompt).items() for name in sorted(names)
            if file_writer(input_name, name) is None]


def tiny_lora(module: torch.nn.Module, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """A LoRA in ComfyUI's key names for every attention and feed-forward matrix of a Wan model's blocks."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Linear) and re.match(r"blocks\.\d+\.(self_attn|cross_attn|ffn)", name):
            key = f"diffusion_model.{name}"
            out[f"{key}.lora_down.weight"] = torch.randn(rank, sub.in_features, generator=g) * 0.05
            out[f"{key}.lora_up.weight"] = torch.randn(sub.out_features, rank, generator=g) * 0.05
    return out


def write_image(path: Path, seed: int, size=(48, 64)) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray((rng.random((*size, 3)) * 255).astype(np.uint8)).save(path)


def write_video(path: Path, seed: int, frames: int = 9, size=(48, 64)) -> None:
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=16)
        stream.width, stream.height, stream.pix_fmt = size[1], size[0], "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray((rng.random((*size, 3)) * 255).astype(np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_audio(path: Path, seed: int, seconds: float = 1.0, rate: int = 16000) -> None:
    """A short random stereo clip as 16-bit PCM WAV (under any name the template gives it: ComfyUI's loader reads the
    content, not the extension)."""
    import wave

    rng = np.random.default_rng(seed)
    samples = (rng.standard_normal((int(seconds * rate), 2)) * 0.2 * 32767).clip(-32767, 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(2)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
