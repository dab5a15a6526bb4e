"""The example workflows as ComfyUI's page meets them: the Templates browser's card picture of each (the page asks
for ``<workflow>.jpg``), card titles and order (the page titles a custom node's templates by file name and lists
them as the server does, A to Z when sorted), the missing-model dialog's ``properties.models`` on every loader, and
workflows saved with the nodes' older inputs brought up to date when the page opens them."""

import asyncio
import copy
import json
import re
import sys
import types
from pathlib import Path

import pytest
from comfy_native import COMFYUI_TREES
from conftest import ROOT
from PIL import Image
from workflow_files import FOLDER, workflows

# Most-used families first (the order of the file names, so of the cards sorted A to Z).
FAMILY_ORDER = ("Wan 2.2", "Wan 2.1", "LTX-2", "HunyuanVideo", "LTX-Video", "CogVideoX")
TITLE = re.compile(r"^(\d\d) ([A-Za-z0-9 .-]+)$")  # letters a URL path carries as they are (spaces: %20)
# ComfyUI's loaders: the widget (by position) that names a model file -> the models/ folder its list comes from.
COMFY_LOADERS = {"UNETLoader": {0: "diffusion_models"}, "CLIPLoader": {0: "text_encoders"},
                 "DualCLIPLoader": {0: "text_encoders", 1: "text_encoders"}, "VAELoader": {0: "vae"},
                 "CheckpointLoaderSimple": {0: "checkpoints"}, "CLIPVisionLoader": {0: "clip_vision"},
                 "LoraLoaderModelOnly": {0: "loras"},
                 "LTXAVTextEncoderLoader": {0: "text_encoders", 1: "checkpoints"},
                 "LTXVAudioVAELoader": {0: "checkpoints"}}
FOLDER_LOADERS = {"TPUCogVideoXLoader", "TPUWanLoader", "TPULTX2Loader"}  # a diffusers folder: no single file
HUGGING_FACE_FILE = re.compile(r"^https://huggingface\.co/[\w.-]+/[\w.-]+/resolve/main/([\w./-]+)$")


@pytest.fixture(scope="module")
def classes():
    sys.path.insert(0, str(ROOT))
    from nodes import NODE_CLASS_MAPPINGS

    return NODE_CLASS_MAPPINGS


def test_the_server_lists_the_folder_and_the_page_asks_for_jpg_pictures():
    """ComfyUI's /workflow_templates lists a pack's workflows/*.json by file name (no index of titles) and serves
    the folder; the page asks for ``<name>.jpg`` as each card's picture and titles the card by the name."""
    for version, tree in COMFYUI_TREES.items():
        manager = (Path(tree) / "app" / "custom_node_manager.py").read_text()
        assert '"workflows"' in manager and 'os.path.splitext(os.path.basename(file))[0]' in manager, version
    try:
        import comfyui_frontend_package
    except ImportError:
        pytest.fail("comfyui-frontend-package is missing: pip install -e \".[test]\" (the test extra pins it)")
    scripts = (Path(comfyui_frontend_package.__file__).parent / "static" / "assets").glob("*.js")
    text = next(t for t in (p.read_text(errors="ignore") for p in scripts) if "getWorkflowTemplates" in t
                and "mediaSubtype" in t)
    assert re.search(r"""name:\s*\w+,\s*mediaType:\s*["`]image["`],\s*mediaSubtype:\s*["`]jpg["`]""", text)


def test_every_workflow_has_its_card_picture():
    names = {p.stem for p in workflows()}
    pictures = {p.stem for p in FOLDER.glob("*.jpg")}
    assert pictures == names, f"without a picture: {names - pictures}; without a workflow: {pictures - names}"
    assert {p.suffix for p in FOLDER.iterdir()} == {".json", ".jpg"}  # no .png the page would never ask for
    for name in names:
        with Image.open(FOLDER / f"{name}.jpg") as picture:
            assert picture.format == "JPEG" and picture.mode == "RGB", name
            width, height = picture.size
            assert 256 <= min(width, height) and max(width, height) <= 1280 and 0.75 <= width / height <= 1.8, name
        assert (FOLDER / f"{name}.jpg").stat().st_size < 200_000, name


def test_titles_and_order():
    """Card titles are the file names: "NN <model> <task>", numbered 01.. in the order a user would look for
    them (most-used families first), each family's workflows together; docs/workflows.md lists them so."""
    names = [p.stem for p in workflows()]
    numbers = []
    for name in names:
        match = TITLE.match(name)
        assert match, f"{name!r} is no title ('NN <model> <task>': letters, digits, spaces, '.', '-')"
        numbers.append(int(match.group(1)))
    assert numbers == list(range(1, len(names) + 1))
    ranks = [next(i for i, family in enumerate(FAMILY_ORDER) if TITLE.match(n).group(2).startswith(family))
             for n in names]
    assert ranks == sorted(ranks), list(zip(names, ranks))
    doc = (ROOT / "docs" / "workflows.md").read_text()
    places = [doc.find(f"`workflows/{name}.json`") for name in names]
    assert -1 not in places, [n for n, p in zip(names, places) if p == -1]
    assert places == sorted(places), "docs/workflows.md lists them in another order"


def _model_widgets(node: dict, classes: dict) -> dict[int, str]:
    """Widget position -> the models/ folder of each widget of ``node`` that names a model file."""
    if node["type"] in COMFY_LOADERS:
        return COMFY_LOADERS[node["type"]]
    cls = classes.get(node["type"])
    if cls is None or not (node["type"].endswith("ModelFilesLoader") or node["type"].endswith("LoRA")):
        return {}
    from nodes.migration import _layout

    widgets, _, _ = _layout(cls)
    if node["type"].endswith("LoRA"):
        return {widgets.index("lora_name"): "loras"}
    roles = {role.name: role for role in cls.SPEC.file_roles}
    files = cls.SPEC.nodes.files_loader
    entries = files.required + tuple(e for e in files.optional if isinstance(e, tuple))
    return {widgets.index(name): roles[role].folder for name, role, _ in entries if not roles[role].directory}


def test_every_loader_names_where_its_files_download(classes):
    """Every model file a loader's widget names has its entry in the node's properties.models (ComfyUI's missing-
    model dialog: name, url, directory), the URL a Hugging Face file whose name is the widget's value, in the
    folder the widget lists; a diffusers folder (no single file to download) is named in the workflow's note."""
    checked = 0
    for path in workflows():
        workflow = json.loads(path.read_text())
        notes = " ".join(n["widgets_values"][0] for n in workflow["nodes"] if n["type"] in ("Note", "MarkdownNote"))
        for node in workflow["nodes"]:
            where = f"{path.name}: {node['type']} #{node['id']}"
            models = (node.get("properties") or {}).get("models", [])
            if node["type"] in FOLDER_LOADERS:
                folder = node["widgets_values"][0]
                assert re.search(rf"repository [\w.-]+/{re.escape(folder)}\b", notes), where
                assert not models, where
                checked += 1
                continue
            named = {node["widgets_values"][i]: folder for i, folder in _model_widgets(node, classes).items()
                     if str(node["widgets_values"][i]).endswith(".safetensors")}
            assert {m["name"] for m in models} == set(named), where
            for model in models:
                assert set(model) == {"name", "url", "directory"}, where
                url = HUGGING_FACE_FILE.match(model["url"])
                assert url and url.group(1).split("/")[-1] == model["name"], (where, model)
                assert model["directory"] == named[model["name"]], (where, model)
                checked += 1
    assert checked > 60


OLD_WORKFLOW = {  # saved before version 2 of the inputs (the widget lists of that time)
    "last_node_id": 7, "last_link_id": 5, "version": 0.4,
    "nodes": [
        {"id": 1, "type": "TPUWanModelFilesLoader", "pos": [0, 0], "size": [400, 300], "order": 0, "inputs": [],
         "outputs": [{"name": "model", "type": "TPU_WAN_MODEL", "links": [1]}], "properties": {},
         "widgets_values": ["high.safetensors", "umt5.safetensors", "vae.safetensors", "bfloat16",
                            "low.safetensors", "dp=2,tp=4", "splash", "/cache/xla", "none", "width", True]},
        {"id": 2, "type": "TPUWanStepCache", "pos": [0, 400], "size": [300, 200], "order": 1,
         "inputs": [{"name": "model", "type": "TPU_WAN_MODEL", "link": 1}],
         "outputs": [{"name": "model", "type": "TPU_WAN_MODEL", "links": [3]}], "properties": {},
         "widgets_values": ["first-block", -1.0, 3, 0.2, "", False]},
        {"id": 3, "type": "TPUWanSampler", "pos": [500, 0], "size": [300, 400], "order": 2,
         "inputs": [{"name": "model", "type": "TPU_WAN_MODEL", "link": 3},
                    {"name": "embeds", "type": "TPU_WAN_EMBEDS", "link": None},
                    {"name": "frames", "type": "INT", "widget": {"name": "frames"}, "link": 4}],
         "outputs": [{"name": "samples", "type": "LATENT", "links": []}], "properties": {},
         "widgets_values": [1280, 720, 81, 40, 4.0, 42, "fixed", "unipc", 8.0, 3.0, 0.0]},
        {"id": 4, "type": "PrimitiveInt", "pos": [0, 700], "size": [200, 80], "order": 3, "inputs": [],
         "outputs": [{"name": "INT", "type": "INT", "links": [4]}], "properties": {}, "widgets_values": [81, "fixed"]},
        {"id": 5, "type": "TPUVAE", "pos": [0, 900], "size": [200, 80], "order": 4,
         "inputs": [{"name": "vae", "type": "VAE", "link": None},
                    {"name": "cache_dir", "type": "STRING", "widget": {"name": "cache_dir"}, "link": 5}],
         "outputs": [{"name": "vae", "type": "VAE", "links": []}], "properties": {},
         "widgets_values": ["auto", "auto", ""]},
        {"id": 6, "type": "PrimitiveString", "pos": [0, 1000], "size": [200, 80], "order": 5, "inputs": [],
         "outputs": [{"name": "STRING", "type": "STRING", "links": [5]}], "properties": {}, "widgets_values": ["x"]},
        {"id": 7, "type": "TPULTX2Sampler", "pos": [900, 0], "size": [300, 400], "order": 6, "inputs": [],
         "outputs": [{"name": "samples", "type": "LATENT", "links": []}], "properties": {},
         "widgets_values": [768, 512, 121, 3, 1.0, 5, "fixed", "model default", 1.0, 0.0, 1.0, 0.7, 24.0, "stage2",
                            0.5]},
    ],
    "links": [[1, 1, 0, 2, 0, "TPU_WAN_MODEL"], [3, 2, 0, 3, 0, "TPU_WAN_MODEL"],
              [4, 4, 0, 3, 2, "INT"], [5, 6, 0, 5, 1, "STRING"]],
}


def _named(node, cls) -> dict:
    from nodes.migration import _layout

    widgets, _, _ = _layout(cls)
    return dict(zip(widgets, node["widgets_values"]))


def _links_agree(workflow) -> None:
    nodes = {n["id"]: n for n in workflow["nodes"]}
    for link_id, origin, origin_slot, target, target_slot, _ in workflow["links"]:
        if target in nodes and origin in nodes:
            assert nodes[target]["inputs"][target_slot]["link"] == link_id, (link_id, nodes[target]["inputs"])
            assert link_id in nodes[origin]["outputs"][origin_slot]["links"], link_id


def test_a_workflow_saved_with_the_older_inputs_keeps_its_values(classes):
    from nodes.migration import MARK, VERSION, migrate_workflow

    migrated, notes = migrate_workflow(OLD_WORKFLOW, classes)
    nodes = {n["id"]: n for n in migrated["nodes"]}
    loader = _named(nodes[1], classes["TPUWanModelFilesLoader"])
    assert (loader["mesh"], loader["attention"], loader["clip_vision"], loader["vae_sharding"], loader["fsdp"]) == \
        ("dp=2,tp=4", "splash", "none", "width", True)  # the values after the removed cache_dir kept their widgets
    assert any("cache_dir dropped" in note and "TPUVideo.CacheDir" in note for note in notes)
    assert _named(nodes[2], classes["TPUWanStepCache"])["threshold"] == 0.05  # first-block's default, written out
    sampler = _named(nodes[3], classes["TPUWanSampler"])
    assert (sampler["length"], sampler["cfg"], sampler["seed:control"], sampler["scheduler"]) == \
        (81, 4.0, "fixed", "unipc")
    inputs = {entry["name"]: entry for entry in nodes[3]["inputs"]}
    assert inputs["length"]["widget"] == {"name": "length"} and inputs["length"]["link"] == 4  # renamed, linked
    floats = {n["title"]: n for n in migrated["nodes"] if n["type"] == "PrimitiveFloat"}
    assert set(floats) == {"shift", "cfg_2", "noise_scale"} and floats["shift"]["widgets_values"] == [8.0]
    assert inputs["boundary"]["link"] is None  # 0: the model's, so left unconnected
    for name in ("shift", "cfg_2"):
        link = next(l for l in migrated["links"] if l[0] == inputs[name]["link"])
        assert link[1] == floats[name]["id"] and floats[name]["order"] < nodes[3]["order"]
    ltx = _named(nodes[7], classes["TPULTX2Sampler"])
    assert (ltx["audio_cfg"], ltx["sigmas"]) == (1.0, "stage2") and "noise_scale" not in ltx
    assert [e["name"] for e in nodes[5]["inputs"]] == ["vae"] and 5 not in {l[0] for l in migrated["links"]}
    assert nodes[6]["outputs"][0]["links"] == []  # the String node that fed cache_dir keeps no dangling link
    _links_agree(migrated)
    assert all(n["properties"][MARK] == VERSION for n in migrated["nodes"] if n["type"].startswith("TPU"))
    assert migrate_workflow(migrated, classes) == (migrated, [])  # marked: left as it is
    assert OLD_WORKFLOW["nodes"][2]["widgets_values"][2] == 81  # the input was not changed in place


def test_the_example_workflows_have_todays_inputs(classes):
    from nodes.migration import MARK, ROUTE, VERSION, migrate_workflow

    for path in workflows():
        workflow = json.loads(path.read_text())
        assert migrate_workflow(workflow, classes)[0] == workflow, path.name
        assert all((n.get("properties") or {}).get(MARK) == VERSION for n in workflow["nodes"] if n["type"] in classes)
        _links_agree(workflow)
    script = (ROOT / "web" / "tpu_video_widgets.js").read_text()
    assert f'const MARK = "{MARK}"' in script and f"const VERSION = {VERSION};" in script
    assert f'const ROUTE = "{ROUTE}"' in script and "beforeConfigureGraph" in script


def test_the_page_reaches_the_migration_through_the_server(classes, monkeypatch):
    """``POST /tpu_video/migrate_workflow`` on ComfyUI's server (as the pack's import adds it) answers with the
    workflow brought up to date and what changed."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from nodes.migration import ROUTE, install_route

    server = types.ModuleType("server")
    server.PromptServer = types.SimpleNamespace(instance=types.SimpleNamespace(routes=web.RouteTableDef()))
    monkeypatch.setitem(sys.modules, "server", server)
    assert install_route(classes)

    async def post():
        app = web.Application()
        app.add_routes(server.PromptServer.instance.routes)
        async with TestClient(TestServer(app)) as client:
            answer = await client.post(ROUTE, json=copy.deepcopy(OLD_WORKFLOW))
            refused = await client.post(ROUTE, data="not json")
            return answer.status, await answer.json(), refused.status

    status, body, refused = asyncio.run(post())
    assert status == 200 and refused == 400
    assert body["workflow"]["nodes"][0]["properties"]["tpu_video_inputs"] == 2 and body["notes"]
