"""Named hook points of this process, empty in production.

Units call :func:`fire` at a few points (``unit_start`` before an attempt does any work,
``rollout_generate``, ``update_step``, ``before_commit`` through :meth:`PhaseContext.hook`).
Only Python code running in the same process can :func:`register` a hook: nothing in a run's
conf, a config or an environment variable does. Tests that run units in their own process
register theirs through a fixture (``fault_hooks`` in ``tests/conftest.py``); the chaos and
end-to-end tests install theirs in the processes they start from a test-only ``sitecustomize``
they put on those processes' PYTHONPATH.
Torch-free and import-free, so loading it at interpreter start costs nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REGISTERED: dict[str, list[Callable[..., None]]] = {}


def register(name: str, fn: Callable[..., None]) -> None:
    """Call ``fn(**info)`` each time hook point ``name`` fires in this process."""
    _REGISTERED.setdefault(name, []).append(fn)


def unregister(name: str, fn: Callable[..., None]) -> None:
    """Remove one registration (tests that register in their own process clean up with it)."""
    if fn in _REGISTERED.get(name, []):
        _REGISTERED[name].remove(fn)


def fire(name: str, **info: Any) -> None:
    """Run the hooks registered for ``name``; a hook that raises fails the caller, as a fault would."""
    for fn in list(_REGISTERED.get(name, ())):
        fn(**info)
