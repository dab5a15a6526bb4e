"""The test run itself: one persistent compilation cache shared by the run's processes and removed after it, and
the time budget that fails a run past it, naming the slowest tests."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, subprocess_env
from run_cache_probe import PROBE_ENV

TESTS = Path(__file__).resolve().parent


def test_xdist_workers_share_one_compilation_cache_that_the_run_removes(tmp_path):
    """A pytest run of its own (its first process makes the cache; this run's cache is not passed down): each of
    its two workers compiles the same program, one after the other; the second loads the first's from the cache."""
    env = subprocess_env(**{PROBE_ENV: tmp_path})
    for inherited in ("TPU_VIDEO_TEST_RUN_CACHE", "TPU_VIDEO_CACHE_DIR"):
        env.pop(inherited, None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "each", str(TESTS / "run_cache_probe.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("gw*.json"))]
    assert len(records) == 2 and records[0]["pid"] != records[1]["pid"], records
    assert records[0]["cache"] == records[1]["cache"], records
    assert all(r["backend_compiles"] == 1 for r in records), records  # each process built the program once...
    assert sorted(r["persistent_cache_hits"] for r in records) == [0, 1], records  # ...compiled once in the run
    assert not Path(records[0]["cache"]).exists()  # removed by the process that made it


def _run_with_budget(tmp_path, minutes: str):
    (tmp_path / "test_slow.py").write_text("import time\n\n\ndef test_takes_a_second():\n    time.sleep(1.0)\n\n\n"
                                           "def test_quick():\n    pass\n")
    env = subprocess_env(TPU_VIDEO_TEST_BUDGET_MINUTES=minutes)
    env["PYTHONPATH"] = str(TESTS) + ":" + env["PYTHONPATH"]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "time_budget",
                           "test_slow.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_run_past_its_time_budget_fails_naming_the_slowest_tests(tmp_path):
    over = _run_with_budget(tmp_path, "0.005")  # 0.3 s
    assert over.returncode == 1, over.stdout
    assert "time budget exceeded" in over.stdout and "the run fails" in over.stdout, over.stdout
    listed = over.stdout.split("slowest tests:", 1)[1].splitlines()[1:3]
    assert "test_slow.py::test_takes_a_second" in listed[0] and "test_quick" in listed[1], over.stdout
    assert "2 passed" in over.stdout.strip().splitlines()[-1]  # the runner's own summary still ends the output
    within = _run_with_budget(tmp_path, "10")
    assert within.returncode == 0, within.stdout
    assert "min of the 10 min budget" in within.stdout and "exceeded" not in within.stdout
    assert "longest test files" in within.stdout and "test_slow.py 1" in within.stdout, within.stdout
    bad = _run_with_budget(tmp_path, "forty")
    assert bad.returncode == 4 and "TPU_VIDEO_TEST_BUDGET_MINUTES='forty' is not a number" in bad.stderr, bad.stderr


def test_the_processes_the_tests_start_compile_with_the_tests_flags():
    """The tests' XLA flags (conftest.TEST_XLA_FLAGS) hold in this process and in every process started with
    subprocess_env, also where a test gives XLA_FLAGS of its own (a device count)."""
    import os

    from conftest import TEST_XLA_FLAGS

    assert TEST_XLA_FLAGS in os.environ["XLA_FLAGS"]
    assert TEST_XLA_FLAGS in subprocess_env()["XLA_FLAGS"]
    eight = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")["XLA_FLAGS"].split()
    assert TEST_XLA_FLAGS in eight and "--xla_force_host_platform_device_count=8" in eight


def test_the_longest_files_are_handed_out_first():
    """Files of run_order.LONGEST_FIRST come first, in its order, each file's tests together and in their order;
    every listed file exists; xdist keeps that order (its reordering by test count is off)."""
    import tomllib

    import run_order

    class Item:
        def __init__(self, path, name):
            self.fspath, self.name = TESTS / path, name

    names = ["test_attention.py", "test_cli.py", "test_multihost.py", "test_zzz.py"]
    items = [Item(path, f"{path}:{k}") for path in names for k in range(3)]
    run_order.pytest_collection_modifyitems(items)
    order = [item.name for item in items]
    assert order == [f"{p}:{k}" for p in ("test_multihost.py", "test_cli.py", "test_attention.py", "test_zzz.py")
                     for k in range(3)], order
    assert all((TESTS / name).is_file() for name in run_order.LONGEST_FIRST)
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "--dist loadfile" in addopts and "--no-loadscope-reorder" in addopts
