"""The worker loop of a multi-host slice: on every host but the first, wait for each call of the first process,
check it (the same model files, the same LoRA files), run it, answer. ``python -m tpu_runtime worker`` runs it."""

from __future__ import annotations

import functools
import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..errors import InputError, SliceError
from .codec import decode, stage_value_types
from .transport import KEEP_VALUES, PREFIX, Slice, file_fingerprint

log = logging.getLogger(__name__)


class _WorkerContext:
    def __init__(self, slice_: Slice, runtime, n: int):
        self.slice, self.runtime, self.n = slice_, runtime, n
        self.values: OrderedDict[int, Any] = OrderedDict()
        self.models: dict[int, Any] = {}

    def blob(self, key: str) -> bytes:
        s = self.slice
        count = int(s._try_get(f"blob/{self.n}/{key}", wait_ms=60_000))
        return b"".join(s.client.blocking_key_value_get_bytes(f"{PREFIX}blob/{self.n}/{key}/{j}", 60_000)
                        for j in range(count))


def _family_class(name: str):
    from ..families import registry

    return registry.family_class_named(name)


def _check_files(fingerprints: dict[str, str]) -> None:
    for path, expected in fingerprints.items():
        p = Path(path)
        if not p.is_file():
            raise InputError(f"{path} is missing on this host: every host reads the weights from the same path "
                             "(a shared disk, or a copy on each host)")
        got = file_fingerprint(p)
        if got != expected:
            raise InputError(f"{path} differs from the first host's copy (size:hash {got} vs {expected}): copy the "
                             "same file to every host")


def serve(runtime, slice_: Slice) -> int:
    """The worker loop: wait for each call of the first process, check it, run it, answer. Returns when the first
    process shuts the slice down (0) or is gone (1)."""
    from ..errors import Interrupted

    ctx = _WorkerContext(slice_, runtime, 0)
    log.info("%s ready: %d device(s) of %d in the slice", slice_.names[slice_.process_id],
             len(runtime.local_devices), len(runtime.devices))
    n = 0
    while True:
        raw = slice_._try_get(f"call/{n}", wait_ms=1000)
        if raw is None:
            if slice_.dead([0]):
                log.error("the first process is gone: stopping")
                return 1
            continue
        message = json.loads(raw)
        if message["op"] == "shutdown":
            log.info("the first process closed the slice")
            return 0
        ctx.n = n
        me = slice_.process_id
        try:
            _check_files(message.get("files", {}))
            args = decode(message["args"], ctx)
            kwargs = decode(message["kwargs"], ctx)
            if message["op"] == "open":
                cls = _family_class(message["cls"])
                prepared = functools.partial(cls, *args, **kwargs)
            elif message["op"] == "bridge":  # ComfyUI's own model, run by the first process's native bridge
                from .bridge import worker_call

                prepared = functools.partial(worker_call, runtime, message["method"], args)
            else:
                model = ctx.models[message["model"]]
                if message["method"] == "sample":
                    kwargs["should_stop"] = _worker_gate(slice_, n)
                prepared = functools.partial(getattr(model, message["method"]), *args, **kwargs)
            answer = "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the first process, which raises it
            answer = str(exc) or type(exc).__name__
        slice_._set(f"ready/{n}/{me}", answer)
        go = None
        while go is None:
            go = slice_._try_get(f"go/{n}", wait_ms=1000)
            if go is None and slice_.dead([0]):
                return 1
        if go == "run":
            try:
                what = (f"{message['cls']} {message['method']}" if message["op"] == "bridge"
                        else message.get("method") or f"open {message['cls']}")
                log.info("call %d: %s", n, what)
                slice_.running(n)
                result = prepared()
                if message["op"] == "open":
                    result.replay_id = n
                    ctx.models[n] = result
                elif type(result).__name__ in stage_value_types():
                    ctx.values[n] = result
                    while len(ctx.values) > KEEP_VALUES:
                        ctx.values.popitem(last=False)
                done = "ok"
            except Interrupted as exc:
                log.info("call %d: %s, as on the first process", n, exc)
                done = f"interrupted: {exc}"
            except Exception as exc:  # noqa: BLE001
                log.exception("call %d failed", n)
                done = f"{type(exc).__name__}: {exc}"
        else:
            done = "aborted"  # the first process refused the call (this host's answer or another's)
        slice_._set(f"done/{n}/{me}", done)
        n += 1


def _worker_gate(slice_: Slice, n: int):
    count = [0]

    def gate() -> bool:
        i = count[0]
        count[0] += 1
        slice_._set(f"step/{n}/at/{i}/{slice_.process_id}", "ok")  # here, compiled and done with the step before
        while True:
            got = slice_._try_get(f"step/{n}/{i}", wait_ms=1000)
            if got is not None:
                return got == "stop"
            if slice_.dead([0]):
                raise SliceError("the first process is gone")

    return gate
