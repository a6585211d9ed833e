"""The package's modules import only public names from one another.

A module of ``reshard`` may use what another module of it exports: names without a leading
underscore. A name with one (``_agree``, ``_views``) is that module's own helper, free to
change with it; a module that needs it elsewhere makes it public (and says so in its name).
Modules themselves may be private (``reshard._core``, a package's ``_detail`` module): importing
one is fine, taking a private name out of it is not.

Checked on the source with :mod:`ast`: ``from X import _y`` and ``module._y`` where ``module``
names a module of the package (imported as ``from . import m``, ``import reshard.m as m``,
``from .m import n`` where ``n`` is a module, or ``from . import torch as rt`` inside a function).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "reshard"
PACKAGE = "reshard"


def _modules():
    """Every module of the package: dotted name -> path (packages by their __init__)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    for path in ROOT.rglob("*.so"):
        parts = list(path.relative_to(ROOT.parent).parts)
        parts[-1] = parts[-1].split(".")[0]
        out[".".join(parts)] = path
    for path in ROOT.rglob("*.pyi"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        out.setdefault(".".join(parts), path)
    return out


MODULES = _modules()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name of what ``node`` imports from."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def violations(module: str, path: pathlib.Path):
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    bound = {}  # local name -> module of the package it names
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node)
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:
                    bound[alias.asname or alias.name] = full
                elif _private(alias.name) and source != module:
                    found.append(f"{path.name}:{node.lineno}: from {source} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[PACKAGE] = PACKAGE
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        target = bound[value.id]
        for attr in reversed(chain):
            if f"{target}.{attr}" in MODULES:
                target = f"{target}.{attr}"
                continue
            if _private(attr) and target != module:
                found.append(f"{path.name}:{node.lineno}: {target}.{attr}")
            break
    return sorted(set(found))


@pytest.mark.parametrize("module", sorted(m for m, p in MODULES.items() if p.suffix == ".py"))
def test_no_private_names_across_modules(module):
    assert violations(module, MODULES[module]) == []


def test_the_check_sees_both_forms(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import reshard.transfer.checks as checks\n"
        "from . import torch as rt\n"
        "from .torch import _NATIVE, reshard_\n"
        "from .transfer import bucket\n"
        "def f(g):\n"
        "    from .transfer.checks import agree, _AGREED\n"
        "    return rt._group_rank(g), bucket.Message, checks._AGREED, rt.DEFAULT_BUCKET_BYTES\n"
    )
    assert violations("reshard.bad", bad) == [
        "bad.py:3: from reshard.torch import _NATIVE",
        "bad.py:6: from reshard.transfer.checks import _AGREED",
        "bad.py:7: reshard.torch._group_rank",
        "bad.py:7: reshard.transfer.checks._AGREED",
    ]
