"""The operator's documents name everything an operator can set or see (a new change or setting cannot be left out)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fdsched.core.metrics
from fdsched.core.settings import CHANGE_IDS, SCHEMA

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULTS = sorted((ROOT / "docs" / "results").glob("*.md"))  # measured results, one page per topic


@pytest.fixture(scope="module")
def readme():
    """The operator's documents: README.md and the docs/ pages it links (the reference moved there)."""
    if not README.is_file():
        pytest.skip("README.md is not in this installation (an sdist/wheel without it)")
    return "\n".join(p.read_text(encoding="utf-8") for p in [README, *DOCS])


def test_the_readme_links_every_docs_page():
    if not README.is_file():
        pytest.skip("README.md is not in this installation (an sdist/wheel without it)")
    text = README.read_text(encoding="utf-8")
    assert DOCS and RESULTS
    for page in DOCS:
        assert f"](docs/{page.name})" in text, page.name
    for page in RESULTS:
        assert f"](docs/results/{page.name})" in text, f"results/{page.name}"


def test_the_readme_says_what_the_project_is_before_any_command():
    if not README.is_file():
        pytest.skip("README.md is not in this installation (an sdist/wheel without it)")
    text = README.read_text(encoding="utf-8")
    first_paragraph = text.split("\n\n")[1]
    assert "plugin for [FastDeploy]" in first_paragraph and "```" not in first_paragraph
    assert text.index("plugin for [FastDeploy]") < text.index("```")
    # the quick start's replay shows the point: a shipped real trace, baseline / recommended / adaptive
    assert "fdsched replay --trace azure-conv --profile baseline recommended adaptive" in text
    # the test command says where its measured times are, and that page has the place CI's figures go
    assert re.search(r"python -m pytest -q -ra -n 2 --dist loadscope tests\s+# the tests: three tiers, times in docs/testing.md", text)
    assert "<!-- ci-times -->" in (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")


def test_the_readme_first_screen_says_what_to_enable():
    """What an operator acts on comes before any reference: the supported lines (between the markers CI fills), the
    three lines that enable the plugin, and which profile to run."""
    text = README.read_text(encoding="utf-8") if README.is_file() else pytest.skip("no README.md here")
    start, end = text.index("<!-- support-table:start -->"), text.index("<!-- support-table:end -->")
    table = text[start:end]
    assert "| FastDeploy line | commit | CI |" in table  # made by `fdsched host support` (CI checks the rows)
    for commit in ("e7c8dc2", "d38eeb8"):
        assert re.search(rf"`{commit}` \| unit, host, engine tiers \|", table)
    enable = text.index("export FD_PLUGINS=fdsched")
    assert enable < text.index("## Which profile to run") < text.index("## Reference")
    # the fork the README names is the one `fdsched host setup` downloads from, and "tested" means a known host
    from fdsched.install.hosts import KNOWN_HOSTS
    from fdsched.tools.hostsetup import PUBLIC_ARCHIVE

    fork = re.search(r"github\.com/([\w.-]+/[\w.-]+)/archive", PUBLIC_ARCHIVE).group(1)
    assert f"`{fork}`" in text[:text.index("## Reference")]
    listed = set(re.findall(r"\| `([0-9a-f]{7})` \|", table))
    assert listed and listed <= {commit[:7] for commit in KNOWN_HOSTS}


LINKED_PAGES = [README, ROOT / "CONTRIBUTING.md", *DOCS, *RESULTS, *sorted((ROOT / "examples").glob("*.md"))]


def test_every_relative_link_in_the_docs_resolves():
    for page in LINKED_PAGES:
        if not page.is_file():
            continue
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+://", target):
                continue
            assert (page.parent / target).exists(), f"{page.name}: link {target} does not resolve"


def heading_anchors(text: str) -> set:
    """The anchors GitHub gives a Markdown page's headings: lower case, punctuation but '-' and '_' dropped, spaces
    to '-', a repeated heading numbered (-1, -2, ...); fenced code is not a heading."""
    anchors, seen, fence = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        match = None if fence else re.match(r"^#{1,6} (.+?)\s*#*$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_heading_anchors_are_githubs():
    text = "# A page\n## `schedule()` CPU per step\n```\n# not a heading\n```\n## Notes\n## Notes\n"
    assert heading_anchors(text) == {"a-page", "schedule-cpu-per-step", "notes", "notes-1"}


def test_every_anchor_a_link_names_is_a_heading_of_its_page():
    """A section moved to another page (a results page, say) takes its anchor with it: every link that names one
    must follow."""
    checked = 0
    for page in LINKED_PAGES:
        if not page.is_file():
            continue
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+://", target):
                continue
            linked = (page.parent / target) if target else page
            assert linked.is_file(), f"{page.name}: link {target}#{anchor}: no such page"
            assert anchor in heading_anchors(linked.read_text(encoding="utf-8")), (
                f"{page.relative_to(ROOT)}: link {target}#{anchor}: {target or page.name} has no such heading")
            checked += 1
    assert checked > 10


@pytest.mark.parametrize("env", sorted(s.env for s in SCHEMA if s.env))
def test_every_variable_is_in_the_readme(readme, env):
    assert f"`{env}`" in readme


@pytest.mark.parametrize("change_id", CHANGE_IDS)
def test_every_change_is_in_the_readme_table(readme, change_id):
    assert re.search(rf"^\| `{change_id}` \|", readme, re.M), change_id


def declared_metrics() -> set:
    """Every metric name fdsched.core.metrics declares, read from its source: the literal names and the adaptive
    gauges it names through ``gauge("<name>", ...)`` (``fastdeploy:fdsched_adaptive_<name>``)."""
    import inspect

    source = inspect.getsource(fdsched.core.metrics)
    names = set(re.findall(r"[\"'](fastdeploy:fdsched_\w+)[\"']", source))
    names |= {f"fastdeploy:fdsched_adaptive_{n}" for n in re.findall(r"\bgauge\(\s*[\"'](\w+)[\"']", source)}
    return names


def test_the_metric_names_are_read_from_the_code():
    names = declared_metrics()
    assert {"fastdeploy:fdsched_preemptions_total", "fastdeploy:fdsched_gc_hold_seconds",
            "fastdeploy:fdsched_adaptive_margin_k", "fastdeploy:fdsched_adaptive_mean_output"} <= names
    assert len(names) >= 20


def test_every_metric_is_in_the_readme(readme):
    for name in sorted(declared_metrics()):
        assert f"`{name}" in readme, name


def test_the_metrics_page_names_only_declared_metrics():
    page = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `(fastdeploy:fdsched_\w+)", page, re.M))
    assert listed == declared_metrics()


def test_setup_cfg_classifiers_match_the_readme_python_versions():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(re.findall(r"Python :: (3\.\d+)", cfg["metadata"]["classifiers"]))
    text = README.read_text(encoding="utf-8")
    low, high = re.search(r"Python (3\.\d+)-(3\.\d+)", text).groups()
    wanted = {f"3.{m}" for m in range(int(low.split(".")[1]), int(high.split(".")[1]) + 1)}
    assert listed == wanted
    assert cfg["options"]["python_requires"].strip() == f">={low}"


def test_the_readme_gives_the_offline_form_of_the_host_step_beside_the_quick_start():
    """Offline, the quick start's first line works once the archive sits in the checkout, and the README says so
    (and shows --archive) before anything else, so nobody retypes the chain after a failed download."""
    text = README.read_text(encoding="utf-8") if README.is_file() else pytest.skip("no README.md here")
    first = text[:text.index("## What it does")]
    assert first.count("```bash") == 1  # the two commands, then prose
    assert "fdsched host setup --archive" in first and "FastDeploy-<commit>.tar.gz" in first
    assert re.search(r"Offline, the same first line works", first)


def test_doctor_help_documents_its_exit_status(capsys):
    from fdsched.tools.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["doctor", "--help"])
    help_text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "Exit status: 0 all fine; 1 a settings or install error, or a pre-flight finding to fix" in help_text
    assert "2 no FastDeploy host found" in help_text
