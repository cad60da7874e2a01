"""Generated blocks of the results pages: ``<!-- BEGIN NAME -->`` … ``<!-- END NAME -->``.

Issue 36: every table on a results page is rendered by its script from a committed CSV
and written between markers, so the hand-written discussion around it survives a rerun and
tests/experiments/test_doc_numbers.py can compare the page with a fresh rendering. One
implementation of reading and writing the markers, for every script.
"""

from __future__ import annotations

import re
from pathlib import Path

_BLOCK = re.compile(r"<!-- BEGIN (\S+) -->\n(.*?)\n<!-- END \1 -->", re.S)


def marked_blocks(text: str) -> dict[str, str]:
    """Every generated block of a page: name → the text between its markers."""
    return dict(_BLOCK.findall(text))


def update_marked_section(path: Path, name: str, text: str, append: bool = True) -> None:
    """Replace what lies between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` in
    ``path``; a block that is absent is appended at the end (``append``) or is an error
    (a page whose prose places each table must not get a stray one)."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    doc = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        doc = head + block + rest.split(end, 1)[1]
    elif append:
        doc = doc.rstrip("\n") + ("\n\n" if doc else "") + block + "\n"
    else:
        raise ValueError(f"{path} has no {begin} … {end} section")
    path.write_text(doc)
