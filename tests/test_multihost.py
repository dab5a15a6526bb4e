"""A slice of two processes on this machine (``jax.distributed`` over loopback, CPU collectives through gloo,
4 simulated devices each: one 8-device mesh across both) driven from process 0 gives the frames of the same
generation in one process with 8 devices; a worker that lacks the model is named before any compile; a worker
killed mid-generation is reported within a bounded time and process 0 lives on."""

import json
import os
import socket
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TEST_XLA_FLAGS, subprocess_env
from safetensors.numpy import load_file

from tpu_runtime.errors import InputError
from tpu_runtime.multihost.transport import file_fingerprint, source_fingerprints
from tpu_runtime.multihost.worker import _check_files
from tpu_runtime.families.cogvideox.tiny import TinySpec, build_tiny_cogvideox
from tpu_runtime.families.ltx2.tiny import build_tiny_ltx2
from tpu_runtime.families.wan.tiny import TinyWanSpec, build_tiny_lora, build_tiny_wan

JOB = str(Path(__file__).with_name("multihost_job.py"))
SIZE = {"height": 32, "width": 64, "frames": 9}
# mesh dp=2,tp=4 puts process 0's four devices on dp 0 and process 1's on dp 1 (the CFG halves on different
# hosts); tp=8 splits every attention and FFN across the two processes.
MESHES = {"dp": "dp=2,sp=1,tp=4", "tp": "dp=1,sp=1,tp=8", "all": "dp=2,sp=2,tp=2"}
HEARTBEAT = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("multihost")
    from PIL import Image

    wan = build_tiny_wan(base / "wan", "2.1", seed=3, spec=TinyWanSpec(heads=8, layers=1))
    picture = base / "first.png"
    Image.fromarray((np.random.default_rng(1).random((40, 50, 3)) * 255).astype(np.uint8)).save(picture)
    return {"cogvideox": build_tiny_cogvideox(base / "cogvideox", "5b", seed=3, spec=TinySpec("5b", heads=8)),
            "wan": wan, "wan_lora": build_tiny_lora(wan / "transformer", base / "wan_lora.safetensors", seed=5),
            "wan_i2v": build_tiny_wan(base / "wan_i2v", "2.1", seed=3, spec=TinyWanSpec(heads=8, layers=1),
                                      image="i2v"), "picture": picture,
            "ltx2": build_tiny_ltx2(base / "ltx2", "2.0", seed=3)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slice_env(port: int, process_id: int, processes: int = 2) -> dict:
    env = subprocess_env(TPU_VIDEO_MULTIHOST=1, TPU_VIDEO_COORDINATOR=f"127.0.0.1:{port}", TPU_VIDEO_PROCESSES=processes,
                         TPU_VIDEO_PROCESS_ID=process_id, JAX_NUM_CPU_DEVICES=8 // processes,
                         TPU_VIDEO_JOIN_TIMEOUT=120,
                         TPU_VIDEO_WORKER_TIMEOUT=120, TPU_VIDEO_HEARTBEAT_TIMEOUT=HEARTBEAT)
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # devices from JAX_NUM_CPU_DEVICES, none forced
    return env


def _report(proc, worker_log: Path | None = None) -> dict:
    other = f"\n--- the worker's log ---\n{worker_log.read_text()[-5000:]}" if worker_log and worker_log.exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:] + other
    return json.loads(proc.stdout.split("REPORT ", 1)[1])


def _start_slice(tmp: Path, jobs, driver_cwd: Path, worker_cwd: Path, readme: bool = False, pin: bool = False):
    """Process 1 as `python -m tpu_runtime worker` in ``worker_cwd``, process 0 running the jobs in ``driver_cwd``;
    returns (the first process's run, the worker's exit code, the worker's log). ``readme``: launched as the README
    says: the first host with TPU_VIDEO_COORDINATOR and TPU_VIDEO_PROCESSES only (its id is 0), the worker with
    `worker --coordinator ... --processes 2 --process-id 1`; otherwise both from the environment alone. ``pin``:
    both processes on one CPU core (a starved machine)."""
    port = _free_port()
    if readme:
        base = subprocess_env(JAX_NUM_CPU_DEVICES=4, TPU_VIDEO_JOIN_TIMEOUT=120, TPU_VIDEO_WORKER_TIMEOUT=120,
                              TPU_VIDEO_HEARTBEAT_TIMEOUT=HEARTBEAT)
        base["XLA_FLAGS"] = TEST_XLA_FLAGS
        first = dict(base, TPU_VIDEO_MULTIHOST="1", TPU_VIDEO_COORDINATOR=f"127.0.0.1:{port}",
                     TPU_VIDEO_PROCESSES="2")
        worker_env, worker_args = base, ["--coordinator", f"127.0.0.1:{port}", "--processes", "2",
                                         "--process-id", "1"]
    else:
        first, worker_env, worker_args = _slice_env(port, 0), _slice_env(port, 1), ["--process-id", "1"]
    taskset = ["taskset", "-c", "0"] if pin else []
    log = open(tmp / "worker.log", "w")
    worker = subprocess.Popen(taskset + [sys.executable, "-m", "tpu_runtime", "worker", *worker_args],
                              cwd=worker_cwd, env=worker_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        jobs = jobs(worker.pid) if callable(jobs) else jobs
        (tmp / "jobs.json").write_text(json.dumps(jobs))
        driver = subprocess.run(taskset + [sys.executable, JOB, str(tmp / "out"), str(tmp / "jobs.json")],
                                cwd=driver_cwd, env=first, capture_output=True, text=True, timeout=1200)
        try:
            code = worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = "still running"
        return driver, code, (tmp / "worker.log").read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
        log.close()


# Each mesh once across the families (the replay is the same for both; each family's rule table on every mesh is
# checked in one process by test_mesh.py): CogVideoX with CFG's halves on different hosts, Wan with a LoRA on tp=8
# (its merge then runs on weights split over both processes), Wan 2.1 I2V on tp=8 from a picture (the image
# encode stage, its CLIP features and the conditioned step replayed on the worker).
# Wan with FirstBlockCache on dp (its two CFG passes decide apart, each process reads back the same change and
# takes the first process's decision).
RUNS = {"cogvideox_dp": ("cogvideox", "dp"), "wan_tp": ("wan", "tp"), "wan_i2v_tp": ("wan_i2v", "tp"),
        "wan_cached_dp": ("wan", "dp"), "ltx2_all": ("ltx2", "all")}  # LTX-2: video and sound, every axis
CACHED = {"cache": {"cache": "first-block", "cache_threshold": 0.5}, "steps": 3}


def _generate_jobs(models):
    return [{"generate": name, "model": str(models[model]), "mesh": MESHES[axis], **SIZE,
             **({"loras": [f"{models['wan_lora']}:0.8"]} if name == "wan_tp" else {}),
             **({"image": str(models["picture"])} if model == "wan_i2v" else {}),
             **(CACHED if name == "wan_cached_dp" else {})}
            for name, (model, axis) in RUNS.items()]


# Cancel on tp after the generations: both processes stop at the same step, and the next sample runs on both.
CANCEL = {"cancel": 3, "steps": 8, "mesh": MESHES["tp"], **SIZE}


@pytest.fixture(scope="module")
def two_processes(models, tmp_path_factory):
    """The slice every test of a healthy slice reads, launched with the README's lines: a model only the first
    host has, each generation of RUNS, Cancel; then the first process closes the slice."""
    tmp = tmp_path_factory.mktemp("slice")
    driver_cwd, worker_cwd = tmp / "first_host", tmp / "second_host"
    worker_cwd.mkdir()
    # A model only the first host has: a relative path that resolves on the first host and not on the second.
    shutil.copytree(models["cogvideox"], driver_cwd / "only_on_the_first_host")
    jobs = [{"open_missing": "only_on_the_first_host"}] + _generate_jobs(models) + \
        [dict(CANCEL, model=str(models["cogvideox"]))]
    driver, worker_code, worker_log = _start_slice(tmp, jobs, driver_cwd, worker_cwd, readme=True)
    return tmp / "out", _report(driver, tmp / "worker.log"), worker_code, worker_log, driver.stderr


@pytest.fixture(scope="module")
def one_process(models, tmp_path_factory):
    """The same jobs in one process with all 8 devices. It uses the slice's CPU collectives (gloo, as a slice of
    one process): XLA's in-process CPU all-reduce sums in another order than gloo's ring, which alone moves
    these frames by up to ~1.3e-5; with the same collectives the difference left is what the split across
    processes makes."""
    tmp = tmp_path_factory.mktemp("single")
    (tmp / "jobs.json").write_text(json.dumps(_generate_jobs(models)))
    proc = subprocess.run([sys.executable, JOB, str(tmp / "out"), str(tmp / "jobs.json")],
                          env=_slice_env(_free_port(), 0, processes=1), capture_output=True, text=True, timeout=1200)
    return tmp / "out", _report(proc)


def test_two_processes_give_the_one_process_frames(two_processes, one_process):
    out, report, worker_code, worker_log, _ = two_processes
    single_out, single = one_process
    assert (report["processes"], report["devices"], report["local_devices"]) == (2, 8, 4)
    assert (single["processes"], single["devices"], single["local_devices"]) == (1, 8, 8)
    for name, (_, axis) in RUNS.items():
        assert report[name]["devices"] == 8 and report[name]["mesh"] == MESHES[axis]
        assert report[name]["loras"] == single[name]["loras"] == (name == "wan_tp")
        got_all = load_file(out / name / "frames.safetensors")
        want_all = load_file(single_out / name / "frames.safetensors")
        assert set(got_all) == set(want_all) == ({"frames", "audio"} if name.startswith("ltx2") else {"frames"})
        for key in got_all:  # the frames, and LTX-2's waveform
            got, want = got_all[key], want_all[key]
            assert got.shape == want.shape and np.isfinite(got).all()
            print(name, key, "max |slice - one process|", np.abs(got - want).max())
            assert np.abs(got - want).max() < 1e-5, (name, key, np.abs(got - want).max())
        assert report[name]["step_cache"] == single[name]["step_cache"]
    assert report["wan_cached_dp"]["step_cache"]["skipped_steps"] == [2, 3]  # every process skipped the same
    # The worker ran every call and stopped when process 0 closed the slice.
    assert worker_code == 0, worker_log[-3000:]
    assert worker_log.count("call ") >= 4 * len(RUNS), worker_log[-3000:]  # open, encode, sample, decode
    assert "encode_image" in worker_log, worker_log[-3000:]


def test_a_worker_without_the_model_is_named_before_any_compile(two_processes):
    _, report, _, _, _ = two_processes
    missing = report["open_missing"]
    assert missing["error"] and "worker 1" in missing["error"] and "only_on_the_first_host" in missing["error"]
    assert missing["compiles"] == 0
    # ...and the slice stayed in step: the generations after it ran (checked above) on both processes.


def test_cancel_stops_every_process_at_the_same_step(two_processes):
    _, report, _, worker_log, _ = two_processes
    # Cancel after step 3: both processes stop before step 4, and the next sample runs on both.
    cancel = report["cancel"]
    assert "before step 4 of 8" in cancel["interrupted"], cancel
    assert "sampling interrupted before step 4 of 8, as on the first process" in worker_log
    # An exception from the step callback (ComfyUI's progress bar on Cancel) stops the workers at that boundary too.
    assert cancel["raised_in_on_step"] == "progress bar: processing interrupted"
    assert worker_log.count("sampling interrupted before step 4 of 8, as on the first process") == 2, worker_log
    assert cancel["next_sample"] == "ok"


def test_a_killed_worker_is_reported_and_the_first_process_lives_on(models, tmp_path):
    """A slice launched from the environment alone (the worker's coordinator, process count and id too): the
    worker killed between two steps."""
    driver_cwd = tmp_path / "first_host"
    driver_cwd.mkdir()

    def jobs(worker_pid):
        return [{"kill": worker_pid, "at_step": 2, "steps": 8, "model": str(models["cogvideox"]),
                 "mesh": MESHES["dp"], "wait": HEARTBEAT * 3, **SIZE}]

    start = time.monotonic()
    driver, worker_code, _ = _start_slice(tmp_path, jobs, driver_cwd, driver_cwd)
    kill = _report(driver, tmp_path / "worker.log")["kill"]
    print("kill report:", kill)
    assert worker_code == -9
    assert kill["error"] and "worker 1" in kill["error"] and "incomplete" in kill["error"], kill
    assert kill["seconds_after_kill"] < 30, kill
    # The next call is refused at once with the same news, and the process is alive past the heartbeat timeout.
    assert kill["next_call"] and "worker 1" in kill["next_call"] and kill["next_call_seconds"] < 1, kill
    assert kill["alive"] is True
    assert time.monotonic() - start < 600


def test_a_worker_that_never_joins_is_named_and_the_first_process_lives_on(tmp_path):
    (tmp_path / "jobs.json").write_text("[]")
    env = _slice_env(_free_port(), 0)
    env["TPU_VIDEO_JOIN_TIMEOUT"] = "3"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tpu_runtime", "generate", "--model", "nothing-needed",
                           "--output-dir", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # an error reported, not a crash (which would be -6)
    assert "the slice is incomplete: worker 1 did not join 127.0.0.1:" in proc.stderr
    assert "within 3 s" in proc.stderr and "python -m tpu_runtime worker" in proc.stderr
    assert time.monotonic() - start < 120


class _Store:
    """The coordination service's key-value calls the slice makes, in memory."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def key_value_try_get(self, key):
        return self.values[key]


@pytest.mark.parametrize("process_id, broken", [(0, None), (0, "worker 1 stopped"), (1, None)],
                         ids=["first", "first-after-a-worker-died", "worker"])
def test_closing_the_slice_stops_the_heartbeat_on_every_process(process_id, broken):
    """At exit the heartbeat thread must end: left running into the interpreter's shutdown inside the store's
    client it aborted the first process after a worker was killed (exit -6, "FATAL: exception not rethrown"), once
    in a full test run. Only a healthy slice's first process sends the workers a shutdown."""
    from tpu_runtime.multihost.transport import PREFIX, Slice

    store = _Store()
    slice_ = Slice(store, process_id, 2, worker_timeout=5, heartbeat_timeout=5)
    slice_.start_heartbeat()
    deadline = time.monotonic() + 5
    while f"{PREFIX}alive/{process_id}" not in store.values and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slice_._heartbeat.is_alive()
    slice_.broken = broken
    slice_.close()
    assert not slice_._heartbeat.is_alive()
    shutdown = any(k.startswith(f"{PREFIX}call/") for k in store.values)
    assert shutdown == (process_id == 0 and broken is None)


class _SharedStore:
    """The coordination service's key-value store in memory, shared by the slice's processes as threads: blocking
    gets, and deletes that take everything under a key, as the service's."""

    def __init__(self):
        import threading

        self.values, self.changed = {}, threading.Condition()

    def client(self, slow_after: str | None = None):
        return _StoreClient(self, slow_after)


class _StoreClient:
    """One process's client; ``slow_after``: after writing a key holding that text, this process stalls for a
    second (descheduled on a busy machine) before its next call."""

    def __init__(self, store: _SharedStore, slow_after: str | None):
        self.store, self.slow_after = store, slow_after

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.store.changed:
            self.store.values[key] = value
            self.store.changed.notify_all()
        if self.slow_after and self.slow_after in key:
            time.sleep(1.0)

    key_value_set_bytes = key_value_set

    def key_value_try_get(self, key):
        with self.store.changed:
            if key not in self.store.values:
                raise KeyError(f"NOT_FOUND: {key}")
            return self.store.values[key]

    def blocking_key_value_get(self, key, timeout_ms):
        with self.store.changed:
            if not self.store.changed.wait_for(lambda: key in self.store.values, timeout_ms / 1000):
                raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
            return self.store.values[key]

    blocking_key_value_get_bytes = blocking_key_value_get

    def key_value_delete(self, key):
        with self.store.changed:
            for k in [k for k in self.store.values if k == key or k.startswith(key + "/")]:
                del self.store.values[k]


def test_a_refused_call_leaves_a_slow_worker_in_step(tmp_path):
    """A call a worker refuses (here: a model file it lacks) is refused on every process, and the next call is
    answered. The first process publishes "abort" and used to delete the call's keys at once: a worker
    descheduled between its answer and reading that word (a busy machine: a CI run) then waited for a word that
    never came, and the next call timed out as "worker 1 did not answer". The worker here stalls a second after
    each answer; the first process now waits until every worker has read the word."""
    import threading
    from types import SimpleNamespace

    from tpu_runtime.multihost.transport import Slice
    from tpu_runtime.multihost.worker import serve

    store = _SharedStore()
    first = Slice(store.client(), 0, 2, worker_timeout=20, heartbeat_timeout=60)
    worker = Slice(store.client(slow_after="/ready/"), 1, 2, worker_timeout=20, heartbeat_timeout=60)
    for s in (first, worker):
        s.start_heartbeat()
    runtime = SimpleNamespace(devices=[0, 1], local_devices=[1])
    code = []
    serving = threading.Thread(target=lambda: code.append(serve(runtime, worker)), daemon=True)
    serving.start()
    try:
        for k in range(3):  # each refused, each answered: the slice stays in step
            missing = str(tmp_path / f"model_{k}.safetensors")
            start = time.monotonic()
            with pytest.raises(InputError, match=f"worker 1: {missing} is missing on this host"):
                first.call("open", None, None, (), {}, lambda a, kw: None, files={missing: "1:abc"},
                           cls_name="CogVideoXFamily")
            assert time.monotonic() - start < 15  # the stall and the polling: about 1.1 s
        assert first._next == 3 and not first.broken
    finally:
        first.close()
        serving.join(timeout=10)
        worker.close()
    assert code == [0]  # the worker saw the shutdown of call 3: it had followed every call


def test_a_different_file_on_a_worker_is_named(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x" * 1000)
    (tmp_path / ".cache").mkdir()  # the hub's download records differ from host to host: not compared
    (tmp_path / ".cache" / "model.safetensors.metadata").write_text("etag, time")
    prints = source_fingerprints([tmp_path])
    assert prints == {str(f): file_fingerprint(f)}
    _check_files(prints)  # the same file passes
    f.write_bytes(b"y" * 1000)
    with pytest.raises(InputError, match="model.safetensors differs from the first host"):
        _check_files(prints)
    os.remove(f)
    with pytest.raises(InputError, match="model.safetensors is missing on this host"):
        _check_files(prints)


# --- the README's launch lines; a worker lost inside a collective ---------------------------------------------------
def test_the_readme_launch_lines_work_and_both_exit_cleanly(two_processes):
    """The slice of the tests above was launched as the README says; every call ran on both processes and both
    left without an error when the first process closed the slice."""
    _, report, worker_code, worker_log, driver_stderr = two_processes
    assert report["processes"] == 2 and report["cogvideox_dp"]["devices"] == 8
    assert worker_code == 0 and "the first process closed the slice" in worker_log
    for text in (driver_stderr, worker_log):  # clean exits: no traceback, no JAX shutdown error
        assert "Traceback" not in text and "bad_cast" not in text and "error state" not in text, text[-3000:]


@pytest.mark.parametrize("pin", [False, True], ids=["free", "one_core"])
@pytest.mark.parametrize("repeat", range(int(os.environ.get("TPU_VIDEO_KILL_REPEATS", "1"))))
def test_a_worker_killed_inside_a_step_is_reported_within_the_bound(models, tmp_path, pin, repeat):
    """The worker is killed from another thread while the first process runs a step's program (inside its
    collectives, not at a step boundary): the first process reports it within the bound (the heartbeat's
    timeout, which the CPU collectives' timeout follows, plus a margin), never waits silently, and lives on.
    TPU_VIDEO_KILL_REPEATS repeats it (the closing note's 10 x 2 runs)."""
    def jobs(worker_pid):
        return [{"kill": worker_pid, "inside": 0.05 + 0.1 * repeat, "steps": 60, "model": str(models["cogvideox"]),
                 "mesh": MESHES["tp"], "wait": 0, **SIZE}]

    (tmp_path / "worker_cwd").mkdir()
    driver, worker_code, _ = _start_slice(tmp_path, jobs, tmp_path, tmp_path / "worker_cwd", readme=True, pin=pin)
    kill = _report(driver, tmp_path / "worker.log")["kill"]
    print("kill inside a step:", json.dumps({k: v for k, v in kill.items() if k != "next_call"}))
    assert worker_code == -9
    assert kill["error"] and "worker 1" in kill["error"] and "incomplete" in kill["error"], kill
    assert kill["steps_done"] < 60, kill  # it did not sample on without the worker
    bound = HEARTBEAT + 5 + 10  # heartbeat timeout, the collectives' margin over it, and slack for a starved CPU
    assert kill["seconds_after_kill"] < bound, kill
    assert kill["next_call"] and kill["next_call_seconds"] < 1 and kill["alive"] is True, kill
    assert "Traceback" not in driver.stderr, driver.stderr[-3000:]
