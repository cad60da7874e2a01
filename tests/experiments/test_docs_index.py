"""The docs a user reads (issue 33 item 5): every link into docs/ lands on a file and a
heading that exist, docs/README.md sorts every doc, docs/benchmarks.md opens with its table
of current figures, and the papers are cited by authors and title, not by the repository's
file numbers ("paper 000"), which mean nothing outside it."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
WORD = ("Ll", "Lu", "Lo", "Nd")  # letters and decimal digits of any script


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, spaces to hyphens, punctuation and
    symbols dropped (letters and digits of any script kept, ``-`` and ``_`` too)."""
    out = []
    for ch in heading.strip().lower():
        if ch == " ":
            out.append("-")
        elif ch in "-_" or (ch.isalnum() if ch.isascii() else unicodedata.category(ch) in WORD):
            out.append(ch)
    return "".join(out)


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings (outside code blocks), repeats numbered."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def test_slug_is_github_s_anchor() -> None:
    assert slug("9. PD-OCG's LMO: the top singular pair vs PD-FTGL's projection (issue 24)") == (
        "9-pd-ocgs-lmo-the-top-singular-pair-vs-pd-ftgls-projection-issue-24")
    assert slug("Decentralized runs (Chen & Wang and Wang et al.)") == (
        "decentralized-runs-chen--wang-and-wang-et-al")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_lands_on_a_file_and_heading_that_exist(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.name}: {broken}"


def test_the_index_sorts_every_doc() -> None:
    index = (DOCS / "README.md").read_text()
    parts = re.split(r"^## ", index, flags=re.M)
    kinds = {p.split(":")[0]: set(re.findall(r"\]\(([\w.-]+\.md)\)", p)) for p in parts[1:]}
    assert set(kinds) == {"Reference", "Results", "History"}
    listed = set().union(*kinds.values())
    assert {p.name for p in DOCS.glob("*.md")} - {"README.md"} == listed
    assert all(name.startswith("results-") or name == "benchmarks.md"
               for name in kinds["Results"])
    assert kinds["History"] == {"changes.md", "benchmarks-history.md"}


def test_benchmarks_open_with_the_table_of_current_figures() -> None:
    text = (DOCS / "benchmarks.md").read_text()
    first_section = re.search(r"^## (.*)$", text, flags=re.M).group(1)
    assert first_section == "Current figures"
    table = text.split("<!-- current-figures:start -->")[1].split("<!-- current-figures:end -->")[0]
    rows = [r for r in table.strip().splitlines()[2:] if r.startswith("|")]
    for name in ("noise draws ns per normal", "Flower 1000×10⁵ ratio", "private CNN step ratio"):
        assert any(f"**{name}**" in r for r in rows), name
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6, row
        assert re.search(r"20\d\d-\d\d-\d\d", cells[2]), f"no date: {row}"
        assert "`" in cells[4] and "](" in cells[5], f"no command or section: {row}"


PAPER_NUMBER = re.compile(r"\b[Pp]apers? 00[0-4]\b|(?<![\w.,/:_-])(?<!\d )00[0-4]'s\b")


def test_papers_are_cited_by_authors_and_title() -> None:
    found = []
    for folder in ("flwr_corrnoise", "docs", "simulations", "experiments", "benchmarks",
                   "tests", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".md", ".toml") or path.name == Path(__file__).name:
                continue
            rel = path.relative_to(ROOT).as_posix()
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if PAPER_NUMBER.search(line):
                    found.append(f"{rel}:{no}: {line.strip()[:80]}")
    for line in (ROOT / "README.md").read_text().splitlines():
        if PAPER_NUMBER.search(line):
            found.append(f"README.md: {line.strip()[:80]}")
    assert not found, "\n".join(found)
