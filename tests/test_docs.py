"""The documentation: the site builds under mkdocs --strict (a broken link, anchor or nav entry
fails), the README's links lead somewhere, the named notes the pages cite exist in the code and
every note of the library is indexed, and the README's example runs. Costs a few seconds: one
mkdocs build and the example's 50 tiny steps on the 2-rank pool."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from harness import run_ranks

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"

# A note is defined where its title stands alone on a line (after `#`, `//` or a docstring's
# opening quotes); everywhere else `[Note: ...]` is a reference to it.
NOTE = re.compile(r"\[Note:\s+([^\]]+)\]")
NOTE_TITLE = re.compile(r'^\s*(?:#|//|""")?\s*\[Note: ([^\]]+)\]\s*$')
CODE_DIRS = ("zerofast", "csrc", "tests", "benchmarks", "scripts")
LIBRARY_DIRS = ("zerofast", "csrc")
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".cu", ".sh"}


def _sources(dirs):
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and path.is_file():
                yield path


def _defined_notes(dirs) -> dict[str, str]:
    """Note title -> the file (relative to the root) that defines it."""
    notes = {}
    for path in _sources(dirs):
        for line in path.read_text(encoding="utf-8").splitlines():
            m = NOTE_TITLE.match(line)
            if m:
                notes.setdefault(m.group(1), str(path.relative_to(ROOT)))
    return notes


def _cited_notes(text: str) -> list[str]:
    """The notes a text names; a name wrapped over lines (in a comment: after `#` or `//`) joined."""
    return [re.sub(r"\s*\n\s*(?:#|//)?\s*", " ", name).strip() for name in NOTE.findall(text)]


def _pages():
    return [README, *sorted(DOCS.glob("*.md"))]


def test_the_site_builds_strictly():
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    with tempfile.TemporaryDirectory(prefix="zerofast-site-") as site:
        out = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", site],
            cwd=ROOT,
            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        built = {p.name for p in Path(site).iterdir()}
    # Every page became a folder of the site (mkdocs' directory URLs), so nothing was left out.
    assert {p.stem for p in DOCS.glob("*.md") if p.stem != "index"} <= built, built


def _heading_anchors(page: Path) -> set[str]:
    """The anchors mkdocs gives the page's headings (markdown's toc slugify over the heading's text)."""
    from markdown.extensions.toc import slugify

    anchors, in_code = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            text = re.sub(r"[`*]", "", line.lstrip("#").strip())
            anchors.add(slugify(text, "-"))
    return anchors


def test_the_readme_links_lead_to_pages_and_headings_that_exist():
    pytest.importorskip("markdown")
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text(encoding="utf-8"))
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert local, "the README links into docs/"
    for link in local:
        target, _, anchor = link.partition("#")
        page = ROOT / target
        assert page.is_file(), f"README links to {link}: {target} does not exist"
        if anchor:
            assert anchor in _heading_anchors(page), f"README links to {link}: no such heading in {target}"


def _undefined(paths) -> list[str]:
    defined = _defined_notes(CODE_DIRS)
    return [
        f"{path.relative_to(ROOT)}: [Note: {name}]"
        for path in paths
        for name in _cited_notes(path.read_text(encoding="utf-8"))
        if name not in defined and name != "..."  # "[Note: ...]": the form itself, not a note
    ]


def test_every_note_the_docs_name_exists_in_the_code():
    missing = _undefined(_pages())
    assert not missing, "notes named in the docs that no file defines:\n" + "\n".join(missing)


def test_every_note_the_code_points_to_exists():
    this_file = Path(__file__).resolve()  # its patterns and messages spell the form, not a note
    missing = _undefined(p for p in _sources(CODE_DIRS) if p.resolve() != this_file)
    assert not missing, "notes pointed to in the code that no file defines:\n" + "\n".join(missing)


def test_every_note_of_the_library_is_indexed():
    index = (DOCS / "design.md").read_text(encoding="utf-8").split("## Named notes", 1)[1]
    listed = set(_cited_notes(index))
    missing = {name: where for name, where in _defined_notes(LIBRARY_DIRS).items() if name not in listed}
    assert not missing, f"notes missing from docs/design.md's index: {missing}"


def _readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "the README has a Python example"
    return blocks[0]


def _run_example(rank, world, code):
    """The README's example as torchrun would run it, on a pooled rank whose process group exists
    already: init_process_group is the only line that differs."""
    import torch.distributed as dist

    namespace = {"__name__": "__main__"}
    with mock.patch.object(dist, "init_process_group", lambda *args, **kwargs: None):
        exec(compile(code, "README.md", "exec"), namespace)
    return namespace["losses"]


def test_the_readme_example_runs_and_trains():
    for rank, losses in enumerate(run_ranks(_run_example, 2, args=(_readme_example(),))):
        assert len(losses) == 50 and losses[-1] < losses[0] / 2, (rank, losses[0], losses[-1])
