"""The README and the docs/ pages against the repository: the README stays a short entry page that
states the commands CI and a newcomer run, every test a page names as the keeper of a claim exists,
and every link between the pages lands on a file and a heading that exist."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_TEST_REF = re.compile(r"(tests/[\w/*.-]+\.py)?::(\w+)|(tests/[\w/*.-]+\.py)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _test_refs(text: str):
    """(file glob, test name or None) for each `tests/...py[::name]` and each bare `::name`, which
    continues the file named last before it (the way PROMISES.md lists several tests of one file)."""
    last = None
    for m in _TEST_REF.finditer(text):
        path, name, bare = m.groups()
        if bare:
            last = bare
            yield bare, None
        else:
            last = path or last
            yield last, name


def _defines(glob: str, name: str) -> bool:
    pattern = re.compile(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", re.M)
    return any(pattern.search(p.read_text()) for p in ROOT.glob(glob))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_the_readme_is_an_entry_page_with_the_commands_ci_and_a_newcomer_run():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300, "README.md over 300 lines: move a topic to its docs/ page"
    for command in ("bash scripts/test.sh", "bash scripts/demo.sh", "megatrain-nb demo"):
        assert command in text, command   # .ci/run runs scripts/test.sh: the README states it
    for api in ("mt.init(", "mt.Trainer(", "TrainingArguments(", "trainer.train()", "mt.Session("):
        assert api in text, api


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_test_a_page_names_exists(page):
    missing = []
    for glob, name in _test_refs(page.read_text()):
        if glob is None:
            missing.append(f"::{name} (no file named before it)")
        elif not list(ROOT.glob(glob)):
            missing.append(glob)
        elif name and not _defines(glob, name):
            missing.append(f"{glob}::{name}")
    assert not missing, f"{_rel(page)} names tests that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_link_lands_on_a_file_and_heading_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue   # a web address
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{_rel(page)} links to what does not exist: {broken}"

