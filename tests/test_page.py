"""The pack in ComfyUI's page, as a user meets it: a real ComfyUI 0.33 server (its pinned frontend) with this checkout
under custom_nodes/ and tiny models under the names the example workflows ask for, driven in Debian's Chromium by
Playwright (comfy_page.py).

- The node search lists every node of the pack and finds each by its whole display name; every input of every node
  shows its tooltip when the pointer rests on it.
- Every workflow in workflows/ opens from the Templates browser and by dropping its file onto the canvas, every node
  known (no missing node) and no console error from the pack.
- CogVideoX 2B (a family workflow) runs from the Run button at a small size set in its widgets: while its programs
  compile, the nodes show what compiles (ComfyUI's progress text); the video is shown by Save Video and written to
  disk. A mesh this machine cannot make shows its error on the loader. Cancel stops a long run inside the sampler
  and the next run works.
- Wan 2.1 with ComfyUI's own nodes and the three TPU nodes (a native-bridge workflow) runs to a shown and saved
  video; with the TPU nodes bypassed, the automatic mode's setting decides whether the next prompt runs the models
  on the runtime.

A screenshot of each finished canvas goes to the test's temporary folder (``page_shots``). Without Chromium,
Playwright or the tree's frontend, the test fails with the command that installs it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from comfy_native import SHARED
from comfy_page import (
    INSTALL_CHROMIUM, PAGE_SETTINGS, Missing, Server, browser_ready, build_tree, finished, frontend_root, open_page,
    record_events, wait_for_event, wait_until,
)
from workflow_files import workflows

TREE = SHARED / "comfyui-0.33"
OLDER_TREE = SHARED / "comfyui"
PACK_MODULE = "custom_nodes.tpu-video-nodes"
COGVIDEOX = "27 CogVideoX 2B text to video"
NATIVE = "13 Wan 2.1 1.3B text to video - ComfyUI nodes"
SMALL_COG = {"width": 96, "height": 64, "length": 9, "steps": 3}
# a console message of the pack: from its scripts (/extensions/tpu-video-nodes/...) or naming it; not the page's own
# lookups of the nodes in the Comfy Registry on the internet, which this test's machine may not reach
OURS = re.compile(r"tpu[-_]video|TPUVideo|extensions/tpu-video-nodes", re.I)
INTERNET = re.compile(r"^Failed to load resource: .* @ https?://(?!127\.0\.0\.1)")


def start(tree: Path, tmp_path_factory) -> Server:
    try:
        browser_ready()
        frontend = frontend_root(tree)
    except Missing as missing:
        pytest.fail(str(missing))
    if not (tree / "main.py").is_file():
        pytest.fail(f"ComfyUI's tree is not at {tree}")
    return Server(build_tree(tree, tmp_path_factory.mktemp("page") / "comfyui"), frontend, sys.executable)


@pytest.fixture(scope="module")
def playwright():
    try:
        browser_ready()
    except Missing as missing:
        pytest.fail(str(missing))
    from playwright.sync_api import sync_playwright

    with sync_playwright() as started:
        yield started


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start(TREE, tmp_path_factory)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return tmp_path_factory.mktemp("page_shots")


@pytest.fixture(scope="module")
def browser(server, playwright):
    with open_page(playwright, server.url) as (page, console):
        for key, value in PAGE_SETTINGS.items():  # written before the server started; the page has them
            assert page.evaluate("(k) => app.extensionManager.setting.get(k)", key) == value, key
        record_events(page)
        yield page, console


@pytest.fixture(scope="module")
def older(tmp_path_factory, playwright):
    """ComfyUI 0.3.64 with its own frontend, in a page of its own: the native bridge's Wan workflow runs there
    (0.33 recognises a umT5 file by the full-size feed-forward of its last block, which no tiny file has)."""
    running = start(OLDER_TREE, tmp_path_factory)
    try:
        with open_page(playwright, running.url) as (page, console):
            record_events(page)
            yield running, page, console
    finally:
        running.stop()


def new_blank(page) -> None:
    page.evaluate("() => app.extensionManager.command.execute('Comfy.NewBlankWorkflow')")
    page.wait_for_function("() => app.graph.nodes.length === 0")


def shoot(page, shots: Path, name: str) -> None:
    page.evaluate("() => { app.canvas.setDirty(true, true); app.canvas.draw(true, true); }")
    page.screenshot(path=str(shots / f"{name}.png"))


def errors_of_the_pack(console: list[str]) -> list[str]:
    return [line for line in console if OURS.search(line) and not INTERNET.match(line)]


# --- what the page shows of the nodes -------------------------------------------------------------------------------
def add_by_search(page, display_name: str) -> dict:
    """Open the node search (its command, as a double click on the empty canvas or its key does), type the whole
    display name, take the first result and place it on the canvas; the node's type and where its inputs and
    widgets are on the screen."""
    page.evaluate("() => app.extensionManager.command.execute('Workspace.SearchBox.Toggle')")
    page.wait_for_selector('input[placeholder="Add a node..."]')
    page.keyboard.type(display_name)
    first = page.locator("[role=option]").first
    first.wait_for()
    wait_until(lambda: first.text_content().startswith(display_name), 10, 0.1,
               f"the search's first result is {display_name!r}")
    page.keyboard.press("Enter")
    page.wait_for_function("() => app.graph.nodes.length === 1")
    page.wait_for_timeout(200)
    page.mouse.move(300, 120)
    page.mouse.move(310, 125)
    page.mouse.down()
    page.mouse.up()
    page.mouse.move(700, 960)
    return page.evaluate("""() => {
      const node = app.graph.nodes[0]; const ds = app.canvas.ds; const rect = app.canvas.canvas.getBoundingClientRect();
      node.pos = [(300 - rect.left) / ds.scale - ds.offset[0], (150 - rect.top) / ds.scale - ds.offset[1]];  // in view
      app.canvas.setDirty(true, true); app.canvas.draw(true, true);
      const at = ([x, y]) => [rect.left + (x + ds.offset[0]) * ds.scale, rect.top + (y + ds.offset[1]) * ds.scale];
      const inputs = [];
      (node.inputs || []).forEach((input, i) => { if (!input.widget) inputs.push([input.name, at(node.getConnectionPos(true, i)), null]); });
      // a text box is an element of the page: its tooltip is the element's title, which the browser shows
      (node.widgets || []).forEach((w) => { if (w.y !== undefined && w.name !== 'control_after_generate')
        inputs.push([w.name, at([node.pos[0] + 40, node.pos[1] + w.y + 10]),
                     w.element ? (w.element.title || w.element.parentElement?.title || '') : null]); });
      return {type: node.type, inputs};
    }""")


def tooltip_at(page, where) -> str:
    page.mouse.move(*where)
    page.mouse.move(where[0] + 1, where[1])
    visible = "() => { const t = document.querySelector('.node-tooltip'); return t && t.offsetParent !== null && t.textContent.trim(); }"
    try:
        page.wait_for_function(visible, timeout=1500)
        text = page.evaluate("() => document.querySelector('.node-tooltip').textContent.trim()")
    except Exception:  # noqa: BLE001 - no tooltip came: said by the caller
        text = ""
    page.mouse.move(700, 960)  # the page hides the tooltip as the pointer moves on
    return text


def test_the_search_finds_every_node_by_its_name_and_every_input_shows_its_tooltip(server, browser, shots):
    page, console = browser
    info = server.get("/object_info")
    ours = {name: node for name, node in info.items() if node.get("python_module") == PACK_MODULE}
    assert len(ours) >= 25, sorted(ours)
    missing_tooltips = []
    for name, node in sorted(ours.items()):
        new_blank(page)
        placed = add_by_search(page, node["display_name"])
        assert placed["type"] == name, (node["display_name"], placed["type"])
        declared = {k: v for section in ("required", "optional") for k, v in node["input"].get(section, {}).items()}
        seen = {entry[0] for entry in placed["inputs"]}
        assert seen == set(declared), (name, seen ^ set(declared))
        for input_name, where, title in placed["inputs"]:
            tooltip = declared[input_name][1]["tooltip"] if len(declared[input_name]) > 1 else ""
            shown = title if title is not None else tooltip_at(page, where)
            if not tooltip or not shown.startswith(tooltip.strip()[:40]):
                missing_tooltips.append((name, input_name, shown[:60]))
        if name == "TPUCogVideoXSampler":
            shoot(page, shots, "search_cogvideox_sampler")
    assert not missing_tooltips, missing_tooltips
    assert not errors_of_the_pack(console), errors_of_the_pack(console)


# --- the workflows --------------------------------------------------------------------------------------------------
def nodes_known(page) -> list:
    """Every node of the open graph: its type, whether the page knows that type, whether it is marked in error."""
    return page.evaluate("() => app.graph.nodes.map(n => [n.type, !!LiteGraph.registered_node_types[n.type], !!n.has_errors])")


def open_template(page, title: str) -> None:
    """Open the Templates browser, find the card by its title and open it."""
    page.get_by_text("Templates", exact=True).first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_placeholder(re.compile("Search", re.I)).first.fill(title)
    dialog.locator("h3", has_text=title).first.click()
    dialog.wait_for(state="hidden")


def template_cards(page) -> set[str]:
    """The card titles the Templates browser lists under the pack's own category (scrolled to the end)."""
    page.get_by_text("Templates", exact=True).first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("tpu-video-nodes", exact=True).click()
    seen: set[str] = set()
    while True:
        cards = dialog.locator("h3")
        titles = set(cards.all_text_contents()) - {"Generation Type", "Closed Source Models", "Extensions"}
        if titles <= seen:
            break
        seen |= titles
        cards.last.scroll_into_view_if_needed()
        page.wait_for_timeout(300)
    page.keyboard.press("Escape")
    dialog.wait_for(state="hidden")
    return {t.strip() for t in seen}


def drop_file(page, path: Path) -> None:
    page.evaluate("""([name, text]) => {
      const data = new DataTransfer();
      data.items.add(new File([text], name, {type: 'application/json'}));
      const target = app.canvas.canvas;
      for (const type of ['dragenter', 'dragover', 'drop'])
        target.dispatchEvent(new DragEvent(type, {bubbles: true, cancelable: true, dataTransfer: data}));
    }""", [path.name, path.read_text()])


def test_every_workflow_is_in_the_templates_browser_and_opens_by_dropping_its_file(browser, shots):
    """Every workflow has its card in the Templates browser, under the pack's category, and opens by dropping its
    file; a few open from their cards as well (opening a card costs seconds on two cores: the runs below open
    theirs too)."""
    page, console = browser
    names = [path.stem for path in workflows()]
    assert template_cards(page) >= set(names), set(names) - template_cards(page)
    from_cards = {names[0], names[-1], "20 HunyuanVideo 1.5 text to video - ComfyUI nodes"}
    for path in workflows():
        expected = sorted(n["type"] for n in json.loads(path.read_text())["nodes"])
        for how in ("drop", "template") if path.stem in from_cards else ("drop",):
            new_blank(page)
            if how == "template":
                open_template(page, path.stem)
            else:
                drop_file(page, path)
            wait_until(lambda: sorted(t for t, _, _ in nodes_known(page)) == expected, 20, 0.2,
                       f"{path.name} opened by {how}")
            # a missing node is one whose type the page does not know (a node whose model file is not in this
            # server's folders is marked too: that is the missing-model notice, not a missing node)
            unknown = [t for t, known, _ in nodes_known(page) if not known]
            assert not unknown, (path.name, how, unknown)
            if how == "drop":
                shoot(page, shots, f"open_{path.stem}")
            page.evaluate("() => app.extensionManager.command.execute('Workspace.CloseWorkflow')")
    assert not errors_of_the_pack(console), errors_of_the_pack(console)


# --- running from the page ------------------------------------------------------------------------------------------
def set_widgets(page, node_id: int, values: dict) -> None:
    page.evaluate("""([id, values]) => {
      const node = app.graph.getNodeById(id);
      for (const [name, value] of Object.entries(values)) {
        const widget = node.widgets.find(w => w.name === name);
        if (!widget) throw new Error(`node ${id} has no widget ${name}`);
        widget.value = value;
        widget.callback?.(value);
      }
      app.graph.setDirtyCanvas(true, true);
    }""", [node_id, values])


def run(page) -> None:
    """Press Run, after forgetting the events so far."""
    page.evaluate("() => { window.__tpu_events = []; }")
    page.get_by_test_id("queue-button").click()


def events(page, kind: str) -> list:
    return page.evaluate("(k) => window.__tpu_events.filter(e => e.type === k).map(e => e.detail)", kind)


def video_shown(page, prefix: str) -> str:
    """The src of a <video> element of the page that plays an output whose name starts with ``prefix``."""
    return wait_until(lambda: next((s for s in page.evaluate("() => [...document.querySelectorAll('video')]"
                                                             ".map(v => v.currentSrc || v.src)") if prefix in s), None),
                      30, 0.5, f"a video of {prefix} in the page")


def test_a_family_workflow_runs_from_the_page_showing_its_compiles_and_its_video(server, browser, shots):
    page, console = browser
    new_blank(page)
    open_template(page, COGVIDEOX)
    sampler = page.evaluate("() => app.graph.nodes.find(n => n.type === 'TPUCogVideoXSampler').id")
    set_widgets(page, sampler, {**SMALL_COG, "seed": 1})
    before = set((server.folder / "output" / "video").glob("CogVideoX-2b*.mp4"))
    run(page)
    assert finished(page, 300)[0] == "execution_success", events(page, "execution_error")
    # what compiled was said on the node that compiled it, with the seconds, and stays there
    texts = events(page, "progress_text")
    said = {t["nodeId"] for t in texts if t["text"].startswith("Compiling ")}
    assert str(sampler) in said, texts
    assert any(re.match(r"Compiled .+ in \d+\.\d s$", t["text"]) for t in texts if t["nodeId"] == str(sampler)), texts
    shown = page.evaluate("(id) => app.graph.getNodeById(id).widgets.filter(w => w.name === '$$node-text-preview')"
                          ".map(w => w.value)", sampler)
    assert shown and re.match(r"(Compiled|Loaded) ", shown[0]), shown
    new = set((server.folder / "output" / "video").glob("CogVideoX-2b*.mp4")) - before
    assert len(new) == 1 and next(iter(new)).stat().st_size > 1000, new
    assert next(iter(new)).name in video_shown(page, "CogVideoX-2b")
    shoot(page, shots, "run_cogvideox")

    # an invalid value (the widgets round sizes to what the model takes; a mesh is free text): the error names the
    # loader, and the page shows it and marks that node
    loader = page.evaluate("() => app.graph.nodes.find(n => n.type === 'TPUCogVideoXLoader').id")
    set_widgets(page, loader, {"mesh": "dp=3"})
    run(page)
    error = wait_for_event(page, "execution_error", 120)
    assert str(error["node_id"]) == str(loader) and error["node_type"] == "TPUCogVideoXLoader", error
    assert "dp=3" in error["exception_message"], error
    title = page.evaluate("(id) => app.graph.getNodeById(id).title", loader)
    page.get_by_text(f"{title} failed").first.wait_for(timeout=10_000)  # the page names the node that failed
    page.get_by_role("button", name="View details").first.click()
    page.get_by_text(error["exception_message"].strip().splitlines()[0][:40]).first.wait_for(timeout=10_000)
    shoot(page, shots, "invalid_mesh_on_the_loader")
    page.keyboard.press("Escape")
    set_widgets(page, loader, {"mesh": "auto"})

    # Cancel inside the sampler's steps, then the next run works
    set_widgets(page, sampler, {"width": 192, "height": 128, "length": 17, "steps": 1000, "seed": 2})  # a new size
    run(page)
    page.wait_for_function("(id) => window.__tpu_events.some(e => e.type === 'progress' && String(e.detail.node) "
                           "=== String(id) && e.detail.value >= 2)", arg=sampler, timeout=120_000)
    page.get_by_role("button", name="Cancel current run").click()
    stopped = wait_for_event(page, "execution_interrupted", 60)
    assert str(stopped["node_id"]) == str(sampler), stopped
    steps_done = max(e["value"] for e in events(page, "progress") if str(e["node"]) == str(sampler))
    assert steps_done < 1000
    set_widgets(page, sampler, {**SMALL_COG, "seed": 3})
    run(page)
    assert finished(page, 120)[0] == "execution_success", events(page, "execution_error")
    shoot(page, shots, "after_cancel")
    assert not errors_of_the_pack(console), errors_of_the_pack(console)


def test_a_native_workflow_runs_and_the_automatic_mode_decides_the_next_prompt(older, shots):
    server, page, console = older
    new_blank(page)
    path = next(p for p in workflows() if p.stem == NATIVE)
    drop_file(page, path)
    page.wait_for_function("() => app.graph.nodes.some(n => n.type === 'TPUVAE')")
    ids = page.evaluate("() => Object.fromEntries(app.graph.nodes.map(n => [n.type, n.id]))")
    set_widgets(page, ids["EmptyHunyuanLatentVideo"], {"width": 32, "height": 32, "length": 5})
    set_widgets(page, ids["KSampler"], {"steps": 2})
    output = server.folder / "output" / "video"
    before = set(output.glob("ComfyUI*.mp4")) if output.exists() else set()
    run(page)
    assert finished(page, 300)[0] == "execution_success", events(page, "execution_error")
    new = set(output.glob("ComfyUI*.mp4")) - before
    assert len(new) == 1, new
    assert next(iter(new)).name in video_shown(page, "ComfyUI")
    shoot(page, shots, "run_native_bridge")

    # the three TPU nodes bypassed: the setting alone decides where the models run
    page.evaluate("(ids) => { for (const id of ids) app.graph.getNodeById(id).mode = 4; app.graph.setDirtyCanvas(true, true); }",
                  [ids["TPUDiffusionModel"], ids["TPUTextEncoder"], ids["TPUVAE"]])
    placed = {}
    for mode in ("off", "all"):
        page.evaluate("(v) => app.extensionManager.setting.set('TPUVideo.AutomaticMode', v)", mode)
        set_widgets(page, ids["KSampler"], {"seed": 10 + len(placed)})
        lines = server.text().count("weights placed")
        run(page)
        assert finished(page, 300)[0] == "execution_success", events(page, "execution_error")
        placed[mode] = server.text().count("weights placed") - lines
        shoot(page, shots, f"automatic_mode_{mode}")
    assert placed["off"] == 0 and placed["all"] >= 3, placed  # diffusion model, text encoder, VAE on the runtime
    page.evaluate("() => app.extensionManager.setting.set('TPUVideo.AutomaticMode', 'as started')")
    assert not errors_of_the_pack(console), errors_of_the_pack(console)


def test_the_install_command_is_named_when_the_browser_is_missing(monkeypatch):
    import comfy_page

    monkeypatch.setattr(comfy_page, "CHROMIUM", "/nonexistent/chromium")
    with pytest.raises(Missing, match=re.escape(INSTALL_CHROMIUM)):
        browser_ready()
