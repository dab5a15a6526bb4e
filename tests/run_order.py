"""The order in which the test files are handed to xdist's workers: the longest first, so that the run does not end
with one worker finishing a long file while the other has nothing left (``--dist loadfile`` gives each worker whole
files, in the order collected; ``--no-loadscope-reorder`` keeps that order instead of sorting by test count).

``LONGEST_FIRST`` lists the files whose serial time is a large share of the run, longest first, as measured (see
docs/development.md); every other file follows in its collection order. A file missing from the list only runs
later; re-measure and reorder when the time budget's list of slowest tests changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

LONGEST_FIRST = (
    "test_multihost.py",
    "test_templates.py",
    "test_page.py",
    "test_wan_parity.py",
    "test_image_to_video.py",
    "test_plan.py",
    "test_mesh.py",
    "test_bridge_vae.py",
    "test_bridge.py",
    "test_bridge_quant.py",
    "test_bridge_slice.py",
    "test_bridge_models.py",
    "test_parity_diffusers.py",
    "test_step_cache.py",
    "test_lora.py",
    "test_ltx2_plan.py",
    "test_ltx2_files.py",
    "test_ltx2.py",
    "test_bridge_mesh.py",
    "test_workflows.py",
    "test_tpu_target.py",
    "test_ltx2_precision.py",
    "test_nodes.py",
    "test_cli.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Files of LONGEST_FIRST first, in its order; within a file, and among the rest, the collection's order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))
