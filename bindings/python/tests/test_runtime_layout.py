"""The shape of `teraio/` read from its source (no torch needed): floors whose imports only point
down and never circle, the store called from one module (the tiers), copies between GPU and host
memory made in the movers, object ids from `teraio.ids`; and docs/runtime.md's options table,
made from `OffloadOptions`.

docs/runtime.md describes the floors.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
from teraio import options as options_module

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "teraio"
RUNTIME_DOC = Path(__file__).resolve().parents[3] / "docs" / "runtime.md"

#: Top to bottom. A module may import modules on its own floor or below, never above; patterns
#: are module names (`fnmatch`). The tools the modes use (profiler, recompute, blocks, ...) sit
#: below the runtime; the planner's and the store's faces below them; the binding at the bottom.
FLOORS: list[tuple[str, list[str]]] = [
    ("package face", ["teraio"]),
    ("integrations", ["teraio.integrations", "teraio.integrations.*"]),
    ("front door", ["teraio.runtime"]),
    ("modes", ["teraio.runtime.modes", "teraio.runtime.modes.*"]),
    ("session, report", ["teraio.runtime.session", "teraio.runtime.report"]),
    ("plans", ["teraio.runtime.plans", "teraio.runtime.plans.*"]),
    ("movers", ["teraio.runtime.movers", "teraio.runtime.movers.*"]),
    ("errors", ["teraio.runtime.errors"]),
    (
        "tools",
        [
            "teraio.blocks",
            "teraio.calibration",
            "teraio.head",
            "teraio.ids",
            "teraio.machine",
            "teraio.optimizer_state_dict",
            "teraio.options",
            "teraio.pinned",
            "teraio.profiler",
            "teraio.recompute",
            "teraio.schedule_record",
            "teraio.selective",
            "teraio.sharded",
            "teraio.timing",
        ],
    ),
    ("planner, store and CPU step", ["teraio.planning", "teraio.store", "teraio.cpu_adamw"]),
    ("binding", ["teraio._native"]),
]

#: The modules that may name the binding (`_native`): the store's face, the planner's face, the
#: CPU step's face and the package's exports of the engine's errors and constants.
BINDING_FACES = {"teraio.store", "teraio.planning", "teraio.cpu_adamw", "teraio"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    # The binding is a compiled module; its stub stands in for it.
    modules["teraio._native"] = PACKAGE / "_native.pyi"
    return modules


def _floor(module: str) -> int:
    for index, (_, patterns) in enumerate(FLOORS):
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return index
    raise AssertionError(f"{module} is on no floor: add it to FLOORS (and to docs/runtime.md)")


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The teraio modules `module` imports anywhere in its source (function-level imports too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from origin import name`: the submodule where there is one, else origin itself.
            names = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name in known and name != module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {module: _imports(module, path, known) for module, path in modules.items()}


def test_every_module_is_on_a_floor() -> None:
    for module in _modules():
        _floor(module)


def test_imports_point_down() -> None:
    upward = [
        f"{module} ({FLOORS[_floor(module)][0]}) imports {target} ({FLOORS[_floor(target)][0]})"
        for module, targets in _graph().items()
        for target in sorted(targets)
        if _floor(target) < _floor(module)
    ]
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_imports_never_circle() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_graph_sees_relative_and_nested_imports() -> None:
    graph = _graph()
    assert "teraio.runtime.errors" in graph["teraio.runtime.modes.whole_model"]
    assert "teraio.runtime.modes.tensor" in graph["teraio.runtime"]
    assert "teraio.runtime" in graph["teraio"]  # imported inside `__getattr__`


def _names_binding(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            (node.module or "").endswith("_native") or any(alias.name == "_native" for alias in node.names)
        ):
            return True
        if isinstance(node, ast.Import) and any(alias.name.endswith("_native") for alias in node.names):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "_native":
            return True
    return False


def test_only_the_binding_faces_name_native() -> None:
    naming = [
        module
        for module, path in _modules().items()
        if module not in BINDING_FACES and _names_binding(ast.parse(path.read_text()))
    ]
    assert naming == []


def test_only_the_store_reaches_into_a_native_object() -> None:
    # `x._native` is a Store's or Handle's engine object: store.py alone holds them.
    reaching = [
        module
        for module, path in _modules().items()
        if module != "teraio.store"
        and any(
            isinstance(node, ast.Attribute) and node.attr == "_native"
            for node in ast.walk(ast.parse(path.read_text()))
        )
    ]
    assert reaching == []


def test_the_binding_check_sees_a_reach_in() -> None:
    assert _names_binding(ast.parse("store._native.put_address(1, 2, 3, None)"))
    assert _names_binding(ast.parse("from .._native import NoSpaceError"))
    assert not _names_binding(ast.parse("store.start_put(1, host, 3)"))


#: Objects of the tools and the store that the runtime holds, by the names it holds them under.
_TOOL_OBJECTS = {
    "profiler",
    "store",
    "planning",
    "machine",
    "sharded",
    "timing",
    "recompute",
    "rc",
    "bk",
    "cal",
    "osd",
}


def _private_reaches(tree: ast.AST) -> list[str]:
    """`x._name` / `self.x._name` where x is one of `_TOOL_OBJECTS`: a private member of another
    module's object."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        holder = node.value
        name = (
            holder.id
            if isinstance(holder, ast.Name)
            else holder.attr
            if isinstance(holder, ast.Attribute)
            else ""
        )
        if name in _TOOL_OBJECTS:
            found.append(f"{name}.{node.attr}")
    return found


def test_the_runtime_uses_public_members_only() -> None:
    reaching = {
        module: _private_reaches(ast.parse(path.read_text()))
        for module, path in _modules().items()
        if module.startswith("teraio.runtime")
    }
    assert {module: found for module, found in reaching.items() if found} == {}
    assert _private_reaches(ast.parse("self.profiler._mode; profiler._lookup(x)")) == [
        "profiler._mode",
        "profiler._lookup",
    ]


#: Calls that copy between GPU and host memory or make host buffers for such copies.
_COPY_CALL = re.compile(r"\.copy_\(|non_blocking\s*=|pin_memory\s*=")
#: Where they may stand: the runtime's movers, the link measurement (`machine.measure_link`,
#: which times such copies on purpose), and the pinned memory they all use (`teraio.pinned`).
_COPY_HOMES = ("teraio.runtime.movers.*", "teraio.machine", "teraio.pinned")


def _lines_outside(pattern: re.Pattern[str], homes: Iterable[str]) -> list[str]:
    """Lines matching `pattern` in modules that match none of `homes` (`fnmatch` patterns)."""
    return [
        f"{module}:{number}: {line.strip()}"
        for module, path in _modules().items()
        if not any(fnmatch.fnmatchcase(module, home) for home in homes)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


def test_copies_between_gpu_and_host_live_in_the_movers() -> None:
    assert _lines_outside(_COPY_CALL, _COPY_HOMES) == []


#: Where asynchronous copies between GPU and host memory are issued: one module of the runtime,
#: and the link measurement.
_ASYNC_COPY_HOMES = {"teraio.runtime.movers.copy", "teraio.machine"}


def test_one_module_of_the_runtime_copies_between_gpu_and_host() -> None:
    assert _lines_outside(re.compile(r"non_blocking\s*="), _ASYNC_COPY_HOMES) == []


@pytest.mark.parametrize(
    "line", ["host.copy_(source)", "x.to(y, non_blocking=True)", "torch.empty(1, pin_memory=cuda)"]
)
def test_the_copy_check_sees_a_copy(line: str) -> None:
    assert _COPY_CALL.search(line)


#: A call that moves bytes to or from a store, or deletes its objects.
_STORE_CALL = re.compile(
    r"\bstore\.(start_put|start_get|put_async|get_async|put|get|get_bytes|delete|delete_many)\("
)
#: Where they may stand: the tiers (every mode's bytes go through them) and the store-bandwidth
#: measurement (`machine`, which times such calls on purpose).
_STORE_HOMES = {"teraio.runtime.movers.tiers", "teraio.machine", "teraio.store"}


def test_one_module_of_the_runtime_calls_the_store() -> None:
    assert _lines_outside(_STORE_CALL, _STORE_HOMES) == []


@pytest.mark.parametrize(
    "line", ["self.store.start_put(1, host, 3)", "store.delete(object_id)", "self.store.get_async(i, b)"]
)
def test_the_store_check_sees_a_call(line: str) -> None:
    assert _STORE_CALL.search(line)


#: A literal object-id base (`1 << 40` and up): ids come from `teraio.ids` instead.
_LITERAL_ID = re.compile(r"object_id_base\s*[:=][^,)]*<<|id_base\s*=\s*\d|<<\s*4[0-9]\b")


def test_object_ids_come_from_their_namespaces() -> None:
    literal = [
        f"{module}:{number}: {line.strip()}"
        for module, path in _modules().items()
        if module.startswith("teraio.runtime")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _LITERAL_ID.search(line.split("#")[0])
    ]
    assert literal == []
    assert _LITERAL_ID.search("object_id_base=1 << 42")


def test_the_runtime_doc_holds_the_options_table() -> None:
    text = RUNTIME_DOC.read_text()
    section = text[text.index("\n## Options\n") :]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|")) + "\n"
    assert table == options_module.options_table()


def test_the_options_table_wants_every_field_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = options_module.OffloadOptions.__doc__ or ""
    assert "        sync_each_step: " in doc
    monkeypatch.setattr(
        options_module.OffloadOptions, "__doc__", doc.replace("        sync_each_step: ", "        sync: ")
    )
    with pytest.raises(AssertionError, match="no entry for sync_each_step"):
        options_module.options_table()
