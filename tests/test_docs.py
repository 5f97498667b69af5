"""The documents the code cites live in the repository (docs/README.md).

Nothing outside docs/ may cite a project document kept outside the repository (the old spec, design, roofline
and Mosaic GPU notes, by their old names), and every `docs/<file>.md` and every § section cited anywhere must
exist. A bare `§N` refers to the docs/ file named earlier on the same line, else to docs/model.md (in a docs/
file: to that file itself); sections are the `§N` headings of a document. Text only, no jax: cheap on CPU.
"""

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DEFAULT_DOC = "model.md"
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", "build"}

# The old names, written in pieces so that this file does not match itself.
OUTSIDE = re.compile(
    "|".join(
        [
            "K3_" + "SPEC",
            r"\bDESI" + r"GN(?:\.md)?\b",
            r"\bROOF" + r"LINE\b",
            "PALLAS_" + "MGPU",
            "/work/" + "shared",
        ]
    )
)
HEADING = re.compile(r"^#{1,6}\s+§(\d+(?:\.\d+)*)\b", re.M)
# docs/<file>.md anywhere; inside docs/ also a bare <file>.md (a name not part of a longer path)
DOC_REF = re.compile(r"(?<![\w/.-])docs/([\w.-]+?\.md)\b")
BARE_DOC_REF = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
SECTION_REF = re.compile(r"§ ?(\d+(?:\.\d+)*)(?: ?[-–] ?§? ?(\d+(?:\.\d+)*))?")


def tree_files() -> list[pathlib.Path]:
    """Tracked and untracked-but-not-ignored files (git), or a walk that skips the usual build outputs."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        paths = [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        paths = []
        for d, dirs, files in os.walk(ROOT):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
            paths += [pathlib.Path(d) / f for f in files]
    return sorted(p for p in paths if p.is_file())


def text_of(path: pathlib.Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None  # binary (plots)
    return data.decode("utf-8", errors="replace")


def sections(doc: str) -> set[str]:
    path = DOCS / doc
    return set(HEADING.findall(path.read_text())) if path.is_file() else set()


def citation_problems(rel: str, text: str, docs: dict[str, set[str]]) -> list[str]:
    """Every cited docs/ file and § section in `text` that does not exist, as 'rel:line: problem'."""
    in_docs = rel.startswith("docs/")
    default = rel[len("docs/") :] if in_docs else DEFAULT_DOC
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        refs = [(m.start(), "doc", m.group(1)) for m in DOC_REF.finditer(line)]
        if in_docs:
            refs += [(m.start(), "doc", m.group(1)) for m in BARE_DOC_REF.finditer(line) if m.group(1) in docs]
        refs += [(m.start(), "sec", m.groups()) for m in SECTION_REF.finditer(line)]
        current = default
        for _, kind, what in sorted(refs, key=lambda r: r[0]):
            if kind == "doc":
                if what not in docs:
                    problems.append(f"{rel}:{n}: cites docs/{what}, which does not exist (have {sorted(docs)})")
                current = what
                continue
            for number in filter(None, what):
                if number not in docs.get(current, set()):
                    problems.append(f"{rel}:{n}: cites §{number} of docs/{current}, which has no such section")
    return problems


@pytest.fixture(scope="module")
def tree() -> dict[str, str]:
    texts = {}
    for path in tree_files():
        text = text_of(path)
        if text is not None:
            texts[path.relative_to(ROOT).as_posix()] = text
    return texts


@pytest.fixture(scope="module")
def docs() -> dict[str, set[str]]:
    return {p.name: sections(p.name) for p in sorted(DOCS.glob("*.md"))}


def test_docs_exist_with_numbered_sections(docs):
    for name in ("README.md", "model.md", "design.md", "roofline.md", "pallas_mgpu.md"):
        assert name in docs, f"docs/{name} is missing"
    for name in ("model.md", "design.md", "roofline.md", "pallas_mgpu.md"):
        assert docs[name], f"docs/{name} has no '§N' headings to cite"


def test_nothing_cites_documents_outside_the_repository(tree):
    hits = [
        f"{rel}:{n}: {m.group(0)!r}"
        for rel, text in tree.items()
        if not rel.startswith("docs/")
        for n, line in enumerate(text.splitlines(), 1)
        for m in OUTSIDE.finditer(line)
    ]
    assert not hits, "cite docs/ instead (docs/README.md maps the old names):\n" + "\n".join(hits)


def test_every_cited_doc_and_section_exists(tree, docs):
    problems = [p for rel, text in tree.items() for p in citation_problems(rel, text, docs)]
    assert not problems, "\n".join(problems)


def test_the_checker_catches_bad_citations(docs):
    """The two checks can fail: a missing file, a missing section, a bare § bound to the wrong document."""
    model, design = sorted(docs["model.md"]), sorted(docs["design.md"])
    missing = "999.9"
    assert citation_problems("x.py", f"see docs/model.md §{model[0]}", docs) == []
    assert citation_problems("x.py", f"(§{model[-1]})", docs) == []
    assert citation_problems("x.py", "see docs/" + "nowhere.md", docs)
    assert citation_problems("x.py", f"docs/model.md §{missing}", docs)
    assert citation_problems("x.py", f"docs/model.md §{model[0]}-{missing}", docs)
    only_design = next(s for s in design if s not in docs["model.md"])
    assert citation_problems("x.py", f"docs/design.md §{only_design}", docs) == []
    assert citation_problems("x.py", f"§{only_design}", docs)  # a bare § is docs/model.md's
    assert citation_problems("docs/design.md", f"§{only_design}", docs) == []
    assert OUTSIDE.search("K3_" + "SPEC §4.3") and OUTSIDE.search("ROOF" + "LINE.md")
    assert not OUTSIDE.search("ROOF" + "LINE_ACTIVE = 1")
