"""Is ``package.module:function`` a usable reward function? The shared wording, and the check inside the sandbox.

It is checked twice, never by running the module outside the sandbox:

1. :func:`verl_tasks.rewards.source_check.check_statically`, when a config is parsed (the DAG
   processor, the api-server's plugin, every worker: processes that hold credentials). It finds
   the module without executing it and reads its source.
2. :func:`load_reward_function` here, inside the reward sandbox (``verl_tasks.rewards.worker``)
   when it starts: the real import, ``getattr``, ``callable`` and
   ``inspect.signature(fn).bind(...)``. A failure there stops the first unit that starts a sandbox
   (or the pre-flight, :func:`verl_tasks.rewards.sandbox.preflight`) with the same wording.

Both raise :class:`RewardFunctionError`, whose message does not repeat the path; callers prefix it.
The worker imports this module at every sandbox start: it stays small, with few imports.
"""
from __future__ import annotations

import importlib
from types import FunctionType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

REWARD_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
SIGNATURE = f"fn({', '.join(REWARD_ARGS)})"
CO_VARARGS = 0x04  # inspect.CO_VARARGS: importing inspect costs ~10 ms at every worker start


class RewardFunctionError(ValueError):
    """``rewards.function`` names nothing usable; the message says why (without the path)."""


def split_path(path: str) -> tuple[str, str]:
    """``"pkg.mod:fn"`` -> ``("pkg.mod", "fn")``. Raises RewardFunctionError for anything else."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or not all(p.isidentifier() for p in module_name.split(".")) \
            or not attr.isidentifier():
        raise RewardFunctionError("must be an import path 'package.module:function'")
    return module_name, attr


def cannot_import(module_name: str, err: object) -> RewardFunctionError:
    return RewardFunctionError(f"module {module_name!r} cannot be imported ({err}); check the name and that it "
                               f"is installed where the workers run")


def no_attribute(module_name: str, attr: str) -> RewardFunctionError:
    return RewardFunctionError(f"module {module_name!r} has no attribute {attr!r}")


def not_a_function(attr: str, kind: str) -> RewardFunctionError:
    return RewardFunctionError(f"{attr!r} is a {kind}, not a function")


def wrong_signature(err: object) -> RewardFunctionError:
    return RewardFunctionError(f"cannot be called as {SIGNATURE} ({err}); give it verl's compute_score signature")


def import_raised(module_name: str, err: BaseException) -> RewardFunctionError:
    return RewardFunctionError(f"importing {module_name!r} raised {type(err).__name__}: {err}")


def load_reward_function(path: str) -> Callable[..., Any]:
    """Import ``path`` and check it can be called as verl's compute_score. Runs the module's code:
    call it only inside the reward sandbox.

    Raises:
        RewardFunctionError: as ``source_check.check_statically``, now from the imported module.
    """
    module_name, attr = split_path(path)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise cannot_import(module_name, err) from None
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's module failed while importing: say so, in one line
        raise import_raised(module_name, err) from None
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise no_attribute(module_name, attr) from None
    if not callable(fn):
        raise not_a_function(attr, type(fn).__name__)
    problem = _plain_function_problem(fn)
    if problem is None and not isinstance(fn, FunctionType):
        import inspect  # classes, partials, callable objects (~10 ms to import: plain functions skip it)

        try:
            inspect.signature(fn).bind(*REWARD_ARGS)
        except TypeError as err:
            problem = str(err)
        except ValueError:  # no signature available (a builtin): it is called and checked per sample
            pass
    if problem is not None:
        raise wrong_signature(problem)
    return fn


def _plain_function_problem(fn: object) -> str | None:
    """Why a plain ``def``/``lambda`` cannot take the four positional arguments, or None (also for
    anything that is not a plain function: :func:`load_reward_function` asks ``inspect`` then)."""
    if not isinstance(fn, FunctionType):
        return None
    code = fn.__code__
    positional = code.co_varnames[:code.co_argcount]
    required = positional[:len(positional) - len(fn.__defaults__ or ())]
    kwonly = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    if len(positional) < len(REWARD_ARGS) and not code.co_flags & CO_VARARGS:
        return "too many positional arguments"
    if len(required) > len(REWARD_ARGS):
        return f"missing a required argument: {required[len(REWARD_ARGS)]!r}"
    missing = [name for name in kwonly if name not in (fn.__kwdefaults__ or {})]
    if missing:
        return f"missing a required argument: {missing[0]!r}"
    return None


__all__ = ["REWARD_ARGS", "RewardFunctionError", "load_reward_function", "split_path"]
