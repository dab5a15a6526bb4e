"""One load measured in a fresh process (``bench``'s loading benchmarks): ``python -m tpu_runtime.tools.load_child
MODULE:FUNCTION PATH DTYPE [--no-accelerate]`` calls ``FUNCTION(PATH, DTYPE)`` (a family's loader, from its bench
module; it returns the bytes it loaded) and prints one JSON line: host seconds, the anonymous and file-backed
memory the load added at its peak, and the bytes loaded. ``--no-accelerate``: as users without accelerate run
diffusers (peft needs it too)."""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time


def rss() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith("Rss"))
    return int(fields["RssAnon"].split()[0]) * 1024, int(fields["RssFile"].split()[0]) * 1024


def measure(ref: str, path: str, dtype: str) -> dict:
    module, _, name = ref.partition(":")
    load = getattr(importlib.import_module(module), name)
    before, peak, done = rss(), [0, 0], threading.Event()

    def watch():
        while not done.is_set():
            now = rss()
            peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.perf_counter()
    loaded = load(path, dtype)
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    return {"seconds": seconds, "anon_increase_mib": (peak[0] - before[0]) / 2**20,
            "file_pages_increase_mib": (peak[1] - before[1]) / 2**20, "loaded_bytes": loaded}


if __name__ == "__main__":
    if "--no-accelerate" in sys.argv:
        sys.modules["accelerate"] = sys.modules["peft"] = None  # not installed
    ref, path, dtype = sys.argv[1:4]
    print(json.dumps(measure(ref, path, dtype)))
