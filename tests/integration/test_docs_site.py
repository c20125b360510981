"""The docs site builds with `mkdocs build --strict` (broken links and anchors, pages missing from the nav and
stale reference pages fail it), and every example marked runnable in the docs runs against the installed nvrx
(tests/docs_examples.py says how blocks are marked)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.docs_examples import EXAMPLE_ENDPOINT, REPO, Block, runnable_pages

BLOCK_TIMEOUT = 90  # seconds; the examples themselves take < 30 s on a quiet machine


def _need_mkdocs() -> None:
    if shutil.which("mkdocs") is None:
        try:
            import material  # noqa: F401
            import mkdocs  # noqa: F401
        except ImportError:
            pytest.skip("mkdocs / mkdocs-material are not installed: pip install 'nvrx[docs]' (the test extra has them)")
    else:
        pytest.importorskip("material", reason="mkdocs-material is not installed: pip install 'nvrx[docs]'")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300, env=env, check=False)


@pytest.mark.timeout(400)
def test_site_builds_strict(tmp_path):
    _need_mkdocs()
    res = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert res.returncode == 0, res.stderr
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--max-restarts" in cli and "--ft-param" in cli
    bench = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert "Headline numbers" in bench  # bench/README.md was included, not linked
    assert (tmp_path / "site" / "inspect_report.png").is_file()


def _copy_docs(dst: Path) -> Path:
    for rel in ("mkdocs.yml", "scripts/gen_docs.py", "bench/README.md"):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dst / rel)
    shutil.copytree(REPO / "docs", dst / "docs")
    return dst / "mkdocs.yml"


@pytest.mark.timeout(400)
def test_strict_build_fails_on_a_broken_link_or_a_stale_reference_page(tmp_path):
    _need_mkdocs()
    config = _copy_docs(tmp_path / "a")
    page = tmp_path / "a" / "docs" / "guides" / "hangs.md"
    page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
    res = _build(config, tmp_path / "site-a")
    assert res.returncode != 0 and "missing.md" in res.stderr, res.stderr

    config = _copy_docs(tmp_path / "b")
    ref = tmp_path / "b" / "docs" / "reference" / "config.md"
    ref.write_text(ref.read_text().replace("rank_heartbeat_timeout", "rank_heartbeat_timeout_old"))
    res = _build(config, tmp_path / "site-b")
    assert res.returncode != 0 and "out of date: docs/reference/config.md" in res.stderr, res.stderr


def _run_block(block: Block, cwd: Path, env: dict[str, str], port: int) -> str:
    code = block.code.replace(EXAMPLE_ENDPOINT, f"127.0.0.1:{port}")
    if block.file:
        (cwd / block.file).write_text(code)
        return ""
    cmd = [sys.executable, "-c", code] if block.lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{block.where}: still running after {BLOCK_TIMEOUT} s:\n{code}\n{out}") from None
    assert proc.returncode == 0, f"{block.where}: exit {proc.returncode}:\n{code}\n--- output:\n{out}"
    if block.expect:
        assert block.expect in out, f"{block.where}: {block.expect!r} not in the output:\n{out}"
    return out


PAGES = runnable_pages()


@pytest.mark.slow
@pytest.mark.e2e  # whole jobs: the docs' examples run nvrx launch
@pytest.mark.timeout(400)
@pytest.mark.parametrize("page", sorted(PAGES), ids=str)
def test_runnable_examples(page, launcher, tmp_path):
    """Each page's runnable blocks, in order, in one fresh directory, with `nvrx` the installed command."""
    env = launcher.env()
    bindir = str(Path(sys.executable).parent)  # a venv's nvrx (CI: the wheel's) before anything else on PATH
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    assert shutil.which("nvrx", path=env["PATH"]), "the nvrx command is not installed"
    work = tmp_path / "work"
    work.mkdir()
    port = free_port()
    for block in PAGES[page]:
        _run_block(block, work, env, port)
    assert launcher.leftovers() == [], "an example left processes behind"
