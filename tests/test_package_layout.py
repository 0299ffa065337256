"""The package's layout rules, read from the source: the KV cache library depends on nothing of
the plugin's engine side, eval and tests reach it only through its public names, and every vLLM
internal the package touches is imported in `vllm_mimo/compat.py`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
KV_CACHE = ROOT / "vllm_mimo" / "kv_cache"
LIBRARY = [*KV_CACHE.rglob("*.py"), *(ROOT / "vllm_mimo" / "engine").glob("kv_*.py")]
"""The KV cache library and its vLLM-facing manager and events: what eval and tests reach only by
public names."""


def _imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def test_the_kv_cache_library_imports_nothing_outside_itself():
    """No vLLM (not even through compat) and no plugin config: plain parameters."""
    for path in sorted(KV_CACHE.rglob("*.py")):
        outside = {
            m for m in _imports(path)
            if (m == "vllm" or m.startswith(("vllm.", "vllm_mimo"))) and not m.startswith("vllm_mimo.kv_cache")
        }
        assert not outside, f"{path.relative_to(ROOT)} imports {sorted(outside)}"


def _private_names() -> set[str]:
    """Private attributes and methods the KV cache library's classes define."""
    names = set()
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.Attribute)):
                name = node.name if isinstance(node, ast.FunctionDef) else node.attr
                if name.startswith("_") and not name.startswith("__"):
                    names.add(name)
    return names


def _library_classes() -> set[str]:
    return {
        node.name
        for path in LIBRARY
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }


SUBCLASSABLE = {"CacheObserver", "AnchorPolicy", "AnchorPlacement", "HostTier"}
"""What eval and tests may subclass: the observer interface and the policies (eval's variants of
the anchor policy and of the host tier)."""


def test_eval_and_tests_use_only_the_public_names_of_the_kv_cache():
    private, classes = _private_names(), _library_classes() - SUBCLASSABLE
    offences = []
    for path in sorted([*ROOT.glob("eval/*.py"), *ROOT.glob("tests/*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr in private:
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    offences.append(f"{where}: .{node.attr}")
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & classes:
                    offences.append(f"{where}: class {node.name} subclasses {sorted(bases & classes)}")
    assert not offences, "eval/ and tests/ must use the KV cache's contract and observers:\n" + "\n".join(offences)


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def test_only_compat_imports_vllm():
    """A vLLM move is then fixed in one file. All of `vllm_mimo/` is product code, `testing/`
    included (it ships in the wheel), so all of it goes through compat."""
    compat = ROOT / "vllm_mimo" / "compat.py"
    offences = []
    for path in sorted((ROOT / "vllm_mimo").rglob("*.py")):
        if path == compat:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_vllm(node.module):
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                offences += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}" for alias in node.names if _is_vllm(alias.name)
                ]
    assert not offences, "import vLLM internals through vllm_mimo.compat:\n" + "\n".join(offences)
