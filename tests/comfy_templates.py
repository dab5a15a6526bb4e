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
MODEL_TYPES = ("MODEL", "CLIP", "VAE", "CLIP_VISION")
TPU_NODES = {"MODEL": "TPUDiffusionModel", "CLIP": "TPUTextEncoder", "VAE": "TPUVAE", "CLIP_VISION": "TPUCLIPVision"}


def templates_dir() -> Path:
    try:
        import comfyui_workflow_templates_json as package
    except ImportError as error:
        raise RuntimeError("the workflow templates are not installed: pip install "
                           "comfyui-workflow-templates-json==0.1.123 (the test extra)") from error
    return Path(package.__file__).parent / "templates"


def video_templates() -> dict[str, dict]:
    """name -> workflow of every template in the package's Video category that runs locally (not a paid API's)."""
    folder = templates_dir()
    index = json.loads((folder / "index.json").read_text())
    video = next(c for c in index if c.get("type") == "video" and c.get("title") == "Video")
    out = {}
    for entry in video["templates"]:
        path = folder / f"{entry['name']}.json"
        if path.is_file() and not entry["name"].startswith("api_") and "API" not in entry.get("tags", []):
            out[entry["name"]] = json.loads(path.read_text())
    return out


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
        for link in graph["links"]:
            link_id, origin, origin_slot, target, target_slot, kind = (
                (link["id"], link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"],
                 link.get("type")) if isinstance(link, dict) else link[:6])
            if target == -20:
                inner_out[target_slot] = (prefix + str(origin), origin_slot)
                continue
            if origin == -10:
                if origin_slot not in outer_in:
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
            if isinstance(kind, list) or kind in WIDGET_TYPES or kind == DYNAMIC_COMBO:
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
        inputs.update(node.get("_overrides", {}))  # a subgraph instance's values for its promoted widgets
        for inp in node.get("inputs", []):
            if inp.get("link") is None:
                continue
            found = source(inp["link"])
            if found is None:
                continue
            inputs[inp["name"]] = found[1] if found[0] == "value" else list(found)
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
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
    """Every node's width / height / length widgets and step counts set small (a two-expert split scaled along)."""
    for node in prompt.values():
        inputs = node["inputs"]
        names = {n for n, _ in _widget_names(object_info[node["class_type"]])}
        for name, value in (("width", width), ("height", height), ("length", length)):
            source = inputs.get(name)
            if isinstance(source, list) and prompt.get(source[0], {}).get("class_type") in PRIMITIVES:
                prompt[source[0]]["inputs"]["value"] = value  # a primitive node feeding the size (VACE outpainting)
            elif name in names and not isinstance(source, list):
                inputs[name] = value
        if "steps" in names and isinstance(inputs.get("steps"), int):
            old = inputs["steps"]
            inputs["steps"] = steps
            for name in ("start_at_step", "end_at_step"):
                if isinstance(inputs.get(name), int) and inputs[name] <= old:
                    inputs[name] = round(inputs[name] * steps / old)
    return prompt


def observe(prompt: dict, prefix: str) -> dict:
    """SaveLatent on the latents every VAE decode takes and SaveImage on the frames it gives (exact floats and 8-bit
    PNGs to compare; the template's own nodes and links are left as they are)."""
    for node_id, node in list(prompt.items()):
        if node["class_type"] in ("VAEDecode", "VAEDecodeTiled"):
            prompt[f"{node_id}_latent"] = {"class_type": "SaveLatent", "inputs": {
                "samples": node["inputs"]["samples"], "filename_prefix": f"{prefix}/n{node_id}/latent"}}
            prompt[f"{node_id}_frames"] = {"class_type": "SaveImage", "inputs": {
                "images": [node_id, 0], "filename_prefix": f"{prefix}/n{node_id}/frame"}}
    return prompt


def loader_outputs(class_type: str, object_info: dict) -> list[tuple[int, str]]:
    """(slot, type) of a loader's model outputs: a node with no MODEL / CLIP / VAE / CLIP_VISION input."""
    info = object_info[class_type]
    takes = {spec[0] for section in ("required", "optional") for spec in info["input"].get(section, {}).values()
             if isinstance(spec[0], str)}
    if takes & set(MODEL_TYPES):
        return []
    return [(i, t) for i, t in enumerate(info["output"]) if t in MODEL_TYPES]


def insert_tpu_nodes(prompt: dict, object_info: dict) -> dict:
    """The three (four) TPU nodes right after every loader, every consumer of a loader's model output rewired."""
    for node_id, node in list(prompt.items()):
        for slot, kind in loader_outputs(node["class_type"], object_info):
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


FOLDERS = {"unet_name": "diffusion_models", "clip_name": "text_encoders", "vae_name": "vae",
           "lora_name": "loras", "ckpt_name": "checkpoints"}
KNOWN_FILES = (r"^umt5_xxl_.*\.safetensors$", r"^(wan_2\.1_vae|Wan2_1_VAE_bf16)\.safetensors$",
               r"^clip_vision_h\.safetensors$")


def missing_builders(prompt: dict) -> list[str]:
    """The model files of a prompt no tiny builder here makes (the reason a template is not in the test)."""
    missing = []
    for input_name, names in widget_files(prompt).items():
        for name in sorted(names):
            if input_name == "unet_name" and diffusion_builder(name) is None:
                missing.append(name)
            elif input_name == "lora_name" and not re.search(r"Wan21_CausVid|wan2\.\d_.*lora|lightx2v_", name):
                missing.append(name)
            elif input_name not in ("unet_name", "lora_name") and not any(re.search(p, name) for p in KNOWN_FILES):
                missing.append(name)
    return missing


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
