"""The engine loop thread's priority: a lower one lets the replica's event loop and the ingress
answer at once while steps keep every core busy (``EngineConfig.loop_thread_nice``)."""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)


def lower_thread_priority(increment: int) -> int | None:
    """Add ``increment`` to the calling thread's nice value, capped at 19; return the new value.

    Linux only: there ``setpriority(PRIO_PROCESS, tid)`` applies to one thread (``sched(7)``,
    "the nice value is a per-thread attribute"); elsewhere, and for ``increment <= 0``, nothing
    changes and ``None`` comes back. Raising one's own nice value needs no privilege. An
    ``OSError`` (a sandbox that forbids it) is logged, not raised.
    """
    if increment <= 0 or not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        logger.warning("could not lower the engine loop thread's priority: %s", exc)
        return None
    return nice
