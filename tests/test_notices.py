"""Every host fallback of the automatic mode and every model it refuses is shown in the page as well as in the log:
the runtime hands each notice to the listener the pack's nodes install at load, which sends it through ComfyUI's
server as the event ``tpu_video.notice`` (with the node that was running, to the client that queued the prompt); the
page's extension (``web/tpu_video_notices.js``, run here in Node.js with stand-ins for ComfyUI's ``app`` and ``api``)
shows it as a toast and above the node."""

import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import types

import pytest
import torch
from conftest import ROOT

from tpu_runtime.engine import notices
from tpu_runtime.errors import InputError


class FakePromptServer:
    """What the pack uses of ComfyUI's ``server.PromptServer.instance``."""

    def __init__(self):
        from aiohttp import web

        self.last_node_id = "12"
        self.client_id = "client-1"
        self.sent = []
        self.routes = web.RouteTableDef()  # the pack adds its route for older workflows here

    def send_sync(self, event, data, sid=None):
        self.sent.append((event, data, sid))


@pytest.fixture
def server(monkeypatch):
    """A ComfyUI server in this process, and the pack loaded as ComfyUI loads it (its listener the only one)."""
    module = types.ModuleType("server")
    module.PromptServer = type("PromptServer", (), {"instance": FakePromptServer()})
    monkeypatch.setitem(sys.modules, "server", module)
    monkeypatch.setattr(notices, "_listeners", [])
    name = "tpu_video_nodes_notices"
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, key)
    spec = importlib.util.spec_from_file_location(name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    pack = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, pack)
    spec.loader.exec_module(pack)
    assert notices._listeners == [sys.modules[f"{name}.nodes.comfy_bridge"].send_notice]  # installed at load
    return module.PromptServer.instance


class _Bridged:
    label = "NoticeTestModel"


class _UntraceableForward:
    """A bridged forward whose model the runtime cannot compile."""

    def __init__(self):
        self.bridged = _Bridged()
        self.released = False

    def __call__(self, *args, **kwargs):
        from tpu_runtime.bridge.program import UntraceableModel

        raise UntraceableModel("NoticeTestModel cannot run on the TPU runtime: the op aten::foo has no JAX lowering")

    def release(self):
        self.released = True


def test_a_host_fallback_reaches_the_page_with_the_running_node(server, caplog):
    from tpu_runtime.bridge.auto import HostFallback

    module = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger="tpu_runtime.bridge.auto"):
        out = HostFallback(_UntraceableForward(), module, "forward")(x)
    assert torch.equal(out, module(x))  # ComfyUI's own code ran it on the host
    text = ("automatic mode: NoticeTestModel runs on the host: NoticeTestModel cannot run on the TPU runtime: the op "
            "aten::foo has no JAX lowering")
    assert server.sent == [("tpu_video.notice", {"text": text, "level": "warning", "node": "12"}, "client-1")]
    assert text in caplog.text


def test_a_refused_model_reaches_the_page(server, monkeypatch, caplog):
    from tpu_runtime.bridge import auto, diffusion

    class NoticeTestPatcher:
        pass

    def refuse(value, settings):
        raise InputError("no rule table fits NoticeTestPatcher")

    monkeypatch.setattr(diffusion, "diffusion_model_on_runtime", refuse)
    value = NoticeTestPatcher()
    with caplog.at_level(logging.WARNING, logger="tpu_runtime.bridge.auto"):
        assert auto.on_runtime("model", value, "UNETLoader") is value
    text = "automatic mode: UNETLoader's model output stays on the host: no rule table fits NoticeTestPatcher"
    assert server.sent == [("tpu_video.notice", {"text": text, "level": "warning", "node": "12"}, "client-1")]
    assert text in caplog.text


def _comfy_bridge():
    """nodes/comfy_bridge.py on its own (ComfyUI's nodes.py may hold the name ``nodes`` in this process)."""
    spec = importlib.util.spec_from_file_location("tpu_video_comfy_bridge", ROOT / "nodes" / "comfy_bridge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_server_a_notice_is_in_the_log_only(monkeypatch, caplog):
    comfy_bridge = _comfy_bridge()
    monkeypatch.delitem(sys.modules, "server", raising=False)
    monkeypatch.setattr(notices, "_listeners", [comfy_bridge.send_notice])
    log = logging.getLogger("tpu_runtime.notice_test")
    with caplog.at_level(logging.WARNING, logger=log.name):
        notices.warn(log, "a model stays on the host")
    assert "a model stays on the host" in caplog.text
    assert comfy_bridge.send_notice("x") is False


# --- the page ---------------------------------------------------------------------------------------------------------
APP_STUB = """
export const app = {
  extensions: [],
  registerExtension(extension) { this.extensions.push(extension); },
  extensionManager: { toast: { added: [], add(message) { this.added.push(message); } } },
  graph: {
    byId: { 12: { title: "KSampler", dirty: 0, setDirtyCanvas() { this.dirty += 1; } } },
    getNodeById(id) { return this.byId[id] ?? null; },
    get _nodes() { return Object.values(this.byId); },
  },
};
"""
API_STUB = "export const api = new EventTarget();\n"
DRIVER = """
import { app } from "./scripts/app.js";
import { api } from "./scripts/api.js";
const extension = await import("./extensions/tpu-video-nodes/tpu_video_notices.js");
const registered = app.extensions.map((e) => e.name);
for (const e of app.extensions) e.setup?.();
const node = app.graph.getNodeById(12);
const detail = { text: "automatic mode: WanModel runs on the host: the op aten::foo has no JAX lowering",
                 level: "warning", node: "12" };
api.dispatchEvent(new CustomEvent(extension.NOTICE_EVENT, { detail }));
const drawn = [];
node.onDrawForeground({ save() {}, restore() {}, fillText(text) { drawn.push(text); } });
const marked = node.tpuVideoNotice;
const toasts = app.extensionManager.toast.added.slice();
delete app.extensionManager;  // an older frontend: no toasts, still the console and the node
api.dispatchEvent(new CustomEvent(extension.NOTICE_EVENT, { detail: { text: "second", node: 12 } }));
const markedWithoutToasts = node.tpuVideoNotice;
api.dispatchEvent(new CustomEvent("execution_start", { detail: {} }));
console.log(JSON.stringify({ registered, event: extension.NOTICE_EVENT, toasts, marked, markedWithoutToasts,
                             drawn, cleared: node.tpuVideoNotice, dirty: node.dirty }));
"""


def _node() -> str:
    node = shutil.which("node")
    assert node, "Node.js runs the page's extension in this test: install it (apt-get install nodejs)"
    return node


def test_the_page_shows_a_notice_as_a_toast_and_on_its_node(tmp_path):
    """The extension file loads as the frontend loads it (an ES module importing ComfyUI's ``app`` and ``api``),
    registers its listener for the event the server sends, and shows a notice as a toast and above its node (without
    toasts too); the next prompt clears the node's."""
    NOTICE_EVENT = _comfy_bridge().NOTICE_EVENT
    (tmp_path / "package.json").write_text('{"type": "module"}')
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text(APP_STUB)
    (tmp_path / "scripts" / "api.js").write_text(API_STUB)
    (tmp_path / "extensions" / "tpu-video-nodes").mkdir(parents=True)
    shutil.copy(ROOT / "web" / "tpu_video_notices.js", tmp_path / "extensions" / "tpu-video-nodes")
    (tmp_path / "driver.js").write_text(DRIVER)
    out = subprocess.run([_node(), "driver.js"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    text = "automatic mode: WanModel runs on the host: the op aten::foo has no JAX lowering"
    assert result["registered"] == ["TPUVideo.Notices"] and result["event"] == NOTICE_EVENT
    assert result["toasts"] == [{"severity": "warn", "summary": "TPU video", "detail": text, "life": 20000}]
    assert result["marked"] == text and result["drawn"] == [f"TPU video: {text}"]
    assert result["markedWithoutToasts"] == "second" and result["cleared"] is None and result["dirty"] == 3
    assert f"TPU video: {text}" in out.stderr  # console.warn
