"""The example workflows in workflows/, as the tests find them: the families' graphs and ComfyUI's own graphs with the
native bridge's TPU nodes (told apart by what they hold, not by their file names, which are the titles ComfyUI's
Templates browser shows)."""

import json
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[1] / "workflows"
BRIDGE_NODES = {"TPUDiffusionModel", "TPUTextEncoder", "TPUVAE", "TPUCLIPVision", "TPUAudioEncoder"}


def uses_bridge_nodes(path: Path) -> bool:
    """Whether the workflow at ``path`` is one of ComfyUI's own graphs with the native bridge's TPU nodes."""
    return any(node["type"] in BRIDGE_NODES for node in json.loads(path.read_text())["nodes"])


def workflows() -> list[Path]:
    return sorted(FOLDER.glob("*.json"))
