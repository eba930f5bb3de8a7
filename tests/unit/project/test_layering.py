"""The package rules of CONTRIBUTING.md, read from the source: no role package imports
another role's modules (only the libraries, e.g. `roles.algo`, `roles.training`,
`roles.fsdp`, `roles.megatron`, `roles.kernels`, `roles.weights`, `roles.generation`, and
`runtime` / `transport`), the libraries import no role, the training libraries import one
way only (`kernels` <- `fsdp`; `training` <- `fsdp`, `megatron`; the two backends never
each other), `transport` imports neither `runtime` nor `roles`, there is no import circle
anywhere in the tree (imports inside functions count), and `runtime`'s packages and root
modules stand on floors (`RUNTIME_FLOORS`): each imports only from floors below its own, and
`runtime.config` imports nothing of `runtime` but `runtime.errors`."""

from __future__ import annotations

import ast
from collections import defaultdict

from tests.conftest import ROOT

# A role package is one with a `role.py` (its Role subclass); the rest of `roles` are libraries.
ROLES = {p.name for p in (ROOT / "roles").iterdir() if (p / "role.py").is_file()}
LIBRARIES = {p.name for p in (ROOT / "roles").iterdir() if p.is_dir() and any(p.glob("*.py"))} - ROLES


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports (any import statement, TYPE_CHECKING too)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for package in ("roles", "runtime", "transport"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module is not None:
                    base = parts[: -node.level] if node.level else []
                    source = ".".join([*base, node.module]) if node.level else node.module
                    graph[name].add(source)
                    # `from roles.controller import state` imports the module roles.controller.state
                    graph[name].update(f"{source}.{a.name}" for a in node.names if _is_module(f"{source}.{a.name}"))
                elif isinstance(node, ast.Import):
                    graph[name].update(a.name for a in node.names)
    return {m: {d for d in deps if d.split(".")[0] in ("roles", "runtime", "transport")} for m, deps in graph.items()}


def test_role_packages_are_found_from_the_code() -> None:
    assert {"controller", "rollout", "trainer", "critic", "reward"} <= ROLES
    assert {"algo", "training", "fsdp", "megatron", "kernels", "weights", "generation"} <= LIBRARIES


def test_submodules_imported_by_name_are_edges() -> None:
    deps = imports()["roles.controller.role"]
    assert any(d.startswith("roles.controller.") for d in deps), deps


def test_roles_import_only_libraries_and_libraries_import_no_role() -> None:
    bad = []
    for module, deps in imports().items():
        parts = module.split(".")
        for dep in deps:
            dep_parts = dep.split(".")
            if parts[0] == "transport" and dep_parts[0] in ("runtime", "roles"):
                bad.append((module, dep))
            crossing = dep_parts[0] == "roles" and len(parts) > 1 and len(dep_parts) > 1
            if parts[0] == "roles" and crossing and dep_parts[1] in ROLES and dep_parts[1] != parts[1]:
                bad.append((module, dep))
            if parts[0] == "runtime" and dep_parts[0] == "roles":
                bad.append((module, dep))
    assert not bad, bad


# Library -> the project libraries it must not import: the backend-neutral `training` knows
# neither backend nor their kernels, the kernels know no other package, the backends not each other.
FORBIDDEN = {
    "training": {"fsdp", "megatron", "kernels"},
    "kernels": LIBRARIES - {"kernels"},
    "fsdp": {"megatron"},
    "megatron": {"fsdp", "kernels"},
}


def test_training_libraries_import_one_way() -> None:
    bad = [
        (module, dep)
        for module, deps in imports().items()
        for dep in deps
        if module.split(".")[:1] == ["roles"] and len(module.split(".")) > 1 and len(dep.split(".")) > 1
        and dep.split(".")[0] == "roles" and dep.split(".")[1] in FORBIDDEN.get(module.split(".")[1], set())
    ]  # fmt: skip
    assert not bad, bad


def test_every_package_says_what_it_holds() -> None:
    """Every package of `roles`, `runtime` and `transport` has an `__init__.py` whose
    docstring names each of its modules and subpackages."""
    missing = []
    for top in ("roles", "runtime", "transport"):
        for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir() and any(p.glob("*.py")))]:
            if folder.name == "__pycache__":
                continue
            init = folder / "__init__.py"
            where = folder.relative_to(ROOT)
            if not init.is_file():
                missing.append(f"{where}: no __init__.py")
                continue
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
            names += [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
            missing += [f"{where}/{n}" for n in names if f"`{n}`" not in doc and f"{n}." not in doc]
            if not doc:
                missing.append(f"{where}: no docstring")
    assert not missing, missing


def find_circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of `graph` (its first module repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> list[str]:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (circle := visit(dep, [*stack, dep])):
                return circle
        state[node] = 2
        return []

    for module in sorted(graph):
        if module not in state and (circle := visit(module, [module])):
            return circle
    return []


def test_a_circle_is_found() -> None:
    """The search on graphs drawn by hand: a circle through three modules, and none."""
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_anywhere() -> None:
    circle = find_circle(imports())
    assert not circle, f"import circle: {' -> '.join(circle)}"


# `runtime`'s rooms (its packages and root modules), bottom floor first. A room imports only
# from floors below its own: the configuration knows nothing of the machine or the launcher,
# the checks before a launch know nothing of the launcher, and only the `tandem` command
# knows every subcommand.
RUNTIME_FLOORS = (
    {"errors"},
    {"config", "logs", "hf_quiet", "last_words", "seeds", "step_phases", "user_functions"},
    {"identity", "data", "memory", "tiny", "gc_pauses"},
    {"checkpoints", "role"},
    {"preflight", "views"},
    {"launch", "entry"},
    {"cli"},
)


def _room(module: str) -> str:
    """`runtime.memory.plan` -> `memory`; `runtime.role` -> `role`."""
    return module.split(".")[1]


def test_every_runtime_room_has_a_floor() -> None:
    rooms = {p.stem for p in (ROOT / "runtime").glob("*.py") if p.stem != "__init__"}
    rooms |= {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").is_file()}
    placed = [room for floor in RUNTIME_FLOORS for room in floor]
    assert sorted(placed) == sorted(set(placed)), "a room on two floors"
    assert rooms == set(placed), rooms ^ set(placed)
    loose = [p.stem for p in (ROOT / "runtime").glob("*.py") if p.stem != "__init__"]
    assert len(loose) <= 12, f"{len(loose)} modules at the root of runtime/ (group them by concern): {sorted(loose)}"


def test_runtime_imports_only_downward() -> None:
    floor = {room: i for i, rooms in enumerate(RUNTIME_FLOORS) for room in rooms}
    bad = [
        (module, dep)
        for module, deps in imports().items()
        if module.startswith("runtime.")
        for dep in deps
        if dep.startswith("runtime.") and _room(dep) != _room(module) and floor[_room(dep)] >= floor[_room(module)]
    ]
    assert not bad, bad


def test_runtime_config_imports_only_the_error_root() -> None:
    bad = [
        (module, dep)
        for module, deps in imports().items()
        if module == "runtime.config" or module.startswith("runtime.config.")
        for dep in deps
        if dep.split(".")[0] == "runtime" and dep.split(".")[:2] not in (["runtime", "config"], ["runtime", "errors"])
    ]
    assert not bad, bad


def test_the_runtime_root_imports_nothing() -> None:
    """`from runtime import gc_pauses` draws an arrow to `runtime` itself: its `__init__` holds
    only its docstring, so that arrow carries no import."""
    assert not imports().get("runtime"), imports().get("runtime")
