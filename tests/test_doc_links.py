"""Every link of README.md and docs/*.md resolves: markdown links to files, and the measured-results paths the text
names in backticks (benchmarks/results/...: each claim's folder keeps what the docs cite)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc):
    text = doc.read_text()
    missing = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
               if not re.match(r"[a-z]+:", t) and not (doc.parent / t).exists()]
    missing += [t for t in re.findall(r"`(benchmarks/results/[^`\s]*)`", text) if not (ROOT / t).exists()]
    assert not missing, missing
