"""Multi-host slices: one process per host, every process running the same programs on one mesh over all chips.

Importing the package installs the slice joiner the runtime calls (``TPU_VIDEO_MULTIHOST=1``; the engine's side is
``engine/replay.py``, which never imports this package). ``transport`` joins and talks to the slice, ``codec``
writes a replayed call's arguments as a message, ``worker`` runs the other hosts' loop.
"""

from ..engine.replay import install_joiner


def _join_from_env():
    from .transport import SliceSettings, join

    return join(SliceSettings.from_env())


install_joiner(_join_from_env)
