"""Run by test_ci.py in a pytest run of its own (``-n 2 --dist each``: every xdist worker runs it): each worker
compiles the same program, one worker after the other, and writes down the compilation cache folder it used and
what the compile cost. Not collected by the suite (its name is not ``test_*.py``)."""

import fcntl
import json
import os
from pathlib import Path

PROBE_ENV = "TPU_VIDEO_RUN_CACHE_PROBE"


def test_compile_a_program_one_worker_after_the_other():
    import jax
    import jax.numpy as jnp

    from tpu_runtime.engine.runtime import compile_stats, get_runtime

    out = Path(os.environ[PROBE_ENV])
    runtime = get_runtime()
    with open(out / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        before = compile_stats()
        jax.jit(lambda x: x * 2.5 - 0.75).lower(jax.ShapeDtypeStruct((5, 3), jnp.float32)).compile()
        delta = compile_stats().since(before)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (out / f"{worker}.json").write_text(json.dumps({
            "pid": os.getpid(), "cache": str(runtime.cache_dir), "backend_compiles": delta.backend_compiles,
            "persistent_cache_hits": delta.persistent_cache_hits}))
