"""The docs name only what the checkout has: every relative markdown link in README.md and docs/**/*.md, and every
repository path they or the code's docstrings and comments cite (`docs/...`, `bench/...`, `tests/...`,
`runtime/...`, `tasks/...`, `flows/...`: a file ending in .md, .py, .toml or .sh, or a folder ending in /), exists.
Links resolve from the file's folder; cited paths from the repository root, as the docs write them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE = sorted(p for folder in ("memplan", "runtime", "tasks", "flows", "bench", "tests") for p in
              (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts)

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PATH = re.compile(r"(?<![\w./-])((?:docs|bench|tests|runtime|tasks|flows)/[\w./-]*?(?:\.(?:md|py|toml|sh)|/))"
                  r"(?![\w-])")
DOC_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]*?\.md)(?![\w-])")
"""A docs page named in prose, without backticks ("docs/config.md says ..."): how the docs cite each other."""
ROOT_DOC = re.compile(r"(?<![\w./-])([A-Z][A-Z0-9_-]*\.md)(?![\w-])")


def _prose(text: str) -> str:
    return FENCE.sub("", text)


def _missing(paths: set[str]) -> list[str]:
    return sorted(p for p in paths if not (ROOT / p).exists())


def test_the_docs_are_found():
    names = {str(p.relative_to(ROOT)) for p in DOCS}
    assert {"README.md", "docs/config.md", "docs/measurements/README.md"} <= names
    assert len(CODE) > 100


def test_every_relative_link_exists():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(_prose(doc.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue                                     # a URL (http:, mailto:) or an anchor on the page
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: ({target})")
    assert not broken, f"links to nothing: {broken}"


def test_every_backticked_repository_path_exists():
    missing = {}
    for doc in DOCS:
        spans = SPAN.findall(_prose(doc.read_text()))
        paths = {m for span in spans for m in PATH.findall(span)}
        if gone := _missing(paths):
            missing[str(doc.relative_to(ROOT))] = gone
    assert not missing, f"backticked paths that do not exist: {missing}"


def test_every_docs_page_the_docs_cite_exists():
    missing = {}
    for doc in DOCS:
        if gone := _missing(set(DOC_PATH.findall(_prose(doc.read_text())))):
            missing[str(doc.relative_to(ROOT))] = gone
    assert not missing, f"docs pages cited that do not exist: {missing}"


def test_every_path_the_code_cites_exists():
    """Docstrings and comments cite docs pages and tests by path: a moved file leaves them pointing at nothing."""
    missing = {}
    for source in CODE:
        if gone := _missing(set(PATH.findall(source.read_text(encoding="utf-8")))):
            missing[str(source.relative_to(ROOT))] = gone
    assert not missing, f"paths named in code that do not exist: {missing}"


def test_every_root_document_cited_exists():
    """A page cited by its bare upper-case name (README.md) is one at the repository root; the design, for one, is
    docs/architecture.md, not a root file of that name in capitals."""
    missing = {}
    for source in [*DOCS, *CODE]:
        if source != Path(__file__).resolve():
            if gone := sorted(n for n in set(ROOT_DOC.findall(source.read_text(encoding="utf-8")))
                              if not (ROOT / n).exists()):
                missing[str(source.relative_to(ROOT))] = gone
    assert not missing, f"root documents cited that do not exist: {missing}"
