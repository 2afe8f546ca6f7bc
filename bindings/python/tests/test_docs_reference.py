"""docs/*.md are reference: they describe the project as it is, not how it got there.

Two marks of a lab notebook are refused in the prose of every docs/*.md file:

- a commit-like token: 7 to 12 hex digits with at least one letter a-f and one digit
  (`5d1ca62`, `ebbe601`), or exactly 7 decimal digits (git's short hash may have no letter:
  `6509799`). Results are found by their dated folder and file name, never by a commit;
- a session word, which dates a sentence to the run it was written after ("this session",
  "one call earlier", "the latest runtime code", ...): see `SESSION_WORDS`.

Prose is the text outside fenced code blocks and inline code spans, so data stays free to write:
a hash-like value in a code span or block (`1245184`, a trace's ids), a number of other lengths
(2147483648) or with digit grouping (1,245,184). Pure Python, no GPU.
"""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
DOCS = sorted((REPO / "docs").glob("*.md"))

_FENCED = re.compile(r"^([ \t]*)(```|~~~).*?^[ \t]*\2[ \t]*$", re.S | re.M)
_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_HEX = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b")
_SEVEN_DIGITS = re.compile(r"(?<![\d.,])\b\d{7}\b(?![.,]\d)")
SESSION_WORDS = re.compile(
    r"\b(this session|that session|session's (last|final|end)|one call (earlier|later|before)"
    r"|no device time|at the latest (runtime )?code|latest call)\b",
    re.I,
)


def prose(text: str) -> str:
    """`text` with fenced code blocks and inline code spans blanked, line breaks kept (so line
    numbers still point into the file)."""

    def blank(match: re.Match[str]) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    return _SPAN.sub(blank, _FENCED.sub(blank, text))


def notebook_marks(text: str) -> list[tuple[int, str]]:
    """(line, token) for every commit-like token and session word in `text`'s prose."""
    found = []
    for lineno, line in enumerate(prose(text).splitlines(), start=1):
        for pattern in (_HEX, _SEVEN_DIGITS, SESSION_WORDS):
            found += [(lineno, m.group(0)) for m in pattern.finditer(line)]
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_prose_has_no_commits_or_session_words(doc: pathlib.Path) -> None:
    marks = notebook_marks(doc.read_text())
    assert not marks, f"{doc.relative_to(REPO)}: " + "; ".join(f"line {n}: {t!r}" for n, t in marks)


def test_docs_found() -> None:
    assert len(DOCS) >= 5, "docs/*.md not found: the test above would pass on nothing"


@pytest.mark.parametrize(
    "text",
    [
        "**At the runtime code** (6509799; each row pair one call)",
        "with the host tier's copies batched (5d1ca62, `array-emulated-batched.jsonl`)",
        "a record that placed each read where the engine started it (a2fdb0a, reverted)",
        "| 1 | 038578f | Qwen2 1.5B | 65% |",
        "regime-final.md at\nthe session's final code",
        "One call earlier, the reserve was 1.36 GiB",
        "that fix has not run yet (no device time was left)",
        "**Latest call** (both families)",
    ],
)
def test_the_rule_catches_notebook_prose(text: str) -> None:
    assert notebook_marks(text)


@pytest.mark.parametrize(
    "text",
    [
        "`mismatch in object 1, stripe unit 3 (device 0, offset 1245184)`",
        "```\n6509799 5d1ca62\nthis session\n```\n",
        '```json\n{"id": "ab12cd34ef"}\n```\n',
        "powers of 1024 (`2G` = `2GiB` = 2147483648), 1,245,184 bytes, 1234567.5 ms",
        "decade, defaced and effaced are words; 0x1f2e3d4 is a hex literal",
        "The runtime's session owns the hooks (`runtime/session.py`).",
    ],
)
def test_the_rule_leaves_data_and_code(text: str) -> None:
    assert notebook_marks(text) == []
