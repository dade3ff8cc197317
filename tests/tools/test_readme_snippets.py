"""Every ```python block of README.md and of every Markdown page under docs/ (the documentation
site's pages, docs/usage/ included) runs as written, each in a fresh Python
process (a fresh namespace, and no state such as ``import iabn.compat.enable`` shared between
blocks), from an empty temporary folder.

A block that cannot run on any machine the tests run on says so on the line before its fence,
with a marker this test reads and the reason, which the reader sees in the Markdown source:

    <!-- snippet: needs-cuda: REASON -->   run only where CUDA is available, skipped elsewhere
    <!-- snippet: needs-file: REASON -->   needs a file of the user's (a download): not run
    <!-- snippet: torchrun: REASON -->     run as the only process of a torchrun job (the
                                           environment torchrun gives a rank, one rank)

Any other ``<!-- snippet: ... -->`` line is an error, so a typo cannot turn a check off.
Shell blocks (```bash, plain ```) are not run.

The README's own links (to the site's pages, and headings in them) must lead somewhere too:
`mkdocs build --strict` checks the links between the pages, not those of the README, which is
not one of them.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
MARKER = re.compile(r"<!-- snippet: (?P<kind>[\w-]+)(?::\s*(?P<reason>.*?))?\s*-->")
KINDS = ("needs-cuda", "needs-file", "torchrun")
FENCE = re.compile(r"^```(?P<info>\S*)")


@dataclass(frozen=True)
class Snippet:
    document: Path
    line: int  # of the opening fence, 1-based
    code: str
    kind: str | None  # the marker's kind; None: runs everywhere
    reason: str
    section: str

    @property
    def id(self) -> str:
        return f"{self.document.relative_to(ROOT).as_posix()}:{self.line}"


def markdown_blocks(document: Path) -> tuple[list[Snippet], list[str]]:
    """The python blocks of ``document``, and the problems found with its markers."""
    lines = document.read_text(encoding="utf-8").splitlines()
    snippets, problems, section = [], [], ""
    # the block being read: (its fence's info string, line, marker kind, marker reason)
    block: tuple[str, int, str | None, str] | None = None
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if block is not None:
            if fence and not fence["info"]:
                info, start, kind, reason = block
                block = None
                if info == "python":
                    snippets.append(Snippet(document, start, "\n".join(lines[start:number - 1])
                                            + "\n", kind, reason, section))
            continue
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        if fence:
            info = fence["info"]
            marker = MARKER.fullmatch(lines[number - 2].strip()) if number > 1 else None
            block = (info, number, *((marker["kind"], marker["reason"] or "") if marker
                                     else (None, "")))
            if marker and info != "python":
                problems.append(f"{document.name}:{number - 1}: a snippet marker before a "
                                f"```{info} block (only python blocks run)")
            continue
        found = MARKER.fullmatch(line.strip())
        if found is None and "<!-- snippet" in line:
            problems.append(f"{document.name}:{number}: malformed snippet marker {line!r}")
        elif found and found["kind"] not in KINDS:
            problems.append(f"{document.name}:{number}: unknown snippet marker kind "
                            f"{found['kind']!r} (known: {', '.join(KINDS)})")
        elif found and not found["reason"]:
            problems.append(f"{document.name}:{number}: a snippet marker needs its reason")
        elif found and not (number < len(lines) and lines[number].startswith("```python")):
            problems.append(f"{document.name}:{number}: a snippet marker must be the line "
                            f"just before a ```python fence")
    if block is not None:
        problems.append(f"{document.name}:{block[1]}: a code block that is never closed")
    return snippets, problems


def all_snippets() -> list[Snippet]:
    return [s for document in DOCUMENTS for s in markdown_blocks(document)[0]]


def test_the_documents_have_checked_blocks_and_well_formed_markers():
    problems = [p for document in DOCUMENTS for p in markdown_blocks(document)[1]]
    assert not problems, problems
    snippets = all_snippets()
    # the examples of the README (the tour) and of the pages: usage, functional, debug mode,
    # convert, porting (3), timm, models, planning, distributed, offloading, memory; at most a
    # few may not run here
    assert len(snippets) >= 12, [s.id for s in snippets]
    assert sum(s.kind in ("needs-file", "needs-cuda") for s in snippets) <= 2


def test_the_extraction_reads_markers_fences_and_sections(tmp_path):
    """The parser itself, on a document made here: what runs, what is marked, what is a
    mistake (an unknown kind, a marker without reason or away from its fence)."""
    document = tmp_path / "doc.md"
    document.write_text(
        "# A\n```python\nx = 1\n```\n## B\n<!-- snippet: needs-cuda: a GPU kernel -->\n"
        "```python\nimport torch\n```\n```bash\nls\n```\n<!-- snippet: needs-file -->\n"
        "<!-- snippet: fast: no -->\n```python\ny = 2\n```\n<!-- snippet: needs-file: x -->\n"
        "\n```python\nz = 3\n```\n")
    snippets, problems = markdown_blocks(document)
    assert [(s.line, s.code, s.kind, s.reason, s.section) for s in snippets] == [
        (2, "x = 1\n", None, "", "A"), (7, "import torch\n", "needs-cuda", "a GPU kernel", "B"),
        (15, "y = 2\n", "fast", "no", "B"), (20, "z = 3\n", None, "", "B")]
    assert problems == ["doc.md:13: a snippet marker needs its reason",
                        "doc.md:14: unknown snippet marker kind 'fast' (known: needs-cuda, "
                        "needs-file, torchrun)",
                        "doc.md:18: a snippet marker must be the line just before a ```python "
                        "fence"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(snippet: Snippet) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("IABN_DEBUG_INPLACE", None)
    if snippet.kind == "torchrun":  # what torchrun sets for the only rank of a job
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return env


# The README's blocks run by default; the documentation pages' blocks (2-8 s each on a 2-core
# CPU, a fresh interpreter per block) are slow.
@pytest.mark.parametrize("snippet", [
    pytest.param(s, id=s.id, marks=() if s.document == DOCUMENTS[0] else pytest.mark.slow)
    for s in all_snippets()])
def test_snippet_runs(snippet, tmp_path):
    if snippet.kind == "needs-file":
        pytest.skip(f"{snippet.id} needs a file of the user's: {snippet.reason}")
    if snippet.kind == "needs-cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"{snippet.id} needs CUDA: {snippet.reason}")
    # a file named after the block, so that a traceback's line number leads to the document:
    # the block's line N is the document's line snippet.line + N
    script = tmp_path / f"{snippet.document.stem}_line{snippet.line}.py"
    script.write_text(snippet.code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env=_environment(snippet))
    assert result.returncode == 0, (
        f"{snippet.id} (section {snippet.section!r}; block line N is document line "
        f"{snippet.line} + N) failed:\n{result.stderr[-3000:]}")


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) and GitHub give a heading: lower case, code
    marks and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def broken_links(document: Path) -> list[str]:
    """The relative links of ``document`` whose file, or heading (``#anchor``), is missing."""
    problems, fence = [], False
    for number, line in enumerate(document.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        for found in LINK.finditer(line):
            target = found["target"]
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            page = (document.parent / path).resolve() if path else document
            if not page.is_file():
                problems.append(f"{document.name}:{number}: {target}: no such file")
            elif anchor and anchor not in {
                    _slug(heading.lstrip("#")) for heading in markdown_headings(page)}:
                problems.append(f"{document.name}:{number}: {target}: no such heading")
    return problems


def markdown_headings(document: Path) -> list[str]:
    headings, fence = [], False
    for line in document.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            headings.append(line)
    return headings


def test_the_readme_links_lead_to_pages_and_headings():
    assert _slug("## Accuracy after `iabn.convert(..., policy=\"leaky_relu\")` "
                 "(`benchmarks/convert_accuracy.py`)".lstrip("#")) == (
        "accuracy-after-iabnconvert-policyleaky_relu-benchmarksconvert_accuracypy")
    assert not broken_links(ROOT / "README.md")


def test_the_link_check_finds_missing_pages_and_headings(tmp_path):
    (tmp_path / "page.md").write_text("# Page\n\n## A `b` (c.py)\n```bash\n# not a heading\n```\n")
    document = tmp_path / "doc.md"
    document.write_text("[ok](page.md#a-b-cpy) [gone](nope.md) [wrong](page.md#not-a-heading)\n"
                        "[web](https://example.org/x.md) [here](#doc)\n# Doc\n")
    assert broken_links(document) == ["doc.md:1: nope.md: no such file",
                                       "doc.md:1: page.md#not-a-heading: no such heading"]
