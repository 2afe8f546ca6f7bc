"""Store options are declared once (the engine's table, `teraio.STORE_OPTIONS`): the store
takes exactly them, and the type stubs and docs/python.md list exactly them."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest
import teraio

PACKAGE = pathlib.Path(__file__).resolve().parents[1]
STUBS = PACKAGE / "python" / "teraio" / "_native.pyi"
DOCS = PACKAGE.parents[1] / "docs" / "python.md"


def _options(stages: tuple[str, ...]) -> list[dict[str, Any]]:
    return [o for o in teraio.STORE_OPTIONS if o["stage"] in stages]


def _annotation(option: dict[str, Any]) -> str:
    kind = "Union[int, float, str]" if option["accepts_size_text"] else option["type"]
    return f"Optional[{kind}]" if option["optional"] else kind


def _stub_signature(method: str) -> list[tuple[str, str, Any]]:
    tree = ast.parse(STUBS.read_text())
    store = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Store")
    function = next(n for n in store.body if isinstance(n, ast.FunctionDef) and n.name == method)
    args = function.args
    return [
        (arg.arg, ast.unparse(arg.annotation) if arg.annotation else "", ast.literal_eval(default))
        for arg, default in zip(args.kwonlyargs, args.kw_defaults)
        if default is not None
    ]


@pytest.mark.parametrize(("method", "stages"), [("create", ("format", "open")), ("open", ("open",))])
def test_stubs_list_the_table(method: str, stages: tuple[str, ...]) -> None:
    expected = [(o["name"], _annotation(o), o["default"]) for o in _options(stages)]
    assert _stub_signature(method) == expected


def test_docs_list_the_table() -> None:
    text = DOCS.read_text()
    section = text[text.index("### Store options") :]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        documented.append((cells[0].strip("`"), cells[1], cells[3].strip("`"), cells[4].strip("`")))
        if len(documented) == len(teraio.STORE_OPTIONS):
            break
    expected = [
        (
            o["name"],
            o["stage"],
            "None" if o["default"] is None else repr(o["default"]).replace("'", '"'),
            o["c_field"] or "-",
        )
        for o in teraio.STORE_OPTIONS
    ]
    assert documented == expected


def test_every_option_is_taken_with_its_default(store_dir: pathlib.Path) -> None:
    paths = [store_dir / "dev0", store_dir / "dev1"]
    create = {o["name"]: o["default"] for o in teraio.STORE_OPTIONS}
    create["file_size_bytes"] = 64 << 20
    with teraio.Store.create(paths, **create) as store:
        assert store.info()["stripe_unit_bytes"] == create["stripe_unit_bytes"]
    with teraio.Store.open(paths, **{o["name"]: o["default"] for o in _options(("open",))}) as store:
        assert store.info()["object_count"] == 0


def test_options_reach_the_engine(store_dir: pathlib.Path) -> None:
    paths = [store_dir / "dev0"]
    store = teraio.Store.create(
        paths, file_size_bytes="64MiB", stripe_unit_bytes="256KiB", backend="psync", durable=False
    )
    info = store.info()
    assert info["stripe_unit_bytes"] == 256 << 10
    assert info["devices"][0]["size_bytes"] == 64 << 20
    assert info["backend"] == "psync"
    store.close()


def test_bad_options_are_named(store_dir: pathlib.Path) -> None:
    paths = [store_dir / "dev0"]
    with pytest.raises(teraio.InvalidArgumentError, match="verify_checksum.*known:.*verify_checksums"):
        teraio.Store.create(paths, file_size_bytes=64 << 20, verify_checksum=False)
    with pytest.raises(teraio.InvalidArgumentError, match="queue_depth takes a whole number"):
        teraio.Store.create(paths, file_size_bytes=64 << 20, queue_depth="deep")
    with pytest.raises(teraio.InvalidArgumentError, match="durable takes true or false"):
        teraio.Store.create(paths, file_size_bytes=64 << 20, durable=1)
    # A float is a size's type, not a count's: refused by the option, naming the value.
    with pytest.raises(teraio.InvalidArgumentError, match='queue_depth takes a whole number, not "2.5"'):
        teraio.Store.create(paths, file_size_bytes=64 << 20, queue_depth=2.5)
    assert not (store_dir / "dev0").exists(), "a refused option must not create files"
    teraio.Store.create(paths, file_size_bytes=64 << 20, durable=False).close()
    with pytest.raises(teraio.InvalidArgumentError, match="block_size is fixed when a store is formatted"):
        teraio.Store.open(paths, block_size=8192)


def test_size_options_take_floats_and_fractions_rounded_down(store_dir: pathlib.Path) -> None:
    # 32 MiB + 0.7 bytes and 32.5 MiB: each file is the size rounded down to whole bytes.
    for index, size in enumerate((float(32 << 20) + 0.7, "32.5MiB")):
        path = store_dir / f"dev{index}"
        with teraio.Store.create([path], file_size_bytes=size, durable=False):
            pass
        assert path.stat().st_size == int(32.5 * (1 << 20)) if isinstance(size, str) else 32 << 20
