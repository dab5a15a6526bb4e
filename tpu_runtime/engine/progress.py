"""What the runtime is preparing right now, for whoever shows it to the user.

A program's first run at a new shape (a sampler step, a VAE decode, a text encoder) is compiled first, which takes
from seconds to minutes; a program found in the persistent compilation cache or among the saved programs
(``program_store.py``) takes far less. The runtime says each of these here (``compiling``, ``loaded``): one line
when it starts, the same line with the seconds so far every ``TICK`` seconds while it lasts, and one line when it
is done, saying where the program came from. The runtime knows nothing of ComfyUI: ComfyUI's node layer installs a
listener at load (``nodes/comfy_bridge.py``) that shows the text on the node that is running, as ComfyUI's progress
text. A program the runtime already holds in memory says nothing.

``context``: a function the node layer sets, called in the thread that compiles when a program starts (ComfyUI's
executing node); its value goes to every listener with each line, the ticker's lines included (they come from a
thread of their own). A listener that fails costs its line, never the compile.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

TICK = 1.0  # seconds between the running lines of one compile

#: where a program came from, as ``Progress.source`` says it
COMPILED, PERSISTENT_CACHE, SAVED_PROGRAMS = "compiled", "persistent cache", "saved programs"


@dataclass
class Progress:
    """One program being prepared: ``what`` (the runtime's description of it), when it ``started``, the
    ``context`` the node layer gave it, and once done its ``seconds`` and ``source``."""

    what: str
    context: Any = None
    started: float = field(default_factory=time.perf_counter)
    seconds: float | None = None
    source: str | None = None

    @property
    def done(self) -> bool:
        return self.seconds is not None

    def text(self) -> str:
        if self.source == PERSISTENT_CACHE:
            return f"Loaded {self.what} from the persistent compilation cache in {self.seconds:.1f} s"
        if self.source == SAVED_PROGRAMS:
            return f"Loaded {self.what} from the saved programs in {self.seconds:.2f} s (no tracing, no compile)"
        if self.done:
            return f"Compiled {self.what} in {self.seconds:.1f} s"
        return f"Compiling {self.what}… {time.perf_counter() - self.started:.0f} s"


Listener = Callable[[str, Progress], None]  # (the line to show, the program it is about)

_listeners: list[Listener] = []
_lock = threading.Lock()
_context: Callable[[], Any] | None = None


def add_listener(listener: Listener) -> None:
    """Call ``listener(text, progress)`` with every line from now on (once, however often it is added)."""
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def set_context(context: Callable[[], Any] | None) -> None:
    """``context()`` is called in the compiling thread when a program starts; its value rides with its lines."""
    global _context
    _context = context


def _current_context() -> Any:
    if _context is None:
        return None
    try:
        return _context()
    except Exception:  # noqa: BLE001 - no context is still a line to show
        return None


def _publish(progress: Progress) -> None:
    with _lock:
        listeners = list(_listeners)
    if not listeners:
        return
    text = progress.text()
    for listener in listeners:
        try:
            listener(text, progress)
        except Exception as error:  # noqa: BLE001 - a line that cannot be shown is still in the log
            log.debug("a progress listener failed: %s: %s", type(error).__name__, error)


@contextlib.contextmanager
def compiling(what: str) -> Iterator[Progress]:
    """Around a program's trace and compile: a line now, one every ``TICK`` seconds while the block runs, and one
    at its end (``progress.source`` set in the block: ``COMPILED`` by default, ``PERSISTENT_CACHE`` when XLA found
    the program in its cache). A block that raises ends its lines without a last one."""
    progress = Progress(what, _current_context())
    _publish(progress)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(TICK):
            _publish(progress)

    ticker = threading.Thread(target=tick, name="tpu-video-compile-progress", daemon=True)
    ticker.start()
    try:
        yield progress
    finally:
        stop.set()
        ticker.join()
    progress.seconds = time.perf_counter() - progress.started
    progress.source = progress.source or COMPILED
    _publish(progress)


def loaded(what: str, seconds: float, source: str = SAVED_PROGRAMS) -> None:
    """A program taken from ``source`` in ``seconds`` instead of compiled: one line."""
    progress = Progress(what, _current_context(), seconds=seconds, source=source)
    _publish(progress)
