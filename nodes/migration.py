"""Workflows saved before the nodes' inputs changed, brought to today's inputs when ComfyUI's page opens them.

ComfyUI's page puts a saved node's widget values back by position (``widgets_values`` is a list), so an input that
is renamed keeps its value, but one that is removed, or that stops being a widget, moves every value after it onto
the wrong widget. Version 2 of the inputs (the marker ``MARK`` in a node's properties) changed:

- ``cache_dir`` left every loader and bridge node: the compilation cache folder is one per process, a setting of
  ComfyUI's settings dialog (``TPUVideo.CacheDir``, ``tpu_runtime/bridge/settings_store.py``);
- ComfyUI's own names: the sampler's ``frames`` -> ``length`` and ``guidance`` -> ``cfg`` (Image Encode's
  ``frames`` -> ``length``), Wan's ``guidance_2`` -> ``cfg_2``, LTX-2's ``audio_guidance`` -> ``audio_cfg``;
- values the model decides are inputs left unconnected instead of widgets holding a magic value (Wan's ``shift``
  0, ``guidance_2`` -1, ``boundary`` 0; the refining sampler's ``noise_scale`` -1): a value that was set comes
  from a Float node (ComfyUI's ``PrimitiveFloat``) the migration adds and connects;
- the Step Cache's ``threshold`` -1 (the method's default) is that default written out (magcache 0.06,
  first-block 0.05);
- Image Encode gives the video's ``width``, ``height`` and ``length`` as outputs too.

``web/tpu_video_widgets.js`` sends a workflow holding nodes of this pack without the marker to
``POST /tpu_video/migrate_workflow`` (``install_route``) before the page builds the graph, and shows what changed.
Nodes saved with today's inputs (the marker set) are left as they are.
"""

from __future__ import annotations

import copy
import logging

log = logging.getLogger(__name__)

MARK = "tpu_video_inputs"
VERSION = 2
ROUTE = "/tpu_video/migrate_workflow"
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")

# Each node's widgets before version 2, in order (":control" is the value ComfyUI keeps after a seed widget).
_SAMPLER = ["width", "height", "frames", "steps", "guidance", "seed", "seed:control", "scheduler"]
_LOADER = ["model", "dtype", "model_path", "mesh", "attention", "cache_dir", "vae_sharding", "fsdp"]
PREVIOUS_WIDGETS = {
    "TPUCogVideoXLoader": _LOADER,
    "TPUWanLoader": _LOADER,
    "TPULTX2Loader": _LOADER + ["upsampler"],
    "TPUWanModelFilesLoader": ["diffusion_model", "text_encoder", "vae", "dtype", "diffusion_model_2", "mesh",
                               "attention", "cache_dir", "clip_vision", "vae_sharding", "fsdp"],
    "TPULTX2ModelFilesLoader": ["checkpoint", "text_encoder", "dtype", "latent_upscaler", "mesh", "attention",
                                "cache_dir", "vae_sharding", "fsdp", "config"],
    "TPUCogVideoXImageEncode": ["width", "height", "frames"],
    "TPUWanImageEncode": ["width", "height", "frames"],
    "TPULTX2ImageEncode": ["width", "height", "frames"],
    "TPUCogVideoXSampler": _SAMPLER + ["dynamic_cfg"],
    "TPUWanSampler": _SAMPLER + ["shift", "guidance_2", "boundary"],
    "TPULTX2Sampler": _SAMPLER + ["audio_guidance", "stg_scale", "modality_scale", "guidance_rescale", "frame_rate",
                                  "sigmas", "noise_scale"],
    "TPUDiffusionModel": ["mesh", "attention", "compute_dtype", "cache_dir"],
    "TPUVAE": ["mesh", "attention", "cache_dir"],
    "TPUTextEncoder": ["mesh", "attention", "cache_dir"],
    "TPUCLIPVision": ["mesh", "attention", "cache_dir"],
}
RENAMED = {"frames": "length", "guidance": "cfg", "guidance_2": "cfg_2", "audio_guidance": "audio_cfg"}
REMOVED = {"cache_dir": "the compilation cache folder is now ComfyUI's setting TPUVideo.CacheDir (Settings > TPU "
                        "video)"}
# Values that meant "the model's" on a widget that is now an input left unconnected.
UNSET = {"shift": 0.0, "cfg_2": -1.0, "boundary": 0.0, "noise_scale": -1.0}
STEP_CACHE_THRESHOLDS = {"magcache": 0.06, "first-block": 0.05}  # what threshold -1 meant, by method
FLOAT_NODE = "PrimitiveFloat"  # ComfyUI's Float node (comfy_extras/nodes_primitive.py)


def _layout(cls) -> tuple[list[str], dict, list[tuple[str, str]]]:
    """Today's widgets of node class ``cls`` in order (with ":control" after a seed), each widget's options, and
    its inputs without a widget (name, type) in order."""
    widgets, options, sockets = [], {}, []
    spec = cls.INPUT_TYPES()
    for section in ("required", "optional"):
        for name, entry in spec.get(section, {}).items():
            kind, opts = entry[0], (entry[1] if len(entry) > 1 else {}) or {}
            if (isinstance(kind, list) or kind in WIDGET_TYPES) and not opts.get("forceInput"):
                widgets.append(name)
                options[name] = (kind, opts)
                if opts.get("control_after_generate"):
                    widgets.append(name + ":control")
            else:
                sockets.append((name, kind))
    return widgets, options, sockets


def _input_order(cls) -> list[str]:
    spec = cls.INPUT_TYPES()
    return [name for section in ("required", "optional") for name in spec.get(section, {})]


def _default(kind, opts):
    if "default" in opts:
        return opts["default"]
    return kind[0] if isinstance(kind, list) and kind else None


class _Graph:
    """One graph's (or subgraph's) nodes and links, with fresh node and link ids."""

    def __init__(self, graph: dict, ids: dict):
        self.graph, self.ids = graph, ids
        self.links = graph.setdefault("links", [])
        self.nodes = {node["id"]: node for node in graph.get("nodes", [])}

    def new_id(self, kind: str) -> int:
        self.ids[kind] += 1
        return self.ids[kind]

    def drop_link(self, link_id) -> None:
        for entry in list(self.links):
            if (entry[0] if isinstance(entry, list) else entry.get("id")) == link_id:
                self.links.remove(entry)
                origin = entry[1] if isinstance(entry, list) else entry.get("origin_id")
                for output in self.nodes.get(origin, {}).get("outputs", []):
                    if link_id in (output.get("links") or []):
                        output["links"].remove(link_id)

    def reorder(self) -> None:
        """Each node's ``order`` after every node it takes an input from (as the page would compute it), the saved
        order kept among nodes free to run."""
        sources = {node_id: set() for node_id in self.nodes}
        for link in self.links:
            origin, target = (link[1], link[3]) if isinstance(link, list) else (link.get("origin_id"),
                                                                               link.get("target_id"))
            if origin in self.nodes and target in self.nodes:
                sources[target].add(origin)
        placed, order = set(), 0
        pending = sorted(self.nodes.values(), key=lambda n: n.get("order", 0))
        while pending:
            ready = [n for n in pending if sources[n["id"]] <= placed] or pending[:1]  # a cycle: keep going
            node = ready[0]
            node["order"], order = order, order + 1
            placed.add(node["id"])
            pending.remove(node)

    def retarget(self, node: dict, inputs: list) -> None:
        """Point the links into ``node`` at its inputs' positions in ``inputs``."""
        slots = {entry["link"]: slot for slot, entry in enumerate(inputs) if entry.get("link") is not None}
        for link in self.links:
            if isinstance(link, list) and link[3] == node["id"] and link[0] in slots:
                link[4] = slots[link[0]]
            elif isinstance(link, dict) and link.get("target_id") == node["id"] and link.get("id") in slots:
                link["target_slot"] = slots[link["id"]]

    def add_float(self, node: dict, slot: int, name: str, value: float) -> None:
        """A Float node holding ``value``, under ``node`` (below any added before), connected to its input ``slot``."""
        float_id, link_id = self.new_id("node"), self.new_id("link")
        x, y = node.get("pos", [0, 0])[:2]
        below = y + (node.get("size") or [0, 300])[1] + 40
        below += 90 * sum(1 for n in self.graph["nodes"] if n.get("type") == FLOAT_NODE and n.get("pos", [None])[0] == x
                          and n["pos"][1] >= below)
        self.graph["nodes"].append({
            "id": float_id, "type": FLOAT_NODE, "pos": [x, below], "size": [230, 60], "flags": {},
            "order": node.get("order", 0), "mode": 0, "inputs": [],
            "outputs": [{"name": "FLOAT", "type": "FLOAT", "links": [link_id]}],
            "properties": {"Node name for S&R": FLOAT_NODE}, "title": name, "widgets_values": [value]})
        self.nodes[float_id] = self.graph["nodes"][-1]
        if self.links and isinstance(self.links[0], dict):
            self.links.append({"id": link_id, "origin_id": float_id, "origin_slot": 0, "target_id": node["id"],
                               "target_slot": slot, "type": "FLOAT"})
        else:
            self.links.append([link_id, float_id, 0, node["id"], slot, "FLOAT"])


def _migrate_node(node: dict, cls, graph: _Graph, notes: list[str]) -> None:
    kind = node["type"]
    where = f"{kind} #{node.get('id')}"
    widgets, options, sockets = _layout(cls)
    saved = node.get("widgets_values")
    if isinstance(saved, dict):  # widget values saved by name
        values = {RENAMED.get(k, k): v for k, v in saved.items()}
    else:
        previous = PREVIOUS_WIDGETS.get(kind, widgets)
        values = {RENAMED.get(name, name): value for name, value in zip(previous, saved or [])}
    for name in list(values):
        if name in REMOVED:
            if values.pop(name) not in ("", None):
                notes.append(f"{where}: {name} dropped: {REMOVED[name]}")
    if kind.endswith("StepCache") and isinstance(values.get("threshold"), (int, float)) and values["threshold"] < 0:
        values["threshold"] = STEP_CACHE_THRESHOLDS.get(values.get("method"), STEP_CACHE_THRESHOLDS["magcache"])
    # inputs: renamed ones keep their links, removed ones lose theirs, the new inputs without a widget are added,
    # all in the order of today's definition (a link names its target input by position)
    inputs = node.setdefault("inputs", [])
    socket_names = {name for name, _ in sockets}
    for entry in list(inputs):
        entry["name"] = RENAMED.get(entry["name"], entry["name"])
        if isinstance(entry.get("widget"), dict):
            entry["widget"]["name"] = RENAMED.get(entry["widget"]["name"], entry["widget"]["name"])
        if entry["name"] in socket_names:  # was a widget, is now an input without one
            entry.pop("widget", None)
        if entry["name"] in REMOVED:
            if entry.get("link") is not None:
                graph.drop_link(entry["link"])
            inputs.remove(entry)
    present = {entry["name"] for entry in inputs}
    for name, socket_type in sockets:
        if name not in present:
            optional = name in cls.INPUT_TYPES().get("optional", {})
            inputs.append({"name": name, "type": socket_type if isinstance(socket_type, str) else "COMBO",
                           **({"shape": 7} if optional else {}), "link": None})
    order = {name: i for i, name in enumerate(_input_order(cls))}
    inputs.sort(key=lambda entry: order.get(entry["name"], len(order)))
    graph.retarget(node, inputs)
    for name, value in list(values.items()):
        if name in options or name.endswith(":control"):
            continue
        values.pop(name)
        if name in UNSET and isinstance(value, (int, float)) and not isinstance(value, bool) and value != UNSET[name]:
            slot = next(i for i, entry in enumerate(inputs) if entry["name"] == name)
            if inputs[slot].get("link") is None:
                graph.add_float(node, slot, name, value)
                inputs[slot]["link"] = graph.ids["link"]
                notes.append(f"{where}: {name} {value} now comes from a Float node connected to its {name} input "
                             "(unconnected means the model's value)")
    new_values = []
    for name in widgets:
        if name.endswith(":control"):
            new_values.append(values.get(name, "fixed"))
        else:
            new_values.append(values[name] if name in values else _default(*options[name]))
    node["widgets_values"] = new_values
    returns = list(getattr(cls, "RETURN_TYPES", ()))
    names = list(getattr(cls, "RETURN_NAMES", returns))
    outputs = node.setdefault("outputs", [])
    for index in range(len(outputs), len(returns)):
        outputs.append({"name": names[index], "type": returns[index], "links": []})
    node.setdefault("properties", {})[MARK] = VERSION


def migrate_workflow(workflow: dict, classes: dict) -> tuple[dict, list[str]]:
    """``workflow`` (ComfyUI's UI format, with its subgraphs) with every node of ``classes`` (class name -> node
    class) saved before today's inputs brought to them, and a note per value that moved or was dropped. Nodes
    already marked, and other packs' nodes, are left as they are."""
    workflow = copy.deepcopy(workflow)
    notes: list[str] = []
    ids = {"node": int(workflow.get("last_node_id") or 0), "link": int(workflow.get("last_link_id") or 0)}
    for graph in [workflow, *((workflow.get("definitions") or {}).get("subgraphs") or [])]:
        for node in graph.get("nodes", []):
            ids["node"] = max(ids["node"], int(node["id"]) if str(node["id"]).isdigit() else 0)
        for link in graph.get("links", []):
            link_id = link[0] if isinstance(link, list) else link.get("id")
            ids["link"] = max(ids["link"], int(link_id) if str(link_id).isdigit() else 0)
    for graph in [workflow, *((workflow.get("definitions") or {}).get("subgraphs") or [])]:
        view = _Graph(graph, ids)
        changed = False
        for node in list(graph.get("nodes", [])):
            cls = classes.get(node.get("type"))
            if cls is None or (node.get("properties") or {}).get(MARK) == VERSION:
                continue
            _migrate_node(node, cls, view, notes)
            changed = True
        if changed:
            view.reorder()
    if "last_node_id" in workflow:
        workflow["last_node_id"] = ids["node"]
    if "last_link_id" in workflow:
        workflow["last_link_id"] = ids["link"]
    return workflow, notes


def install_route(classes: dict) -> bool:
    """``POST /tpu_video/migrate_workflow`` on ComfyUI's server: a workflow in, ``{"workflow", "notes"}`` out.
    Returns whether a server was there to add it to."""
    try:
        from aiohttp import web
        from server import PromptServer
    except ImportError:
        return False
    server = getattr(PromptServer, "instance", None)
    if server is None:
        return False

    @server.routes.post(ROUTE)
    async def migrate(request):
        try:
            workflow = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not a workflow (JSON)"}, status=400)
        migrated, notes = migrate_workflow(workflow, classes)
        for note in notes:
            log.info("workflow opened with older TPU video inputs: %s", note)
        return web.json_response({"workflow": migrated, "notes": notes})

    return True
