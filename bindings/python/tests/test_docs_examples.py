"""Every ```python block of README.md, docs/python.md and docs/runtime.md runs as written.

Each block runs alone, in a fresh interpreter, with a scratch directory on a real file system
(the `store_dir` fixture: TERAIO_TEST_DIR) as its working directory, so relative store paths land
there. Paths the docs write as `/mnt/...` placeholders are moved under that directory. A block
passes when it exits 0 having run to its last line (a marker printed after it).

Blocks that use CUDA (the word `cuda` in the code) run only where CUDA is available: elsewhere
they are skipped, and the skip says so; the GPU machine runs them (benches/torch/run-gpu.sh
tests). Blocks importing a package this interpreter lacks (e.g. transformers) are skipped naming
it; teraio itself must import.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
DOCS = ("README.md", "docs/python.md", "docs/runtime.md")
DONE = "__teraio_docs_block_ran_to_the_end__"
TIMEOUT_S = 600
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)
_MNT = re.compile(r"""(["'])/mnt/([^"']+)\1""")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    code: str

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def python_blocks(doc: str) -> list[Block]:
    text = (REPO / doc).read_text()
    return [Block(doc, text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _FENCE.finditer(text)]


BLOCKS = [block for doc in DOCS for block in python_blocks(doc)]


def needs_cuda(code: str) -> bool:
    return re.search(r"\bcuda\b", code) is not None


def missing_imports(code: str) -> list[str]:
    """Top-level packages the block imports that this interpreter cannot find (teraio excepted:
    it must be installed for these tests)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if n != "teraio" and importlib.util.find_spec(n) is None)


def placeholders_moved(code: str, root: pathlib.Path) -> str:
    """`/mnt/nvme0/t.dev` -> `<root>/mnt/nvme0/t.dev`, its directory made."""

    def move(match: re.Match[str]) -> str:
        path = root / "mnt" / match.group(2)
        path.parent.mkdir(parents=True, exist_ok=True)
        return repr(str(path))

    return _MNT.sub(move, code)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_the_docs_have_python_examples() -> None:
    # Without this, a broken fence pattern would leave the test below with nothing to run.
    for doc in DOCS:
        assert python_blocks(doc), f"{doc} has no ```python block"


def test_placeholder_paths_are_moved(tmp_path: pathlib.Path) -> None:
    code = 'Store.create(["/mnt/nvme0/t.dev", \'/mnt/a/b\'], x="/mnt")'
    moved = placeholders_moved(code, tmp_path)
    assert '"/mnt/nvme0/t.dev"' not in moved and "'/mnt/a/b'" not in moved
    assert repr(str(tmp_path / "mnt" / "nvme0" / "t.dev")) in moved
    assert (tmp_path / "mnt" / "a").is_dir()
    assert 'x="/mnt"' in moved  # only paths below /mnt/


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_example_runs(block: Block, store_dir: pathlib.Path) -> None:
    if needs_cuda(block.code) and not cuda_available():
        pytest.skip(f"{block.name} uses CUDA and this machine has none: it runs on the GPU machine")
    missing = missing_imports(block.code)
    if missing:
        pytest.skip(f"{block.name} imports {', '.join(missing)}, not installed here")
    code = placeholders_moved(block.code, store_dir) + f"\nprint({DONE!r})\n"
    script = store_dir / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=store_dir,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = (done.stdout + done.stderr)[-4000:]
    if done.returncode != 0:
        pytest.fail(f"{block.name} failed (exit {done.returncode}):\n{output}", pytrace=False)
    if DONE not in done.stdout:
        pytest.fail(f"{block.name} did not run to its end:\n{output}", pytrace=False)
