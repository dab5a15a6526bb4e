"""Compile progress on the node (``engine/progress.py`` and the node layer's listener in ``nodes/comfy_bridge.py``):
while the runtime compiles a program, ComfyUI's progress text of the running node says what and for how long; a
program from the persistent compilation cache or the saved programs says so; a program the runtime holds in memory
says nothing.

ComfyUI's server is a stand-in here (``server.PromptServer.instance`` with ``send_progress_text`` and
``last_node_id``, as both pinned trees have them); the browser test (test_page.py) sees the text on a real page."""

import itertools
import sys
import time
import types

import pytest
import torch

from tpu_runtime.engine import progress
from tpu_runtime.engine.program_key import ProgramKey, describe_module
from tpu_runtime.engine.program_store import ProgramStore

_calls = itertools.count()


class FakeServer:
    """What the pack uses of ComfyUI's PromptServer for progress text."""

    def __init__(self):
        self.last_node_id = "12"
        self.client_id = "page"
        self.sent: list[tuple[str, str, str]] = []

    def send_progress_text(self, text, node_id, sid=None):
        self.sent.append((text, node_id, sid))


@pytest.fixture
def server(monkeypatch):
    """A running ComfyUI server as far as the node layer can tell, its listener installed as at the pack's load."""
    from nodes.comfy_bridge import _progress_on_the_node, executing_node, show_compile_progress_on_the_node

    fake = FakeServer()
    module = types.ModuleType("server")
    module.PromptServer = types.SimpleNamespace(instance=fake)
    monkeypatch.setitem(sys.modules, "server", module)
    monkeypatch.setattr(progress, "TICK", 0.05)
    # Only this copy's listener: the pack may be imported a second time under its folder's name (pytest imports a
    # checkout's root __init__.py as a package), whose listener would send every line again.
    monkeypatch.setattr(progress, "_listeners", [])
    show_compile_progress_on_the_node()
    yield fake
    progress.remove_listener(_progress_on_the_node)
    assert progress._context is executing_node
    progress.set_context(None)


def test_a_first_run_shows_the_compile_on_the_node_and_a_program_in_memory_nothing(runtime, server):
    x = runtime.put(torch.ones(4, 4))
    key = ("compile progress test", next(_calls))
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    forward = module.forward

    def slow_forward(*inputs):  # a trace of 0.3 s: long enough for the running lines
        time.sleep(0.3)
        return forward(*inputs)

    module.forward = slow_forward
    args = (runtime.module_state(module), x)
    fn = runtime.module_function(module)
    runtime.compiled(key, fn, *args, describe="a test program (4x4)")
    texts = [text for text, node, sid in server.sent]
    assert {node for _, node, _ in server.sent} == {"12"} and {sid for *_, sid in server.sent} == {"page"}
    assert texts[0] == "Compiling a test program (4x4)… 0 s", texts
    assert len(texts) >= 4, texts  # the start, lines while it traced (0.3 s at 0.05 s a line), the end
    assert all(t.startswith("Compiling a test program (4x4)… ") and t.endswith(" s") for t in texts[:-1]), texts
    last = texts[-1]
    assert last.startswith(("Compiled a test program (4x4) in ",
                            "Loaded a test program (4x4) from the persistent compilation cache in ")), last
    seconds = float(last.rsplit(" in ", 1)[1].split()[0])
    assert seconds >= 0.3, last

    server.sent.clear()
    runtime.compiled(key, fn, *args, describe="a test program (4x4)")  # in memory now: nothing to show
    time.sleep(0.2)  # a ticker left running would have sent a line by now
    assert server.sent == []


def test_the_node_of_the_running_prompt_gets_the_text(runtime, server, monkeypatch):
    """ComfyUI's execution context names the node where the server has one (0.3.64 and 0.33 both do)."""
    utils = types.ModuleType("comfy_execution.utils")
    utils.get_executing_context = lambda: types.SimpleNamespace(node_id="31", prompt_id="p", list_index=None)
    monkeypatch.setitem(sys.modules, "comfy_execution.utils", utils)
    module = torch.nn.Linear(3, 3)
    runtime.compiled(("compile progress test", next(_calls)), runtime.module_function(module),
                     runtime.module_state(module), runtime.put(torch.ones(2, 3)), describe="a linear (2x3)")
    assert server.sent and {node for _, node, _ in server.sent} == {"31"}


def test_a_program_from_the_saved_programs_says_so(runtime, server, tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "_saved_store", ProgramStore(tmp_path / "programs", limit_bytes=10 ** 9))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    key = ProgramKey("progress mlp", {"program": "mlp forward", "model": describe_module(module)})
    fn, state, x = runtime.module_function(module), runtime.module_state(module), runtime.put(torch.ones(2, 8))
    runtime.compiled(("compile progress test", next(_calls)), fn, state, x, describe="a saved mlp", saved=key)
    assert server.sent[-1][0].startswith(("Compiled a saved mlp in ", "Loaded a saved mlp from the persistent"))
    server.sent.clear()
    # a new in-memory key stands for a new process: the saved program is loaded, nothing traced or compiled
    runtime.compiled(("compile progress test", next(_calls)), fn, state, x, describe="a saved mlp", saved=key)
    texts = [text for text, _, _ in server.sent]
    assert len(texts) == 1 and texts[0].startswith("Loaded a saved mlp from the saved programs in "), texts
    assert texts[0].endswith("(no tracing, no compile)")


def test_a_listener_that_fails_costs_its_line_not_the_compile(runtime):
    def broken(text, shown):
        raise RuntimeError("the page is gone")

    progress.add_listener(broken)
    try:
        module = torch.nn.Linear(2, 2)
        executable = runtime.compiled(("compile progress test", next(_calls)), runtime.module_function(module),
                                      runtime.module_state(module), runtime.put(torch.ones(1, 2)))
        assert executable is not None
    finally:
        progress.remove_listener(broken)
