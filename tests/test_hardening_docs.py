"""Issue 13 item 7: the docs are self-contained (nothing points outside the repository)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", REPO / "bench" / "traces" / "README.md",
        *sorted((REPO / "docs").glob("*.md"))]


def test_no_reference_outside_the_repository():
    files = DOCS + sorted((REPO / "bench").glob("*.py")) + sorted((REPO / "tests").glob("*.py"))
    for f in files:
        if f == Path(__file__).resolve():
            continue
        text = f.read_text()
        for bad in ("../shared", "/work/shared", "shared/DESIGN.md", "notes/benchmarks.md"):
            assert bad not in text, f"{f.relative_to(REPO)} refers to {bad}"


def test_relative_paths_in_docs_exist():
    """Backticked repository paths and relative markdown links in the docs name real files."""
    for f in DOCS:
        text = f.read_text()
        links = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", text)
        paths = re.findall(r"`((?:docs|bench|radixserve|tests|examples)/[\w./-]+\.(?:md|py|jsonl|txt))`", text)
        for p in links:
            assert (f.parent / p).exists(), f"{f.relative_to(REPO)} links {p}, which does not exist"
        for p in paths:
            assert (REPO / p).exists(), f"{f.relative_to(REPO)} names {p}, which does not exist"


def test_architecture_doc_license_and_vendored_trace():
    assert (REPO / "docs" / "ARCHITECTURE.md").stat().st_size > 2000
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]  # (an SPDX expression)
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    trace = REPO / "bench" / "traces" / "mooncake"
    assert (trace / "LICENSE-APACHE.txt").exists()
    lines = (trace / "conversation_trace.jsonl").read_text().splitlines()
    assert len(lines) == 12031 and '"hash_ids"' in lines[0]


def test_readme_says_how_to_get_the_cpu_torch():
    assert "--index-url https://download.pytorch.org/whl/cpu" in (REPO / "README.md").read_text()
