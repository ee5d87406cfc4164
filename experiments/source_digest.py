"""The digest of a user component's code: the file that defines it and the user's modules it imports.

The study stores it with each result that ran a component of the user's own (``_target_``), so that after
an edit the same command runs those results again. Imports are followed as the source states them
(``import x``, ``from x import y``, relative ones too, and ``importlib.import_module("x")`` or
``__import__("x")`` with the name written out), so that a helper module next to the component counts;
the standard library, installed packages and fedrobust itself do not: they are not the user's code,
and reading torch's sources for every result would cost seconds.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import inspect
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

# The project's own packages: a change there reruns no result, as for the built-in components.
_PROJECT = ("fedrobust", "experiments")


def source_digest(target: str) -> str:
    """sha256 of the code behind ``target`` (a dotted path): the bytes of the file that defines it when it
    imports no module of the user's own, else of every such file, by path. Empty when there is no source
    to read (the result is then run again, and a target that does not import fails that run with its
    error)."""
    from fedrobust.components import import_target

    try:
        module = inspect.getmodule(import_target(target))
        files = own_source_files(module) if module is not None else []
    except (OSError, TypeError, ValueError, SyntaxError):
        return ""
    if not files:
        return ""
    if len(files) == 1:
        return hashlib.sha256(files[0].read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(f"{path}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def own_source_files(module: ModuleType) -> list[Path]:
    """The source file of ``module`` and of each module of the user's own it imports, followed through
    their imports in turn; in the order they were found."""
    found: dict[Path, None] = {}
    pending = [module.__name__]
    while pending:
        name = pending.pop()
        # The component's own file even where it is installed (a package of the user's in site-packages).
        path = _user_source(name) if found else _module_file(module)
        if path is None or path in found:
            continue
        found[path] = None
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        pending += _imported_names(ast.parse(path.read_bytes(), filename=str(path)), package)
    return list(found)


def _module_file(module: ModuleType) -> Path | None:
    source = inspect.getsourcefile(module)
    return Path(source).resolve() if source else None


def _imported_names(tree: ast.Module, package: str) -> list[str]:
    """Every module name an import statement of ``tree`` may load (``from p import q``: ``p`` and ``p.q``,
    which is a module or an attribute of ``p``), and every name ``import_module`` or ``__import__`` is
    called with as a string literal; with the packages above each."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := _literal_import(node, package)):
            names.append(name)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else (node.module or "")
            except (ImportError, ValueError):
                continue  # a relative import past the top: it would fail when the module runs
            names += [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    # Loading ``p.q`` runs ``p/__init__.py`` first.
    parents = [name.rsplit(".", k)[0] for name in names for k in range(name.count("."), 0, -1)]
    return [name for name in dict.fromkeys(parents + names) if name]


def _literal_import(call: ast.Call, package: str) -> str | None:
    """The module ``call`` loads when it is ``import_module("x")`` (any receiver, so ``importlib.`` too, and
    ``".x"`` relative to this module's package) or ``__import__("x")``; else None."""
    func = call.func
    callee = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    first = call.args[0] if call.args else None
    if callee not in ("import_module", "__import__") or not isinstance(first, ast.Constant):
        return None
    if not isinstance(first.value, str) or not first.value:
        return None
    if not first.value.startswith("."):
        return first.value
    try:  # import_module(".x", package=__package__): relative to the module's own package
        return importlib.util.resolve_name(first.value, package) if callee == "import_module" else None
    except (ImportError, ValueError):
        return None


def _user_source(name: str) -> Path | None:
    """The ``.py`` file module ``name`` loads from, when it is the user's own; else None."""
    top = name.partition(".")[0]
    # The top-level package first: finding ``torch.nn`` imports torch, finding ``torch`` does not.
    if top in _PROJECT or top in sys.builtin_module_names or (top != name and _user_file(top) is None):
        return None
    return _user_file(name)


def _user_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return None  # an attribute, not a module (``from p import function``), or a parent that fails
    origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return None
    path = Path(origin).resolve()
    return None if any(path.is_relative_to(root) for root in _installed_roots()) else path


@functools.cache
def _installed_roots() -> tuple[Path, ...]:
    """Where the standard library and installed packages live."""
    paths = sysconfig.get_paths()
    return tuple(Path(paths[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths)
