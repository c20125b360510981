"""The docs: the README stays short, the reference pages are what the code generates, every page is in the
site's nav, links from the README resolve, and the runnable examples are well formed (they are run by
tests/integration/test_docs_site.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from tests.docs_examples import REPO, BadBlock, Block, parse, runnable_pages


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_pages_are_current():
    gen = _gen_docs()
    assert gen.stale(REPO) == [], "run `python scripts/gen_docs.py` and commit docs/reference/"


def test_a_stale_reference_page_is_found(tmp_path):
    gen = _gen_docs()
    pages = gen.pages()
    for rel, text in pages.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert gen.stale(tmp_path) == []
    cli = tmp_path / "docs" / "reference" / "cli.md"
    cli.write_text(cli.read_text().replace("--max-restarts", "--max-retries"))
    (tmp_path / "docs" / "reference" / "events.md").unlink()
    assert sorted(map(str, gen.stale(tmp_path))) == ["docs/reference/cli.md", "docs/reference/events.md"]


def test_reference_pages_cover_the_code():
    """Spot checks that the generators walk everything: every command, every field, every event, every key."""
    from nvrx.events.records import RECORDS
    from nvrx.launcher.agent import rank_env
    from nvrx.monitors.ft_config import SCHEMA
    from nvrx.nvrx_cli.main import cli

    gen = _gen_docs()
    pages = {str(k): v for k, v in gen.pages().items()}
    cli_page = pages["docs/reference/cli.md"]
    for name, cmd in cli.commands.items():
        assert f"## `nvrx {name}`" in cli_page
        for param in cmd.params:
            for opt in getattr(param, "opts", []):
                assert f"`{opt}`" in cli_page or param.param_type_name == "argument", (name, opt)
    assert "| `16` |" in cli_page and "| `128+signum` |" in cli_page  # the exit codes
    assert all(f"| `{s.name}` |" in pages["docs/reference/config.md"] for s in SCHEMA)
    assert all(f"### `{ev}`\n" in pages["docs/reference/events.md"] for ev in RECORDS)
    env_page = pages["docs/reference/rank-environment.md"]
    for table in (rank_env.TORCHRUN_KEYS, rank_env.NVRX_KEYS, rank_env.RESUME_KEYS):
        assert all(f"| `{key}` |" in env_page for key in table)


def test_readme_is_short_and_keeps_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "the README is the front page; details go to docs/"
    for command in ("scripts/demo.sh", "scripts/test.sh"):  # CI runs the test command the README gives
        assert f"```bash\n{command}\n```" in readme, command


def _relative_links(text: str) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link.split("#")[0] for link in links if "://" not in link and not link.startswith("#")]


def test_readme_links_resolve():
    readme = (REPO / "README.md").read_text()
    links = _relative_links(readme)
    assert "docs/getting-started.md" in links and "bench/README.md" in links
    missing = [link for link in links if not (REPO / link).exists()]
    assert missing == []


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_every_docs_page_is_in_the_nav():
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md"))
    assert sorted(nav) == pages


def test_runnable_examples_are_well_formed():
    pages = runnable_pages()
    blocks = [b for bs in pages.values() for b in bs]
    # the getting-started tour runs: one node, then two emulated nodes with a hang caught
    tour = pages[Path("docs/getting-started.md")]
    assert [b.file for b in tour if b.file] == ["train.py"]
    assert any("--nnodes 2" in b.code and "--hang-at" in b.code for b in tour)
    assert all(b.lang in ("bash", "sh", "python") or b.file for b in blocks)


@pytest.mark.parametrize("text, problem", [
    ("<!-- runnable -->\nnot a fence\n", "followed directly"),
    ("<!-- runnable -->\n```text\nx\n```\n", "must be bash or python"),
    ("<!-- runnable mode=fast -->\n```bash\nx\n```\n", "unknown runnable attribute"),
    ("<!-- runnable -->\n```bash\nx\n", "never ends"),
])
def test_bad_runnable_markers_are_refused(text, problem):
    with pytest.raises(BadBlock, match=problem):
        parse(text, Path("page.md"))


def test_runnable_marker_attributes():
    text = '<!-- runnable file=t.py expect="hello world" -->\n```python\nprint(1)\n```\n'
    assert parse(text, Path("p.md")) == [Block(Path("p.md"), 1, "python", "print(1)\n", "t.py", "hello world")]


def test_benchmarks_page_includes_bench_readme():
    """The numbers live in bench/README.md, once; the site includes that file (pymdownx.snippets)."""
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert '--8<-- "bench/README.md"' in page
    bench = (REPO / "bench" / "README.md").read_text()
    assert "## Headline numbers" in bench and re.search(r"\| 20\d\d-\d\d-\d\d \| `python bench/", bench)
    assert "{#" not in bench  # plain markdown, as GitHub shows it: no attribute lists
