"""The tests see the same modules wherever the clone sits: a folder beside the clone named like a module the
tests or the pack import (a ComfyUI checkout named `comfy`) shadows nothing."""

import shutil
import subprocess
import sys

import pytest
from conftest import ROOT


def _copy_checkout(dest):
    """The working tree as a fresh clone would hold it (tracked and untracked-not-ignored files)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)


@pytest.mark.parametrize("clone_name", ["clone", "tpu.video-nodes"])  # the second is no Python package name
def test_sibling_folders_shadow_nothing(tmp_path, clone_name):
    parent = tmp_path / "parent"
    clone = parent / clone_name
    _copy_checkout(clone)
    # Stand-ins for what may lie beside a clone: a ComfyUI checkout named comfy, stray folders named like ours.
    for name, body in (("comfy", "raise RuntimeError('the sibling comfy was imported')"),
                       ("folder_paths", "raise RuntimeError('the sibling folder_paths was imported')")):
        (parent / name).mkdir()
        (parent / name / "__init__.py").write_text(body + "\n")
    (parent / "comfy" / "utils.py").write_text("raise RuntimeError('the sibling comfy.utils was imported')\n")
    probe = clone / "tests" / "test_probe_imports.py"
    probe.write_text(
        "import sys\n"
        "from pathlib import Path\n\n"
        "def test_probe():\n"
        "    from nodes.comfy_bridge import interrupt_requested, progress_bar\n"
        "    assert progress_bar(3) is None and interrupt_requested() is False\n"
        f"    assert str(Path({str(parent)!r})) not in [str(Path(p or '.').resolve()) for p in sys.path]\n"
    )
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(probe)], cwd=clone,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
