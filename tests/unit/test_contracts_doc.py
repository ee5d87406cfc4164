"""docs/contracts.md names the real signatures: every parameter a documented function takes appears in its
documented argument list, and every keyword the document shows is one the function takes."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "contracts.md"
# Names the document uses for instances, and the class they are instances of.
INSTANCES = {
    "store": "fedrobust.checkpoint.CheckpointStore",
    "tracker": "fedrobust.liveness.LivenessTracker",
    "optimizer": "fedrobust.server_optim.ServerOptimizer",
}
# A call, not a method's declaration (``def min_n(self)`` in a protocol block).
CALL = re.compile(r"(?<![\w.])(?<!def )([A-Za-z_][\w.]*)\(")


def _documented_calls() -> list[tuple[str, str, str]]:
    """(section module, dotted name, argument text) of each call written in a python block."""
    calls, section, in_code = [], "", False
    text = DOC.read_text()
    for match in re.finditer(r"^## (.+)$|^```(python)?$", text, flags=re.M):
        if match.group(1):
            section = match.group(1).split()[0]
        elif match.group(0).startswith("```"):
            in_code = not in_code
            if in_code:
                end = text.index("```", match.end())
                calls += [(section, name, args) for name, args in _calls_in(text[match.end() : end])]
    return calls


def _calls_in(block: str) -> list[tuple[str, str]]:
    block = "\n".join(line.split("#")[0] for line in block.splitlines())  # comments mention, they do not declare
    out = []
    for match in CALL.finditer(block):
        depth, i = 1, match.end()
        while depth and i < len(block):
            depth += {"(": 1, ")": -1}.get(block[i], 0)
            i += 1
        out.append((match.group(1), block[match.end() : i - 1]))
    return out


def _resolve(section: str, name: str) -> Any:
    head, _, rest = name.partition(".")
    candidates = [f"{INSTANCES[head]}.{rest}"] if head in INSTANCES and rest else []
    candidates += [f"{section}.{name}", f"fedrobust.{name}"]
    for dotted in candidates:
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return obj if callable(obj) else None
    return None


def test_every_documented_call_names_something_that_exists() -> None:
    unknown = [f"{section}: {name}" for section, name, _ in _documented_calls() if _resolve(section, name) is None]
    assert not unknown, f"docs/contracts.md names calls that do not exist: {unknown}"


def _checked() -> list[tuple[str, Any, str]]:
    out = []
    for section, name, args in _documented_calls():
        obj = _resolve(section, name)
        if obj is not None and not inspect.isbuiltin(obj):
            try:
                inspect.signature(obj)
            except (TypeError, ValueError):
                continue
            out.append((name, obj, args))
    return out


CHECKED = _checked()


def test_the_document_s_signatures_are_found() -> None:
    names = {name for name, _, _ in CHECKED}
    # Not vacuous: the calls of every section are resolved.
    assert {"CheckpointStore", "LivenessTracker", "data.load_partition", "training.train", "flatten"} <= names, names


def _pieces(args: str) -> list[str]:
    """``args`` split at its top-level commas."""
    pieces, depth, current = [], 0, ""
    for char in args:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            pieces.append(current.strip())
            current = ""
        else:
            current += char
    return [p for p in [*pieces, current.strip()] if p and p != "*"]


@pytest.mark.parametrize("name,obj,args", CHECKED, ids=[name for name, _, _ in CHECKED])
def test_every_parameter_is_documented_and_every_documented_keyword_exists(name: str, obj: Any, args: str) -> None:
    params = inspect.signature(obj).parameters
    named = [re.match(r"(\*{0,2})([A-Za-z_]\w*)\s*(?:[:=]|$)", piece) for piece in _pieces(args)]
    documented = {m.group(2) for m in named if m and not m.group(1)}
    # A call that elides (``...``), stands for more keywords (``**fields``) or shows example values is a
    # use, not a signature: only the keywords it does show are checked.
    whole_signature = all(named) and "..." not in args and not any(m.group(1) == "**" for m in named if m)
    if whole_signature:
        variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        real = {p for p, v in params.items() if p not in ("self", "cls") and p[0] != "_" and v.kind not in variadic}
        assert not real - documented, f"docs/contracts.md: {name}({args}) leaves out {sorted(real - documented)}"
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = documented - set(params)
        assert not unknown, f"docs/contracts.md: {name}({args}) shows {sorted(unknown)}, not parameters"
