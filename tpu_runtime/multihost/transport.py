"""The transport of a multi-host slice: joining it, the key-value store, heartbeats, and the first process's side of
a replayed call. One process per host, every process running the same programs on one mesh over all chips.

JAX's multi-controller runtime (``jax.distributed``) joins the processes; this module makes the first process (the
ComfyUI server, or the CLI) the only one with a graph. Every public call on a model family there — opening it,
``encode``, ``sample``, ``decode``, ``apply_loras``, ``release`` — is *replayed*: before it runs, a small JSON message
(names, paths, numbers, the ids of earlier results) goes to the workers through JAX's coordination key-value
store, each worker checks that it can run it (the same model files, the same LoRA files), and then every process
runs it, so the same compiled programs are called everywhere in the same order. Stage values (embeddings,
latents) stay where they were made: each worker keeps its own copy of what it computed, and messages name them
by id. Inputs are placed with per-process shards, and host copies of results are made from each process's
replicas (or an all-gather), so the first process gets its results without the workers sending any.

Steps are kept in lock-step through the same store: before each sampling step the first process publishes go or
stop (Cancel), and checks that every worker is alive, so a worker that dies is reported at the next step
boundary (or at once when a collective fails), and the slice is marked incomplete instead of hanging.

Environment of the first process (``python -m tpu_runtime worker`` takes the same as flags):
``TPU_VIDEO_MULTIHOST=1`` joins a slice; ``TPU_VIDEO_COORDINATOR`` (host:port of the first process),
``TPU_VIDEO_PROCESSES`` and ``TPU_VIDEO_PROCESS_ID`` where JAX cannot find them itself (a TPU VM tells it);
``TPU_VIDEO_JOIN_TIMEOUT`` (s, default 300) and ``TPU_VIDEO_WORKER_TIMEOUT`` (s, default 120): how long to wait
for the workers to join and to answer; ``TPU_VIDEO_HEARTBEAT_TIMEOUT`` (s, default 20): silence after which the
coordinator counts a process as gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from ..errors import InputError, SliceError
from .codec import Encoder, stage_value_types
from ..engine.replay import multihost_requested

log = logging.getLogger(__name__)

PREFIX = "tpu_video/"
WORKER_ENV = "TPU_VIDEO_WORKER"  # set by `python -m tpu_runtime worker`: this process is not the first
KEEP_VALUES = 64  # stage values each worker keeps (oldest dropped first; the first process mirrors the order)
BLOB_CHUNK = 1 << 20  # bytes per key-value entry when a tensor must be sent


# --- joining -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SliceSettings:
    coordinator: str | None = None  # host:port of process 0; None: JAX finds it (TPU VM)
    processes: int | None = None
    process_id: int | None = None
    join_timeout: int = 300
    worker_timeout: float = 120.0
    heartbeat_timeout: int = 20  # s without a heartbeat before the coordinator counts a process as gone

    @classmethod
    def from_env(cls) -> "SliceSettings | None":
        """The slice to join, or None when ``TPU_VIDEO_MULTIHOST`` is not set (one process)."""
        if not multihost_requested():
            return None

        def number(name, kind, default=None):
            raw = os.environ.get(name, "").strip()
            if not raw:
                return default
            try:
                return kind(raw)
            except ValueError:
                raise InputError(f"{name}={raw!r} must be a number") from None

        settings = cls(coordinator=os.environ.get("TPU_VIDEO_COORDINATOR") or None,
                       processes=number("TPU_VIDEO_PROCESSES", int), process_id=number("TPU_VIDEO_PROCESS_ID", int),
                       join_timeout=number("TPU_VIDEO_JOIN_TIMEOUT", int, 300),
                       worker_timeout=number("TPU_VIDEO_WORKER_TIMEOUT", float, 120.0),
                       heartbeat_timeout=number("TPU_VIDEO_HEARTBEAT_TIMEOUT", int, 20))
        # The first process (ComfyUI, generate) is process 0: where the coordinator and the process count are
        # given by hand (not a TPU VM, where JAX finds every host's index), its id need not be.
        if settings.process_id is None and settings.coordinator and settings.processes \
                and os.environ.get(WORKER_ENV) != "1":
            settings.process_id = 0
        return settings


def _join_message(settings: SliceSettings, exc: Exception, seconds: float) -> str:
    """What failed when joining: the workers' absence after the join timeout, or what JAX said at once."""
    n = settings.processes or 0
    if seconds >= settings.join_timeout - 1 or "DEADLINE_EXCEEDED" in str(exc):
        names = ", ".join(_worker_names(n)[i] for i in range(1, n)) if n > 1 else "the workers"
        return (f"the slice is incomplete: {names} did not join {settings.coordinator or 'the coordinator'} within "
                f"{settings.join_timeout} s. Start `python -m tpu_runtime worker` on every other host (same "
                "coordinator and process count), then restart this process")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = lines[0][:300] if lines else type(exc).__name__
    return (f"joining the slice (coordinator {settings.coordinator or 'found by JAX'}, {n or '?'} processes, this "
            f"one {settings.process_id if settings.process_id is not None else 'found by JAX'}) failed after "
            f"{seconds:.0f} s: {why}. Check TPU_VIDEO_COORDINATOR, TPU_VIDEO_PROCESSES and TPU_VIDEO_PROCESS_ID "
            "(or the worker's --coordinator, --processes, --process-id), then restart this process")


def collective_timeout(heartbeat_timeout: float) -> None:
    """CPU collectives across processes (gloo) wait 30 minutes for a peer by default: a worker killed inside
    one would leave the first process blocked, silent, that long. Give them the heartbeat's bound (plus a
    margin), so a wait for a dead peer ends when the heartbeat has named it. Set before the backend starts; a
    value the user put in XLA_FLAGS stays."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_collective_timeout_seconds" not in flags:
        seconds = int(max(10, heartbeat_timeout + 5))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_timeout_seconds={seconds}".strip()


def quiet_shutdown(leave: bool = False) -> None:
    """JAX's exit handler shuts the distributed client down and prints what that raises: after a failed join
    (the client is in an error state: the failure has been reported already) and on a worker once the first
    process is gone (std::bad_cast). ``leave``: try the shutdown here first (a worker leaving a slice that is still
    up), quietly; either way JAX's handler then has nothing left to shut down."""
    import contextlib

    from jax._src import distributed

    if leave:
        try:
            distributed.global_state.shutdown()
        except Exception as exc:  # noqa: BLE001 - the slice is ending; what the client says of it changes nothing
            log.debug("leaving the slice: %s", exc)
    with contextlib.suppress(Exception):
        distributed.global_state.client = None
        distributed.global_state.service = None
        distributed.global_state.preemption_sync_manager = None


def _worker_names(processes: int) -> dict[int, str]:
    """Process id -> how users know that host (TPU VMs list the workers' hostnames)."""
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    return {i: f"worker {i}" + (f" ({hosts[i]})" if len(hosts) == processes else "") for i in range(processes)}


_join_failure: SliceError | None = None


def join(settings: SliceSettings) -> "Slice":
    """Join the slice with ``jax.distributed`` (before JAX starts a backend) and return it.

    JAX's default coordination client ends the process when a peer misses its heartbeats or never joins; that
    would take the ComfyUI server down with a worker. The client is made with a callback instead, and the
    service with recoverable tasks, so a lost worker becomes an error this process reports and survives."""
    global _join_failure
    if _join_failure is not None:  # JAX joins once per process: a failed join stays failed until a restart
        raise SliceError(str(_join_failure))
    import jax
    from jax._src import distributed
    from jax._src.lib import _jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU meshes across processes
    jax.config.update("jax_enable_recoverability", True)
    # JAX's preemption service turns SIGTERM into a preemption notice, so `kill` (or a service manager) could no
    # longer stop the ComfyUI server; the pack does not checkpoint on preemption, so it is left off.
    jax.config.update("jax_enable_preemption_service", False)
    original = _jax.get_distributed_runtime_client

    def on_error(status, *_):
        log.error("the slice's coordination service reports: %s", status)

    _jax.get_distributed_runtime_client = functools.partial(original, missed_heartbeat_callback=on_error)
    collective_timeout(settings.heartbeat_timeout)
    start = time.perf_counter()
    try:
        jax.distributed.initialize(settings.coordinator, settings.processes, settings.process_id,
                                   initialization_timeout=settings.join_timeout,
                                   heartbeat_timeout_seconds=settings.heartbeat_timeout,
                                   shutdown_timeout_seconds=30)  # a stuck worker must not hold up our exit
    except Exception as exc:  # noqa: BLE001 - the client reports a missing peer in several ways
        seconds = time.perf_counter() - start
        _join_failure = SliceError(_join_message(settings, exc, seconds))
        log.debug("jax.distributed.initialize: %s", exc)
        quiet_shutdown()
        raise _join_failure from None
    finally:
        _jax.get_distributed_runtime_client = original
    state = distributed.global_state
    joined = Slice(state.client, jax.process_index(), jax.process_count(), settings.worker_timeout,
                   settings.heartbeat_timeout)
    joined.start_heartbeat()
    log.info("joined a slice of %d processes as process %d in %.1f s", joined.processes, joined.process_id,
             time.perf_counter() - start)
    return joined


# --- values in messages --------------------------------------------------------------------------------------------
def file_fingerprint(path: Path) -> str:
    """Size and the hash of the first 64 KiB (a safetensors header names every tensor, its shape and offsets)."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    return f"{path.stat().st_size}:{hashlib.sha256(head).hexdigest()[:16]}"


def source_fingerprints(paths) -> dict[str, str]:
    """path -> fingerprint of every file under ``paths`` (files or folders; hidden ones skipped: the hub's download
    records differ from host to host)."""
    out = {}
    for p in paths:
        p = Path(p).expanduser()
        files = sorted(f for f in p.rglob("*") if f.is_file() and not any(
            part.startswith(".") for part in f.relative_to(p).parts)) if p.is_dir() else [p]
        for f in files:
            if f.is_file():
                out[str(f)] = file_fingerprint(f)
    return out


# --- the slice -----------------------------------------------------------------------------------------------------
class Slice:
    """This process's place in a multi-host slice: the first process drives, the others replay."""

    def __init__(self, client, process_id: int, processes: int, worker_timeout: float, heartbeat_timeout: float):
        self.client, self.process_id, self.processes = client, process_id, processes
        self.worker_timeout = float(worker_timeout)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.names = _worker_names(processes)
        self.broken: str | None = None
        self._next = 0
        self._running, self._barriers, self._agreed = -1, 0, 0
        self._inside = threading.local()
        self._lock = threading.RLock()
        self._known: OrderedDict[int, None] = OrderedDict()
        self._models: dict[int, int] = {}  # id(family) -> model id
        self._closed = False
        self._heartbeat: threading.Thread | None = None

    @property
    def is_driver(self) -> bool:
        return self.process_id == 0

    @property
    def workers(self) -> list[int]:
        return list(range(1, self.processes))

    # key-value store
    def _set(self, key: str, value: str, overwrite: bool = False) -> None:
        self.client.key_value_set(PREFIX + key, value, allow_overwrite=overwrite)

    def _try_get(self, key: str, wait_ms: int = 0) -> str | None:
        try:
            if wait_ms:
                return self.client.blocking_key_value_get(PREFIX + key, wait_ms)
            return self.client.key_value_try_get(PREFIX + key)
        except Exception:  # noqa: BLE001 - not there (yet): NOT_FOUND / DEADLINE_EXCEEDED
            return None

    def start_heartbeat(self) -> None:
        """Each process bumps its counter in the store twice a second; the first process counts a worker whose
        counter stops moving for ``heartbeat_timeout`` seconds as gone. (The coordination service's own view of
        live tasks is a collective call, which a busy worker would not join.)"""
        self._seen = {i: (None, time.monotonic()) for i in range(self.processes)}

        def beat():
            count = 0
            while not self._closed:
                count += 1
                try:
                    self._set(f"alive/{self.process_id}", str(count), overwrite=True)
                except Exception as exc:  # noqa: BLE001 - the coordinator is gone; the loops notice it themselves
                    log.warning("heartbeat stopped: %s", exc)
                    return
                time.sleep(0.5)

        self._heartbeat = threading.Thread(target=beat, name="tpu-video-heartbeat", daemon=True)
        self._heartbeat.start()

    def dead(self, ids=None) -> list[int]:
        """Process ids (of ``ids``, default every other process) gone: silent for ``heartbeat_timeout`` seconds,
        or, seen from a worker, the first process (which holds the store) unreachable."""
        ids = [i for i in range(self.processes) if i != self.process_id] if ids is None else list(ids)
        gone = []
        now = time.monotonic()
        for i in ids:
            try:
                count = self.client.key_value_try_get(f"{PREFIX}alive/{i}")
            except Exception as exc:  # noqa: BLE001 - NOT_FOUND before its first beat; UNAVAILABLE: no store
                if "UNAVAILABLE" in str(exc):
                    return ids
                count = None
            last, since = self._seen[i]
            if count != last:
                self._seen[i] = (count, now)
            elif now - since > self.heartbeat_timeout:
                log.warning("process %d: heartbeat %s unchanged for %.1f s", i, count, now - since)
                gone.append(i)
        return gone

    def _fail(self, why: str) -> SliceError:
        self.broken = why
        return SliceError(why)

    def check_workers(self, during: str) -> None:
        dead = self.dead(self.workers)
        if dead:
            names = ", ".join(self.names[i] for i in dead)
            raise self._fail(f"the slice is incomplete: {names} stopped ({during}). Restart "
                             "`python -m tpu_runtime worker` there and restart this process (ComfyUI: the server)")

    def _collect(self, key: str, during: str, timeout: float | None = None) -> dict[int, str]:
        """Each worker's answer under ``key/<id>``; a dead or silent worker is reported by name in bounded time."""
        answers: dict[int, str] = {}
        timeout = self.worker_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while len(answers) < len(self.workers):
            for i in self.workers:
                if i not in answers:
                    got = self._try_get(f"{key}/{i}", wait_ms=200 if len(answers) == len(self.workers) - 1 else 0)
                    if got is not None:
                        answers[i] = got
            if len(answers) == len(self.workers):
                break
            self.check_workers(during)
            if time.monotonic() > deadline:
                silent = ", ".join(self.names[i] for i in self.workers if i not in answers)
                raise self._fail(f"the slice is incomplete: {silent} did not answer within {timeout:g} s "
                                 f"({during}); it is stuck or was started for another slice. Restart the workers "
                                 "and this process")
            time.sleep(0.05)
        return answers

    def running(self, n: int) -> None:
        """This process starts running replayed call ``n`` (its barriers and agreements are counted from here)."""
        self._running, self._barriers, self._agreed = n, 0, 0

    def agree(self, what: str, value):
        """A host decision of the current call (JSON-able) that every process takes alike: the first process's,
        which it publishes; a worker waits for it (a step cache's read-back: each process computed the same
        number, but one decision must not hang on the last bit of a float)."""
        n, k = self._running, self._agreed
        self._agreed += 1
        key = f"agree/{n}/{k}"
        if self.is_driver:
            self._set(key, json.dumps(value))
            return value
        deadline = time.monotonic() + self.worker_timeout
        while (raw := self._try_get(key, wait_ms=1000)) is None:
            if self.dead([0]):
                raise SliceError("the first process is gone")
            if time.monotonic() > deadline:
                raise SliceError(f"the first process did not publish {what} within {self.worker_timeout:g} s")
        return json.loads(raw)

    def barrier(self, what: str) -> None:
        """Every process of the slice reaches this point of the current call before any goes on: called after each
        stage program is compiled, so no process waits inside a program's collectives while a peer is still
        compiling it (that wait would count against the collectives' timeout, which is kept near the heartbeat's
        so that a peer lost inside a collective is named in bounded time)."""
        n, k = self._running, self._barriers
        self._barriers += 1
        key = f"barrier/{n}/{k}"
        if self.is_driver:
            # A peer compiling the same program takes about as long; a dead one is named by its heartbeat.
            self._collect(key, f"waiting for every host to compile {what}", timeout=max(self.worker_timeout, 1800))
            self._set(key, "go")
            return
        self._set(f"{key}/{self.process_id}", "ok")
        while self._try_get(key, wait_ms=1000) is None:
            if self.dead([0]):
                raise SliceError("the first process is gone")

    # the first process
    @contextlib.contextmanager
    def _replaying(self):
        self._inside.active = True
        try:
            yield
        finally:
            self._inside.active = False

    def nested(self) -> bool:
        return getattr(self._inside, "active", False)

    def call(self, op: str, model, method: str | None, args: tuple, kwargs: dict, run: Callable[..., Any],
             files: dict[str, str] | None = None, cls_name: str | None = None):
        """Run ``run(args, kwargs)`` here and on every worker (``op``: "open" builds a family, "call" calls
        ``method`` of ``model``). Returns this process's result."""
        if self.nested():
            return run(args, kwargs)
        with self._lock:
            if self.broken:
                raise SliceError(self.broken)
            n = self._next
            self._next += 1
            what = f"{cls_name or type(model).__name__}.{method or 'open'}"
            encoder = Encoder(self._known, self._models)
            message = {"op": op, "n": n, "method": method, "cls": cls_name,
                       "model": getattr(model, "replay_id", None),
                       "args": encoder(list(args)), "kwargs": encoder({k: v for k, v in kwargs.items()})}
            fingerprints = dict(files or {})
            for p in encoder.paths:
                path = Path(p)
                if path.exists():
                    fingerprints.update(source_fingerprints([path]))
            message["files"] = fingerprints
            for key, blob in encoder.blobs.items():
                chunks = [blob[i:i + BLOB_CHUNK] for i in range(0, len(blob), BLOB_CHUNK)] or [b""]
                self._set(f"blob/{n}/{key}", str(len(chunks)))
                for j, chunk in enumerate(chunks):
                    self.client.key_value_set_bytes(f"{PREFIX}blob/{n}/{key}/{j}", chunk)
            self._set(f"call/{n}", json.dumps(message))
            ready = self._collect(f"ready/{n}", f"checking {what}")
            refused = {i: why for i, why in ready.items() if why != "ok"}
            self._set(f"go/{n}", "abort" if refused else "run")
            if refused:
                # every worker has read "abort" before the call's keys are deleted: one that had not would wait
                # for a word that never comes, and the next call would find it stuck
                self._collect(f"done/{n}", f"{what} being refused")
                self._forget(n)
                raise InputError("; ".join(f"{self.names[i]}: {why}" for i, why in refused.items()))
            gate = None
            if "should_stop" in kwargs or method == "sample":
                gate = self._step_gate(n, kwargs.get("should_stop"), what)
                kwargs = {**kwargs, "should_stop": gate}
            try:
                self.running(n)
                with self._replaying():
                    result = run(args, kwargs)
            except SliceError:
                raise
            except BaseException as exc:  # Ctrl-C too: the workers must not wait for a step that never comes
                if gate is not None:
                    gate.close()  # e.g. ComfyUI's progress bar raised on Cancel between two steps
                self._after_failure(n, what, exc)
                raise
            done = self._collect(f"done/{n}", f"running {what}")
            failed = {i: why for i, why in done.items() if why != "ok"}
            if failed:
                raise self._fail("the slice is out of step: " + "; ".join(
                    f"{self.names[i]} failed {what}: {why}" for i, why in failed.items()) +
                    ". Restart the workers and this process")
            self._forget(n)
            self._remember(n, result)
            return result

    def _after_failure(self, n: int, what: str, exc: Exception) -> None:
        """This process's call failed: a worker that died is the cause to report; otherwise the workers fail the
        same way (bad settings, Cancel), and their answers are collected so the next call starts in step."""
        deadline = time.monotonic() + self.heartbeat_timeout + 2  # a dead peer breaks a collective at once
        while time.monotonic() < deadline:
            if self.dead(self.workers):
                break
            if all(self._try_get(f"done/{n}/{i}") is not None for i in self.workers):
                break
            time.sleep(0.1)
        try:
            self.check_workers(f"during {what}")
            self._collect(f"done/{n}", f"after {what} failed")
        except SliceError as lost:
            raise lost from exc
        self._forget(n)

    def _step_gate(self, n: int, should_stop, what: str) -> "_StepGate":
        return _StepGate(self, n, should_stop, what)

    def _remember(self, n: int, result) -> None:
        if type(result).__name__ in stage_value_types():
            result.replay_id = n
            self._known[n] = None
            while len(self._known) > KEEP_VALUES:
                self._known.popitem(last=False)

    def _forget(self, n: int) -> None:
        for key in ("call", "go"):
            self._delete(f"{key}/{n}")
        for i in self.workers:
            self._delete(f"ready/{n}/{i}")
            self._delete(f"done/{n}/{i}")
        self._delete(f"step/{n}")  # the store deletes a key with everything under it
        self._delete(f"barrier/{n}")
        self._delete(f"agree/{n}")
        self._delete(f"blob/{n}")

    def _delete(self, key: str) -> None:
        with contextlib.suppress(Exception):
            self.client.key_value_delete(PREFIX + key)

    def open_model(self, family, args: tuple, kwargs: dict) -> None:
        """``family`` was just built here: build the same on every worker (its files checked there first)."""
        n = self._next
        self.call("open", None, None, args, kwargs, lambda a, k: None,
                  files=source_fingerprints(family.source_paths()), cls_name=type(family).__name__)
        self.register_model(family, n)

    def register_model(self, family, n: int) -> None:
        family.replay_id = n
        self._models[id(family)] = n

    def close(self) -> None:
        """At exit: the first process tells the workers to stop (unless one is already gone), then every process
        stops its heartbeat. A daemon thread caught inside the store's C++ client while the interpreter shuts
        down aborts the process ("FATAL: exception not rethrown", seen after a worker was killed), so the
        heartbeat ends and is joined here, before that."""
        if self._closed:
            return
        self._closed = True
        if self.is_driver and not self.broken:
            with self._lock:
                self._set(f"call/{self._next}", json.dumps({"op": "shutdown", "n": self._next}))
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=5)


class _StepGate:
    """The first process's ``should_stop`` for one replayed call: before each step, every worker has reached it
    (so no process waits inside a step's collectives for a peer still compiling or still in the last step: that
    wait is then bounded by a dead peer only, which the collectives' timeout and the heartbeat both name); then
    stop or go (Cancel), published for the workers. ``close`` tells workers waiting for the next word to stop
    (the call failed here between two steps)."""

    def __init__(self, slice_: Slice, n: int, should_stop, what: str):
        self.slice, self.n, self.should_stop, self.what = slice_, n, should_stop, what
        self.count = 0

    def __call__(self) -> bool:
        i = self.count
        during = f"before step {i + 1} of {self.what}"
        self.slice.check_workers(during)
        self.slice._collect(f"step/{self.n}/at/{i}", during)
        stop = bool(self.should_stop()) if self.should_stop is not None else False
        self.slice._set(f"step/{self.n}/{i}", "stop" if stop else "go")
        self.count += 1
        return stop

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.slice._set(f"step/{self.n}/{self.count}", "stop")
            self.count += 1
