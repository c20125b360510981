"""The tree's layering: imports run one way only (docs/architecture.md, "Packages").

Every import in our packages (module level or inside a function) is checked against the allowed
dependencies of its layer, so an upward import fails here rather than as a cycle at run time. The walk
reads the installed ``nvrx`` package (the wheel in CI).
"""

from __future__ import annotations

import ast
from pathlib import Path

import nvrx

ROOT = Path(nvrx.__file__).resolve().parents[1]  # the directory holding the `nvrx` package

# layer -> the layers it may import (besides itself). launcher is split by role; "nvrx" is the root package.
ALLOWED: dict[str, set[str]] = {
    "nvrx": set(),  # nvrx/__init__.py: the public names, imported lazily by name (no static import)
    "common": set(),
    "events": {"common"},
    "monitors": {"common", "events"},
    "inspection": {"common", "events", "monitors"},
    "slurm": {"common", "events", "monitors"},
    "ckpt": {"common"},
    "launcher.rank": {"common", "events", "monitors", "ckpt"},
    "launcher.resume": {"common", "events", "monitors", "slurm"},
    "launcher.agent": {"common", "events", "monitors", "slurm", "launcher.rank"},  # it starts ranks and monitors
    "nvrx_cli": {"common", "events", "monitors", "inspection", "slurm", "ckpt", "launcher.agent", "launcher.rank",
                 "launcher.resume"},
}


def layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "nvrx":
        return None
    if len(parts) == 1 or not (ROOT / "nvrx" / parts[1]).is_dir():
        return "nvrx"
    if parts[1] == "launcher":
        return ".".join(parts[1:3]) if len(parts) > 2 else "launcher"
    return parts[1]


def imports_of(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            # `from nvrx.launcher import agent` imports the subpackage nvrx.launcher.agent
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                    if (ROOT / node.module.replace(".", "/") / a.name).is_dir()]
    return out


def violations() -> list[str]:
    bad = []
    for path in sorted((ROOT / "nvrx").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        src = layer(module)
        for lineno, target in imports_of(path):
            dst = layer(target)
            if dst is None or dst == src or target in ("nvrx", "nvrx.launcher"):
                continue
            if dst not in ALLOWED.get(src, set()):
                bad.append(f"{path.relative_to(ROOT)}:{lineno}: {src} imports {target} ({dst})")
    return bad


def test_layer_table_is_acyclic():
    seen: dict[str, int] = {}

    def depth(name: str, stack: tuple[str, ...] = ()) -> int:
        assert name not in stack, f"cycle in ALLOWED: {' -> '.join(stack + (name,))}"
        if name not in seen:
            seen[name] = 1 + max((depth(d, stack + (name,)) for d in ALLOWED[name]), default=0)
        return seen[name]

    for name in ALLOWED:
        depth(name)


def test_no_import_runs_upward():
    assert violations() == []


def test_every_package_has_a_layer():
    packages = {p.name for p in (ROOT / "nvrx").iterdir() if (p / "__init__.py").exists()}
    known = {name.split(".")[0] for name in ALLOWED}
    assert packages - {"launcher"} <= known, f"give {sorted(packages - known)} a row in ALLOWED"


def test_every_module_belongs_to_a_layer():
    stray = [p.name for p in (ROOT / "nvrx" / "launcher").glob("*.py") if p.name != "__init__.py"]
    assert stray == [], "nvrx/launcher/ holds only its role subpackages (agent, rank, resume)"


def test_checker_catches_an_upward_import(tmp_path, monkeypatch):
    # the check itself can fail: a monitors module importing the agent is reported
    for sub in ("monitors", "launcher/agent"):
        (tmp_path / "nvrx" / sub).mkdir(parents=True)
    (tmp_path / "nvrx" / "monitors" / "bad.py").write_text("from nvrx.launcher.agent.config import LaunchConfig\n")
    import sys

    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations() == ["nvrx/monitors/bad.py:1: monitors imports nvrx.launcher.agent.config (launcher.agent)"]
