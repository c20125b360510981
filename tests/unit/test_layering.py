"""The tree's layering: imports run one way only (docs/architecture.md, "Packages").

Every import in our packages (module level or inside a function) is checked against the allowed
dependencies of its layer, so an upward import fails here rather than as a cycle at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("nvrx_common", "monitors", "slurm", "ckpt", "launcher", "nvrx_cli")

# layer -> the layers it may import (besides itself). launcher is split by role.
ALLOWED: dict[str, set[str]] = {
    "nvrx_common": set(),
    "monitors": {"nvrx_common"},
    "slurm": {"nvrx_common", "monitors"},
    "ckpt": {"nvrx_common"},
    "launcher.rank": {"nvrx_common", "monitors", "ckpt"},
    "launcher.resume": {"nvrx_common", "monitors", "slurm"},
    "launcher.agent": {"nvrx_common", "monitors", "slurm", "launcher.rank"},  # it starts ranks and monitors
    "nvrx_cli": {"nvrx_common", "monitors", "slurm", "ckpt", "launcher.agent", "launcher.rank", "launcher.resume"},
}


def layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if parts[0] == "launcher":
        return ".".join(parts[:2]) if len(parts) > 1 else "launcher"
    return parts[0]


def imports_of(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            # `from launcher import agent` imports the subpackage launcher.agent
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                    if (REPO / node.module.replace(".", "/") / a.name).is_dir()]
    return out


def violations() -> list[str]:
    bad = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            src = layer(module)
            for lineno, target in imports_of(path):
                dst = layer(target)
                if dst is None or dst == src or (dst == "launcher" and target == "launcher"):
                    continue
                if dst not in ALLOWED.get(src, set()):
                    bad.append(f"{path.relative_to(REPO)}:{lineno}: {src} imports {target} ({dst})")
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


def test_every_module_belongs_to_a_layer():
    stray = [str(p.relative_to(REPO)) for p in (REPO / "launcher").glob("*.py") if p.name != "__init__.py"]
    assert stray == [], "launcher/ holds only its role subpackages (agent, rank, resume)"


def test_checker_catches_an_upward_import(tmp_path, monkeypatch):
    # the check itself can fail: a monitors module importing the agent is reported
    fake = tmp_path / "monitors"
    fake.mkdir()
    (fake / "bad.py").write_text("from launcher.agent.config import LaunchConfig\n")
    for name in PACKAGES:
        if name != "monitors":
            (tmp_path / name).mkdir()
    (tmp_path / "launcher" / "agent").mkdir()
    import sys

    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert violations() == ["monitors/bad.py:1: monitors imports launcher.agent.config (launcher.agent)"]
