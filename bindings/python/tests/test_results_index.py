"""benches/results/README.md: the generated index of the saved benchmark results.

The committed index must be what `summarize.py --index benches/results` writes now (so a results
folder added without regenerating it fails here), every file must be described, and a RESULT
record's figures must reach its row. Pure Python, no GPU: the saved results are read, not rerun.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
RESULTS = REPO / "benches" / "results"


def load_summarize():
    spec = importlib.util.spec_from_file_location("summarize", REPO / "benches" / "torch" / "summarize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


summarize = load_summarize()


def test_committed_index_is_current() -> None:
    assert (RESULTS / "README.md").read_text() == summarize.index_markdown(RESULTS), (
        "benches/results/README.md is stale: run python3 benches/torch/summarize.py --index benches/results"
    )


def write_folder(root: pathlib.Path, about: str, files: dict[str, str]) -> pathlib.Path:
    folder = root / "2026-01-02-h100"
    folder.mkdir()
    (folder / "about.txt").write_text(about)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_rows_carry_the_records_figures(tmp_path: pathlib.Path) -> None:
    ideal = {"mode": "ideal", "batch": 4, "ms_per_iter": 1000.4, "peak_bytes": 45 << 30}
    teraio = {
        "mode": "teraio",
        "batch": 4,
        "cap_bytes": 22 << 30,
        "ms_per_iter": 1150.6,
        "teraio_report": {"peak_gpu_bytes": 21 << 30},
    }
    oom = {"mode": "ideal", "batch": 8, "error": "CUDA out of memory: tried to allocate 2 GiB"}
    log = "step 0: loss 1.0\nRESULT " + json.dumps(teraio) + "\n"
    write_folder(
        tmp_path,
        "run.jsonl: ideal and an OOM | batch 8\nrun.log: a teraio log\nnotes.md: prose\n",
        {"run.jsonl": json.dumps(ideal) + "\n" + json.dumps(oom) + "\n", "run.log": log, "notes.md": "# n\n"},
    )
    lines = summarize.index_markdown(tmp_path).splitlines()
    assert "## 2026-01-02, h100: [2026-01-02-h100/](2026-01-02-h100/)" in lines
    assert "| `run.jsonl` | ideal and an OOM \\| batch 8 | ideal | 4 | - | 1000 | 45.0 |" in lines
    assert "|  |  | ideal | 8 | - | **out of memory** | - |" in lines
    assert "| `run.log` | a teraio log | teraio | 4 | 22.0 | 1151 | 21.0 |" in lines
    assert "| `notes.md` | prose | - | - | - | - | - |" in lines
    assert summarize.write_index(tmp_path).read_text() == "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("about", "files", "message"),
    [
        ("a.jsonl: described\n", {"a.jsonl": "", "b.jsonl": ""}, "no description for b.jsonl"),
        ("a.jsonl: described\ngone.jsonl: old\n", {"a.jsonl": ""}, "describes missing gone.jsonl"),
        ("a.jsonl described\n", {"a.jsonl": ""}, "expected `file: what it holds`"),
        ("a.jsonl: one\na.jsonl: two\n", {"a.jsonl": ""}, "a.jsonl is described twice"),
    ],
)
def test_every_file_described_once(
    tmp_path: pathlib.Path, about: str, files: dict[str, str], message: str
) -> None:
    write_folder(tmp_path, about, files)
    with pytest.raises(ValueError, match=message):
        summarize.index_markdown(tmp_path)


def test_folder_names_carry_date_and_machine(tmp_path: pathlib.Path) -> None:
    (tmp_path / "h100-session4").mkdir()
    with pytest.raises(ValueError, match="named <yyyy-mm-dd>-<machine>"):
        summarize.index_markdown(tmp_path)


def test_folder_without_about_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "2026-01-02-h100").mkdir()
    with pytest.raises(ValueError, match="no about.txt"):
        summarize.index_markdown(tmp_path)
