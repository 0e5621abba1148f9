"""Keep a long-lived worker's warm heap out of Python's full garbage collections.

A process that runs many units (a Ray pool worker, ``verl-tasks run``) holds
hundreds of thousands of objects that live as long as it does: torch,
transformers and Great Expectations, the warm policy, the gate's context.
CPython's cyclic collector walks all of them on every full (generation 2)
collection: on the tiny experiment about 690k objects and 336 ms, about once in
140 epochs, on whichever unit happens to allocate at that moment
(``benchmarks/gc_pauses.py``).

``gc.freeze()`` moves every object tracked so far into a permanent generation
that no collection walks. It is O(1), so it is done after any unit that
imported modules (the heap grows for good mostly by imports and the first
caches). A frozen object is still freed by reference counting; only reference
cycles among frozen objects are never collected. The objects alive at those few
moments are the process's warm state (a policy model and its AdamW have no
cycles, and are freed when a newer version replaces them), so what stays is bounded.
"""
from __future__ import annotations

import gc
import sys
import threading

_LOCK = threading.Lock()
_MODULES_AT_LAST_FREEZE = 0


def freeze_after_imports() -> bool:
    """Freeze the heap when this process imported modules since the last call; True if it did."""
    global _MODULES_AT_LAST_FREEZE
    with _LOCK:
        modules = len(sys.modules)
        if modules == _MODULES_AT_LAST_FREEZE:
            return False
        gc.freeze()
        _MODULES_AT_LAST_FREEZE = modules
        return True


__all__ = ["freeze_after_imports"]
