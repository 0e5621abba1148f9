"""Check ``rewards.function`` from the module's source, without importing it (done when a config is parsed).

:func:`check_statically` finds the module the way ``import`` would (``sys.meta_path`` finders,
parent packages' ``__path__``) **without executing any module**, reads its source and looks at
what the module binds at top level: a typo in the module or the function name, a literal that is
not a function, a ``def`` that cannot be called as ``fn(data_source, solution_str, ground_truth,
extra_info)`` and a syntax error fail here. What the source cannot decide (a name bound at import
time by code, ``from x import *``, a module ``__getattr__``, a decorated function, a compiled
module) passes, and is checked inside the sandbox when it starts
(:func:`verl_tasks.rewards.checks.load_reward_function`).
"""
from __future__ import annotations

import ast
import functools
import inspect
import os
import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from typing import Any

from verl_tasks.rewards.checks import (
    REWARD_ARGS,
    cannot_import,
    import_raised,
    no_attribute,
    not_a_function,
    split_path,
    wrong_signature,
)

# Source text that can bind module names in ways a reading of the top level cannot follow.
_DYNAMIC_MARKERS = ("globals(", "setattr(", "vars(", "__dict__", "sys.modules", "exec(")


def find_spec_statically(name: str) -> ModuleSpec | None:
    """The spec ``import name`` would use, or None when there is no such module.

    Unlike ``importlib.util.find_spec``, parent packages are not imported: each level is asked
    of the ``sys.meta_path`` finders with the parent spec's ``submodule_search_locations``
    (modules already in ``sys.modules`` give their own spec). No module code runs.
    """
    parts = name.split(".")
    path: list[str] | None = None
    spec: ModuleSpec | None = None
    for depth in range(1, len(parts) + 1):
        fullname = ".".join(parts[:depth])
        loaded = sys.modules.get(fullname)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else None
        if spec is None:
            spec = _ask_finders(fullname, path)
        if spec is None:
            return None
        if depth < len(parts):
            if spec.submodule_search_locations is None:
                return None  # 'a.b' where 'a' is a plain module
            path = list(spec.submodule_search_locations)
    return spec


def _ask_finders(fullname: str, path: list[str] | None) -> ModuleSpec | None:
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(fullname, path)
        except (ImportError, ValueError, OSError):
            continue
        if spec is not None:
            return spec
    return None


def top_level_location(module_name: str) -> tuple[list[str], list[str]]:
    """Files and folders the sandbox must show for ``module_name`` to import, and the ``sys.path``
    entries that find them: ``([package folder (of a namespace package, the one portion that holds the
    module) or the single module file], [their parents])``.
    Both empty when the top-level module has no location on disk (built-in, frozen, not found)."""
    spec = find_spec_statically(module_name.split(".")[0])
    if spec is None:
        return [], []
    if spec.submodule_search_locations:
        folders = [os.path.abspath(p) for p in spec.submodule_search_locations if os.path.isdir(p)]
        # A namespace package has a portion in several sys.path folders: only the one the module's import
        # resolves through is shown (a sibling portion may be another team's code).
        full = find_spec_statically(module_name) if "." in module_name else None
        origin = os.path.abspath(full.origin) if full is not None and full.origin else None
        if origin and len(folders) > 1:
            folders = [p for p in folders if origin.startswith(p.rstrip(os.sep) + os.sep)] or folders
        return folders, sorted({os.path.dirname(p) for p in folders})
    if spec.origin and os.path.isfile(spec.origin):
        origin = os.path.abspath(spec.origin)
        return [origin], [os.path.dirname(origin)]
    return [], []


# --- what a module binds, from its source ---------------------------------------------------------


class _Unknown:
    """A binding whose value the source does not show (an import, a call, an unpacking)."""


UNKNOWN = _Unknown()


@functools.lru_cache(maxsize=64)
def _bindings(origin: str, mtime_ns: int, size: int) -> tuple[dict[str, list[Any]], bool]:
    """Top-level bindings of a source file: name -> defining nodes, and whether the module may bind
    names the reading cannot see. Cached per file version (the DAG processor parses often)."""
    with open(origin, "rb") as handle:
        source = handle.read()
    tree = ast.parse(source, filename=origin)
    text = source.decode("utf-8", "replace")
    dynamic = any(marker in text for marker in _DYNAMIC_MARKERS)
    names: dict[str, list[Any]] = {}

    def bind(name: str, node: Any) -> None:
        names.setdefault(name, []).append(node)

    def targets(node: ast.AST) -> Iterator[str]:
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, (ast.Tuple, ast.List)):
            for item in node.elts:
                yield from targets(item)
        elif isinstance(node, ast.Starred):
            yield from targets(node.value)

    def walk(body: list[ast.stmt]) -> None:
        nonlocal dynamic
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(stmt.name, stmt)
                for inner in ast.walk(stmt):  # `global name` inside a function can bind it later
                    if isinstance(inner, ast.Global):
                        for name in inner.names:
                            bind(name, UNKNOWN)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    simple = isinstance(target, ast.Name)
                    for name in targets(target):
                        bind(name, stmt.value if simple else UNKNOWN)
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                if isinstance(stmt.target, ast.Name) and (not isinstance(stmt, ast.AnnAssign) or stmt.value):
                    bind(stmt.target.id, UNKNOWN)
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for alias in stmt.names:
                    if alias.name == "*":
                        dynamic = True
                    else:
                        bind(alias.asname or alias.name.split(".")[0], UNKNOWN)
            elif isinstance(stmt, (ast.For, ast.AsyncFor)):
                for name in targets(stmt.target):
                    bind(name, UNKNOWN)
                walk(stmt.body)
                walk(stmt.orelse)
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                for item in stmt.items:
                    if item.optional_vars is not None:
                        for name in targets(item.optional_vars):
                            bind(name, UNKNOWN)
                walk(stmt.body)
            elif isinstance(stmt, (ast.If, ast.While)):
                walk(stmt.body)
                walk(stmt.orelse)
            elif isinstance(stmt, (ast.Try, ast.TryStar)):
                walk(stmt.body)
                for handler in stmt.handlers:
                    if handler.name:
                        bind(handler.name, UNKNOWN)
                    walk(handler.body)
                walk(stmt.orelse)
                walk(stmt.finalbody)
            elif isinstance(stmt, ast.Match):
                dynamic = True  # capture patterns bind names; not worth following
            for node in ast.walk(stmt):
                if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
                    bind(node.target.id, UNKNOWN)
    walk(tree.body)
    if "__getattr__" in names:
        dynamic = True
    return names, dynamic


def _signature_of(args: ast.arguments) -> inspect.Signature:
    """The signature a ``def``/``lambda`` with these arguments has (defaults are placeholders)."""
    kind = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    params = []
    for index, arg in enumerate(positional):
        params.append(kind(arg.arg, kind.POSITIONAL_ONLY if index < len(args.posonlyargs)
                           else kind.POSITIONAL_OR_KEYWORD, default=None if index >= first_default else kind.empty))
    if args.vararg:
        params.append(kind(args.vararg.arg, kind.VAR_POSITIONAL))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(kind(arg.arg, kind.KEYWORD_ONLY, default=kind.empty if kw_default is None else None))
    if args.kwarg:
        params.append(kind(args.kwarg.arg, kind.VAR_KEYWORD))
    return inspect.Signature(params)


def check_statically(path: str) -> None:
    """Check ``path`` from the module's source, never importing it. See the module docstring.

    Raises:
        RewardFunctionError: the path is malformed, the module is not found, has a syntax error
            or certainly has no such attribute, or the attribute certainly is no function with
            verl's compute_score signature.
    """
    module_name, attr = split_path(path)
    spec = find_spec_statically(module_name)
    if spec is None:
        raise cannot_import(module_name, f"No module named {module_name!r}")
    origin = spec.origin
    if not spec.has_location or not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return  # compiled, built-in or generated: checked in the sandbox
    try:
        stat = os.stat(origin)
        names, dynamic = _bindings(origin, stat.st_mtime_ns, stat.st_size)
    except SyntaxError as err:
        raise import_raised(module_name, err) from None
    except (OSError, ValueError, RecursionError, MemoryError):
        return  # unreadable or unparsable here: the sandbox's import decides
    found = names.get(attr)
    if found is None:
        if dynamic or (spec.submodule_search_locations is not None
                       and find_spec_statically(f"{module_name}.{attr}") is not None):
            return  # bound by code the reading cannot follow, or a submodule (a module is no function anyway)
        raise no_attribute(module_name, attr)
    if len(found) != 1:
        return
    _check_definition(attr, found[0])


def _check_definition(attr: str, node: Any) -> None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if node.decorator_list:
            return  # a decorator may change the signature: checked in the sandbox
        signature = _signature_of(node.args)
    elif isinstance(node, ast.Lambda):
        signature = _signature_of(node.args)
    elif isinstance(node, ast.expr):
        try:
            value = ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return  # a call, a name, an expression: its value is known only by running it
        raise not_a_function(attr, type(value).__name__)
    else:
        return
    try:
        signature.bind(*REWARD_ARGS)
    except TypeError as err:
        raise wrong_signature(err) from None



__all__ = ["check_statically", "find_spec_statically", "top_level_location"]
