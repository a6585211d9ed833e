"""docs/src/python-reference.md is the package's own docstrings and signatures, read from its
sources (no import, so engines that are not installed are listed too): this test regenerates
it and compares. ``RESHARD_BLESS=1 python -m pytest python/tests/test_reference.py`` writes it
afresh."""

import ast
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "reshard"
REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "src" / "python-reference.md"

# The public modules, in the order the reference shows them: the core's types (from its
# stub), then each module of the package that users import.
MODULES = [
    ("reshard", "_core.pyi"),
    ("reshard.torch", "torch.py"),
    ("reshard.engine", "engine/__init__.py"),
    ("reshard.engine.trained", "engine/trained.py"),
    ("reshard.vllm_backend", "vllm_backend.py"),
    ("reshard.weight_transfer.info", "weight_transfer/info.py"),
    ("reshard.weight_transfer.worker", "weight_transfer/worker.py"),
    ("reshard.weight_transfer.served_model", "weight_transfer/served_model.py"),
    ("reshard.weight_transfer.trainer", "weight_transfer/trainer.py"),
    ("reshard.weight_transfer.colocated", "weight_transfer/colocated.py"),
    ("reshard.weight_transfer.routes", "weight_transfer/routes.py"),
    ("reshard.sglang_loader", "sglang_loader.py"),
    ("reshard.verl_backend", "verl_backend.py"),
    ("reshard.ray", "ray.py"),
]


def _signature(node) -> str:
    text = ast.unparse(node.args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"({text}){returns}"


def _doc(node) -> str:
    doc = ast.get_docstring(node)
    return doc.strip() if doc else "(undocumented)"


def _public(name: str, exported) -> bool:
    return not name.startswith("_") and (exported is None or name in exported)


def _exported(tree):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def _module(name: str, file: str) -> str:
    tree = ast.parse((PACKAGE / file).read_text())
    exported = _exported(tree)
    out = [f"## `{name}`", ""]
    doc = ast.get_docstring(tree)
    if doc:
        out += [doc.strip(), ""]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(node.name, exported):
            out += [f"### `{name}.{node.name}{_signature(node)}`", "", _doc(node), ""]
        elif isinstance(node, ast.ClassDef) and _public(node.name, exported):
            out += [f"### class `{name}.{node.name}`", "", _doc(node), ""]
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    not item.name.startswith("_") or item.name == "__init__"
                ):
                    if ast.get_docstring(item) or item.name == "__init__":
                        out += [f"- `{item.name}{_signature(item)}`"]
                        if ast.get_docstring(item):
                            out += ["", "  " + _doc(item).replace("\n", "\n  "), ""]
            out += [""]
    return "\n".join(out).rstrip() + "\n"


def reference() -> str:
    head = (
        "# Python reference\n\nGenerated from the package's docstrings and signatures by "
        "`python/tests/test_reference.py`; the guide is [Python and PyTorch](python.md).\n\n"
    )
    return head + "\n".join(_module(name, file) for name, file in MODULES)


def test_the_reference_is_the_docstrings():
    want = reference()
    if os.environ.get("RESHARD_BLESS"):
        REFERENCE.write_text(want)
        return
    have = REFERENCE.read_text() if REFERENCE.exists() else ""
    assert have == want, (
        "docs/src/python-reference.md is not the package's docstrings: run "
        "RESHARD_BLESS=1 python -m pytest python/tests/test_reference.py and commit it"
    )
