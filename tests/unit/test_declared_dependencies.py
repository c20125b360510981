"""Every third-party package the tests or nvrx itself import is declared by the installed distribution.

A test that imports an undeclared package (hypothesis once) passes on a machine that happens to have it and
stops the suite at collection in a fresh venv with only the declared extras; this catches it anywhere.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import nvrx

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = Path(nvrx.__file__).resolve().parent
# imported only where present: the `lightning` extra, and Transformer Engine (GPU only) in AbortTransformerEngine
OPTIONAL = {"lightning", "pytorch_lightning", "transformer_engine"}


def _requirement_names(extra: str | None) -> set[str]:
    names = set()
    for req in importlib.metadata.requires("nvrx") or []:
        name, _, marker = req.partition(";")
        if extra is None and "extra" in marker:
            continue
        if extra is not None and f'extra == "{extra}"' not in marker.replace("'", '"'):
            continue
        names.add(re.split(r"[<>=!~ \[]", name.strip(), maxsplit=1)[0].lower().replace("_", "-"))
    return names


def _top_level_imports(files: list[Path]) -> set[str]:
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def _third_party(names: set[str], local: set[str]) -> set[str]:
    return {n for n in names if n not in sys.stdlib_module_names and n not in local and n != "__future__"}


def _distribution_of(module: str) -> str:
    dists = importlib.metadata.packages_distributions().get(module, [module])
    return dists[0].lower().replace("_", "-")


def test_the_tests_import_only_declared_packages() -> None:
    local = {"nvrx", "tests", "conftest", "bench"} | {p.stem for p in TESTS.rglob("*.py")}  # bench/: the checkout's
    used = _third_party(_top_level_imports(sorted(TESTS.rglob("*.py"))), local) - OPTIONAL
    declared = _requirement_names(None) | _requirement_names("test")
    missing = sorted(m for m in used if _distribution_of(m) not in declared)
    assert missing == [], f"add to the `test` extra in pyproject.toml: {missing}"


def test_nvrx_imports_only_its_declared_dependencies() -> None:
    used = _third_party(_top_level_imports(sorted(PACKAGE.rglob("*.py"))), {"nvrx"}) - OPTIONAL
    declared = _requirement_names(None)
    missing = sorted(m for m in used if _distribution_of(m) not in declared)
    assert missing == [], f"add to `dependencies` in pyproject.toml: {missing}"


def test_the_check_sees_an_undeclared_import(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("import hypothesis_not_declared\nimport json\nfrom torch import nn\n")
    assert _third_party(_top_level_imports([tmp_path / "t.py"]), set()) == {"hypothesis_not_declared", "torch"}
