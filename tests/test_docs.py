"""The documentation house: the architecture stays one page, relative links in docs/ and the
README point at files that exist, and every package the architecture lists is a directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
ARCH = ROOT / "docs" / "ARCHITECTURE.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _relative_links(md: Path) -> list[str]:
    """Targets of the markdown links in `md` that are paths, without any #fragment."""
    return [t.split("#", 1)[0] for t in _links(md)]


def _links(md: Path) -> list[str]:
    """Markdown link targets in `md` that are not URLs (http:, mailto:) or same-page anchors."""
    return [t for t in LINK.findall(md.read_text()) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def _anchors(md: Path) -> set[str]:
    """GitHub's anchors for the headings of `md`: lower case, punctuation dropped, spaces as '-'."""
    heads = re.findall(r"^#+ (.+)$", md.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_architecture_is_one_page():
    n = len(ARCH.read_text().splitlines())
    assert n <= 210, f"docs/ARCHITECTURE.md has {n} lines; the limit is 210 (move depth to a topic document)"


@pytest.mark.parametrize("md", [*DOCS, ROOT / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files(md):
    missing = [t for t in _relative_links(md) if not (md.parent / t).exists()]
    assert not missing, f"{md.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("md", [*DOCS, ROOT / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_anchors_name_headings(md):
    bad = []
    for target in _links(md):
        path, _, frag = target.partition("#")
        dest = md.parent / path
        if frag and dest.suffix == ".md" and dest.exists() and frag not in _anchors(dest):
            bad.append(target)
    assert not bad, f"{md.relative_to(ROOT)} links to headings that do not exist: {bad}"


def test_link_checker_sees_links():
    # the checker itself: it finds the links it must check and skips URLs and anchors
    links = _relative_links(ARCH)
    assert "DESIGN.md" in links and "benchmarks.md" in links
    assert not any(t.startswith(("http", "#")) for t in links)
    assert "cpu-path" in _anchors(ROOT / "docs" / "benchmarks.md")


def test_packages_listed_in_the_architecture_exist():
    text = ARCH.read_text()
    section = text.split("## Packages", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"\*\*([a-z_]+)/\*\*", section)
    assert {"proto", "serving", "engine", "kernels", "transfer", "router", "client", "tests"} <= set(named)
    missing = [p for p in named if not (ROOT / p).is_dir()]
    assert not missing, f"docs/ARCHITECTURE.md lists packages that are not directories: {missing}"


def _benchmark_entries() -> list[str]:
    """The figure entries of docs/benchmarks.md: paragraphs that open with a bold title."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    return [" ".join(p.split()) for p in text.split("\n\n") if p.startswith("**") and "** — " in p]


def test_benchmark_entries_say_when_where_and_how():
    entries = _benchmark_entries()
    assert len(entries) >= 15
    bad = [
        e[:80]
        for e in entries
        if not re.match(r"\*\*.+?\*\* — \d{4}-\d{2}-\d{2}\b", e)  # the date
        or not re.search(r"\b[0-9a-f]{7,40}\b", e)  # the commit
        or not re.search(r"dev box|H100|H200", e)  # the machine
        or not ("`" in e or "not recorded" in e)  # the command, or that the text gave none
    ]
    assert not bad, f"docs/benchmarks.md entries without date, commit, machine or command: {bad}"


@pytest.mark.parametrize(
    "md", [p for p in DOCS if p.name != "benchmarks.md"] + [ROOT / "README.md"], ids=lambda p: p.name
)
def test_speed_figures_live_in_benchmarks(md):
    # a measured ratio ("1.7x") or throughput ("742 tokens/s") belongs in docs/benchmarks.md
    found = re.findall(r"\b\d+(?:\.\d+)?x\b|\d (?:tokens|tok)/s", md.read_text())
    assert not found, f"{md.relative_to(ROOT)} quotes figures {found}: move them to docs/benchmarks.md and link there"


PACKAGE_PATH = re.compile(
    r"`((?:engine|kernels|transfer|serving|router|client|proto|prefill_node|decode_node|encode_node|bench|tools|tests|deploy)"
    r"/[A-Za-z0-9_/-]*(?:\.[a-z]+)?)`"
)
BUILD_OUTPUTS = {"kernels/_ops/"}  # made by `python -m kernels.build`, not in the tree


@pytest.mark.parametrize("md", [*DOCS, ROOT / "README.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_quoted_paths_exist(md):
    # `engine/cache/prefix.py`, `deploy/k8s/`: a file or folder the text names as code must exist
    missing = [p for p in PACKAGE_PATH.findall(md.read_text()) if p not in BUILD_OUTPUTS and not (ROOT / p).exists()]
    assert not missing, f"{md.relative_to(ROOT)} names paths that do not exist: {missing}"
