"""The pictures of the example workflows, taken in ComfyUI's own page (run by hand; CI checks only that each workflow
has its picture in the format the Templates browser asks for: tests/test_workflow_files.py).

    python tests/workflow_pictures.py --comfy COMFYUI_CHECKOUT [--python COMFY_PYTHON] [--chromium /usr/bin/chromium]
        [--front-end-root FRONTEND_STATIC] [--port 8391] [--only NAME ...]

It copies the ComfyUI checkout to a temporary folder, links this folder into its custom_nodes/, puts empty files
under the names the workflows' loaders ask for (and diffusers folders of the right pipeline) so no loader shows a
missing model, starts ``main.py --cpu``, opens the page in headless Chromium (Playwright for Python), loads each
workflow of workflows/, fits the graph to the view with the page's own chrome hidden, and writes
``workflows/<name>.jpg``: the picture ComfyUI's Templates browser shows on the workflow's card (it asks for
``<name>.jpg``) and docs/workflows.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from comfy_server_trial import http, start_server, wait_until_up

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "workflows"
SIZE = (1280, 800)  # the picture; the page is rendered at 1.5x that and scaled down
SETTINGS = {"Comfy.TutorialCompleted": True, "Comfy.Minimap.Visible": False, "Comfy.Graph.CanvasInfo": False,
            "Comfy.Workflow.ShowMissingModelsWarning": False, "Comfy.VersionCompatibility.DisableWarnings": True,
            "Comfy.NodeBadge.NodeSourceBadgeMode": "None", "LiteGraph.Canvas.MinFontSizeForLOD": 0}
PIPELINES = {"TPUCogVideoXLoader": "CogVideoXPipeline", "TPUWanLoader": "WanPipeline", "TPULTX2Loader": "LTX2Pipeline"}
# The page's chrome over the canvas: tabs, side bars, menus, toasts (the nodes' text boxes stay).
HIDE_CHROME = ".pointer-events-none.absolute.top-0.left-0, .p-toast { opacity: 0 !important; }"
FIT = """() => {
  const canvas = window.app.canvas, nodes = window.app.graph.nodes;
  let [x0, y0, x1, y1] = [Infinity, Infinity, -Infinity, -Infinity];
  for (const n of nodes) {
    x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1] - 34);
    x1 = Math.max(x1, n.pos[0] + n.size[0]); y1 = Math.max(y1, n.pos[1] + n.size[1]);
  }
  const [w, h] = [canvas.canvas.clientWidth, canvas.canvas.clientHeight], margin = 24;
  const scale = Math.min((w - 2 * margin) / (x1 - x0), (h - 2 * margin) / (y1 - y0));
  canvas.ds.scale = scale;
  canvas.ds.offset = [(w / scale - (x1 - x0)) / 2 - x0, (h / scale - (y1 - y0)) / 2 - y0];
  canvas.setDirty(true, true);
}"""


def prepare(comfy: Path) -> None:
    """Empty stand-ins where the workflows' loaders look, and a first frame for Load Image."""
    import numpy as np
    from PIL import Image

    models = comfy / "models"
    for path in FOLDER.glob("*.json"):
        for node in json.loads(path.read_text())["nodes"]:
            for model in (node.get("properties") or {}).get("models", []):
                (models / model["directory"]).mkdir(parents=True, exist_ok=True)
                (models / model["directory"] / model["name"]).touch()
            if node["type"] in PIPELINES:
                folder = models / "diffusers" / node["widgets_values"][0]
                folder.mkdir(parents=True, exist_ok=True)
                pipeline = PIPELINES[node["type"]].replace("Pipeline", "ImageToVideoPipeline") \
                    if "I2V" in folder.name else PIPELINES[node["type"]]
                (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    y, x = np.mgrid[0:512, 0:512]
    picture = np.stack([120 + 0 * x, 170 + 0 * x, 235 - y * 0.2], -1)
    hill = y > 300 + 40 * np.sin(x / 60)
    picture[hill] = [60, 150, 70]
    picture[(x - 380) ** 2 + (y - 120) ** 2 < 50 ** 2] = [250, 220, 90]
    (comfy / "input").mkdir(exist_ok=True)
    Image.fromarray(picture.astype(np.uint8)).save(comfy / "input" / "example.png")


def shoot(port: int, chromium: str, names: list[str]) -> None:
    from PIL import Image
    from playwright.sync_api import sync_playwright

    for key, value in SETTINGS.items():
        http(port, f"/api/settings/{key}", value)
    width, height = SIZE
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True)
        page = browser.new_page(viewport={"width": width * 3 // 2, "height": height * 3 // 2})
        page.goto(f"http://127.0.0.1:{port}/", wait_until="networkidle")
        page.wait_for_function("() => window.app && window.app.graph", timeout=120_000)
        page.keyboard.press("Escape")
        page.add_style_tag(content=HIDE_CHROME)
        for name in names:
            workflow = json.loads((FOLDER / f"{name}.json").read_text())
            page.evaluate("async ([w, n]) => { await window.app.loadGraphData(w, true, false, n); }", [workflow, name])
            page.wait_for_timeout(1500)
            page.evaluate(FIT)
            page.wait_for_timeout(1000)
            shot = Path(tempfile.mkdtemp()) / "page.png"
            page.screenshot(path=str(shot))
            with Image.open(shot) as full:
                full.convert("RGB").resize(SIZE, Image.LANCZOS).save(FOLDER / f"{name}.jpg", quality=82, optimize=True)
            print(f"{name}.jpg", (FOLDER / f"{name}.jpg").stat().st_size, "bytes")
        browser.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfy", required=True, type=Path)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--front-end-root", help="the frontend's static folder (default: the one ComfyUI's Python has)")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--only", nargs="*", help="workflow names (without .json); default: every workflow")
    args = ap.parse_args()
    names = args.only or sorted(p.stem for p in FOLDER.glob("*.json"))
    with tempfile.TemporaryDirectory() as temporary:
        comfy = Path(temporary) / "ComfyUI"
        shutil.copytree(args.comfy, comfy, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        (comfy / "custom_nodes").mkdir(exist_ok=True)
        (comfy / "custom_nodes" / "tpu-video-nodes").symlink_to(ROOT)
        prepare(comfy)
        log = comfy / "pictures_server.log"
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        extra = ("--front-end-root", args.front_end_root) if args.front_end_root else ()
        server = start_server(comfy, args.python, args.port, env, log, extra)
        try:
            wait_until_up(args.port, server, log)
            shoot(args.port, args.chromium, names)
        finally:
            server.terminate()
            server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
