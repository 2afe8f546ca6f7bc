"""Every example of README.md and docs/*.md that a user is meant to run runs as written.

A fenced block's info string says what it is and where it runs:

| info string   | what                                            | where it runs                        |
|---------------|-------------------------------------------------|--------------------------------------|
| `python`      | a program                                       | here, on CPU PyTorch (CI)            |
| `python cuda` | a program that needs a CUDA GPU                 | the GPU machine's test mode          |
| `sh`          | shell commands, from the repository root        | here (CI)                            |
| `sh cuda`     | shell commands that need a CUDA GPU             | the GPU machine's test mode          |
| `sh ci`       | the command CI itself runs (tests/run-all.sh)   | CI, as its own command (.ci/run)     |
| `sh bench`    | a benchmark run: minutes to hours, on the       | not here: by hand, on that machine;  |
|               | machine its section names                       | its figures are in docs/benchmarks.md|
| `rust`        | a fragment of a Rust program                    | not run                              |
| `text`, `json`, none | output, a synopsis, a layout, a file      | not run                              |

The GPU test mode is this file with CUDA available and TERAIO_EXAMPLES=gpu
(`benches/torch/run-gpu.sh examples`, or `tests` for the whole suite): the programs (`python`,
`python cuda`) and the `sh cuda` blocks run there; the CPU shell blocks, which need cargo, are
left to CI and skipped, saying so.

Each program runs alone, in a fresh interpreter, in a scratch directory on a real file system
(the `store_dir` fixture: TERAIO_TEST_DIR) as its working directory, so relative store paths
land there. Paths the docs write as `/mnt/...` placeholders are moved under that directory. A
program passes when it exits 0 having run to its last line (a marker printed after it).

Shell blocks run with `bash -euo pipefail` in a scratch directory that links every top-level
entry of the repository (so `./bindings/python` and `benches/...` resolve as from the root, and
what the commands write stays out of the checkout), with the release `teraio` (built as
docs/cli.md says) and this interpreter's environment first on PATH, the repository's
CARGO_TARGET_DIR so that builds are shared, and TMPDIR in the scratch directory (a disk file
system, as the bench needs).

`python3 bindings/python/tests/test_docs_examples.py` prints the list of every block and where
it runs.
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
from typing import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
DONE = "__teraio_docs_block_ran_to_the_end__"
TIMEOUT_S = 900
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
_MNT = re.compile(r"""(["'])/mnt/([^"']+)\1""")

#: info string -> where the block runs (the table above).
WHERE = {
    "python": "CI (CPU)",
    "python cuda": "GPU test mode",
    "sh": "CI (shell)",
    "sh cuda": "GPU test mode (shell)",
    "sh ci": "CI's own command",
    "sh bench": "not run: a benchmark, by hand on its machine",
    "rust": "not run: a fragment",
    "text": "not run: output or synopsis",
    "json": "not run: a file",
    "": "not run: output or synopsis",
}
RUN_HERE = {"python", "sh"}
RUN_ON_CUDA = {"python cuda", "sh cuda"}


def documents() -> list[str]:
    return ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    info: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def language(self) -> str:
        return self.info.split(" ")[0] if self.info else ""


def blocks(doc: str) -> list[Block]:
    text = (REPO / doc).read_text()
    return [
        Block(doc, text.count("\n", 0, m.start()) + 2, " ".join(m.group(1).split()), m.group(2))
        for m in _FENCE.finditer(text)
    ]


ALL = [block for doc in documents() for block in blocks(doc)]
RUNNABLE = [b for b in ALL if b.info in RUN_HERE | RUN_ON_CUDA]


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


def target_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")).resolve()


@pytest.fixture(scope="session")
def release_teraio() -> pathlib.Path:
    """The release `teraio` binary, built as docs/cli.md says; its directory."""
    subprocess.run(
        ["cargo", "build", "--release", "-p", "teraio-cli"], cwd=REPO, check=True, timeout=TIMEOUT_S
    )
    binary = target_dir() / "release" / "teraio"
    assert binary.is_file(), binary
    return binary.parent


@pytest.fixture
def checkout_view(store_dir: pathlib.Path) -> Iterator[pathlib.Path]:
    """A directory whose entries link to the repository's top-level entries (but `target/`):
    commands read the repository as from its root and write beside it, not into it."""
    view = store_dir / "repo"
    view.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in {"target", ".git"}:
            (view / entry.name).symlink_to(entry)
    yield view


def test_every_block_says_what_it_is() -> None:
    # Without a known info string a runnable command could be left out of these tests unseen.
    unknown = [f"{b.name}: {b.info!r}" for b in ALL if b.info not in WHERE]
    assert not unknown, "blocks with an unknown info string (see this module's table): " + ", ".join(unknown)
    # And the pattern finds blocks at all (a broken pattern would leave nothing to run).
    assert any(b.info == "python" for b in ALL) and any(b.info == "sh" for b in ALL)


def test_placeholder_paths_are_moved(tmp_path: pathlib.Path) -> None:
    code = 'Store.create(["/mnt/nvme0/t.dev", \'/mnt/a/b\'], x="/mnt")'
    moved = placeholders_moved(code, tmp_path)
    assert '"/mnt/nvme0/t.dev"' not in moved and "'/mnt/a/b'" not in moved
    assert repr(str(tmp_path / "mnt" / "nvme0" / "t.dev")) in moved
    assert (tmp_path / "mnt" / "a").is_dir()
    assert 'x="/mnt"' in moved  # only paths below /mnt/


def gpu_mode() -> bool:
    """The GPU test mode (TERAIO_EXAMPLES=gpu); anything else but unset is refused."""
    mode = os.environ.get("TERAIO_EXAMPLES", "")
    assert mode in ("", "gpu"), f"TERAIO_EXAMPLES={mode!r}: expected 'gpu' or unset"
    return mode == "gpu"


def _skip_unless_it_runs_here(block: Block) -> None:
    if block.info in RUN_ON_CUDA and not cuda_available():
        pytest.skip(f"{block.name} needs CUDA ({block.info!r}): it runs in the GPU test mode")
    if block.info == "sh" and gpu_mode():
        pytest.skip(f"{block.name} is a CPU shell block (cargo builds): it runs in CI, not the GPU test mode")


def _check(block: Block, done: subprocess.CompletedProcess[str]) -> None:
    output = (done.stdout + done.stderr)[-4000:]
    if done.returncode != 0:
        pytest.fail(f"{block.name} failed (exit {done.returncode}):\n{output}", pytrace=False)
    if DONE not in done.stdout:
        pytest.fail(f"{block.name} did not run to its end:\n{output}", pytrace=False)


PYTHON_BLOCKS = [b for b in RUNNABLE if b.language == "python"]
SHELL_BLOCKS = [b for b in RUNNABLE if b.language == "sh"]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.name for b in PYTHON_BLOCKS])
def test_program_runs(block: Block, store_dir: pathlib.Path) -> None:
    _skip_unless_it_runs_here(block)
    missing = missing_imports(block.code)
    if missing:
        pytest.skip(f"{block.name} imports {', '.join(missing)}, not installed here")
    script = store_dir / "example.py"
    script.write_text(placeholders_moved(block.code, store_dir) + f"\nprint({DONE!r})\n")
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=store_dir,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    _check(block, done)
    # Only the script and the placeholder directories this test made may remain.
    leftovers = sorted(p.name for p in store_dir.iterdir() if p.name not in {"example.py", "mnt"})
    assert not leftovers, f"{block.name} left {leftovers} in its working directory: it cannot run twice"


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[b.name for b in SHELL_BLOCKS])
def test_commands_run(block: Block, request: pytest.FixtureRequest, checkout_view: pathlib.Path) -> None:
    _skip_unless_it_runs_here(block)
    release_teraio: pathlib.Path = request.getfixturevalue("release_teraio")
    path = os.pathsep.join(
        [str(release_teraio), str(pathlib.Path(sys.executable).parent), os.environ["PATH"]]
    )
    # TMPDIR: the scratch directory, a disk file system (the default bench's store goes there).
    env = {
        **os.environ,
        "PATH": path,
        "CARGO_TARGET_DIR": str(target_dir()),
        "TMPDIR": str(checkout_view.parent),
        "PYTHONUNBUFFERED": "1",
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code + f"\necho {DONE}\n"],
        cwd=checkout_view,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    _check(block, done)


def listing() -> str:
    """Every block and where it runs, as a Markdown table."""
    rows = ["| block | info string | runs |", "|---|---|---|"]
    rows += [f"| {b.name} | `{b.info or '(none)'}` | {WHERE.get(b.info, 'UNKNOWN')} |" for b in ALL]
    return "\n".join(rows)


if __name__ == "__main__":
    print(listing())
