"""The floors of the code base: each imports only the floors below it, lazy imports and `importlib` included.

    modeling_osprey   (floor 0: the Hub remote code; torch, transformers and safetensors only, relative imports)
    osprey            (floor 1: the pipeline and its ground module)
    trainers, space   (floor 2: each builds on the floors below, never on the other)
    benchmarks        (floor 3: the replication drivers and measured workers, which time the trainers too)

Inside `osprey`, the sub-packages have an order of their own (`ROOMS`): each imports only its own room and the rooms
ranked below it; two rooms of one rank (`stages`, `decoding`) never import each other.

    ground            (osprey/ground.py: the helpers every room shares)
    models            (the zoo, model loading, the packed format, the model card and publishing)
    stages, decoding  (prune / convert / baselines; speculative decoding and its near-tie check)
    measuring         (bench, its suites and report, demo)
    serving           (export, the vLLM schedule, tune)

`osprey/cli.py`, the one `osprey` command entry, may dispatch to every floor. The checker reads the source (it imports
nothing), so an import inside a function counts like one at the top; an `importlib.import_module` with a computed name
counts as importing every project module named by a string in that file.
"""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"modeling_osprey": 0, "hub_cards": 0, "osprey": 1, "trainers": 2, "space": 2, "benchmarks": 3}
CLI_ENTRY = ROOT / "osprey" / "cli.py"
# What the remote code may import besides itself: it must load where only transformers (and torch) are installed.
REMOTE_CODE_IMPORTS = {"torch", "transformers", "safetensors"}


def package_of(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def local_modules(path: Path) -> set[str]:
    """Modules a file imports by plain name from its own folder (the Space's files, scripts beside each other)."""
    return {sibling.stem for sibling in path.parent.glob("*.py")}


def imported_modules(source: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted module name) of every import in `source`: statements anywhere (lazy ones included), relative
    ones resolved, and `importlib.import_module` / `__import__` calls."""
    tree = ast.parse(source)
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    strings = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((node.lineno, ".".join([*base, node.module] if node.module else base)))
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            argument = node.args[0]
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                name = argument.value
                found.append((node.lineno, package + name if name.startswith(".") else name))
            elif isinstance(argument, ast.JoinedStr) and _starts_relative(argument):
                found.append((node.lineno, package))  # `f".{name}"` relative to the file's own package
            else:  # a computed name: any project module a string of the file names may be imported
                found += [(node.lineno, name) for name in strings if name.split(".")[0] in FLOORS]
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _starts_relative(argument: ast.JoinedStr) -> bool:
    first = argument.values[0] if argument.values else None
    return isinstance(first, ast.Constant) and str(first.value).startswith(".")


def violations(path: Path, source: str | None = None) -> list[str]:
    """Why `path`'s imports break the floors (empty when they do not)."""
    source = path.read_text(encoding="utf-8") if source is None else source
    package, problems = package_of(path), []
    own_floor = FLOORS[package]
    for line, module in imported_modules(source, path):
        top = module.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line} imports {module}"
        if package == "modeling_osprey":
            if top == "modeling_osprey" and not _is_relative_in(source, line):
                problems.append(f"{where} absolutely (remote code must import itself relatively)")
            elif top not in {"modeling_osprey", *REMOTE_CODE_IMPORTS} and top not in sys.stdlib_module_names:
                problems.append(f"{where}, which the remote code cannot count on")
        elif top in FLOORS and top != package and path != CLI_ENTRY and FLOORS[top] >= own_floor:
            problems.append(f"{where}, floor {FLOORS[top]} (its own: {own_floor})")
    return problems


def _is_relative_in(source: str, line: int) -> bool:
    return any(
        isinstance(node, ast.ImportFrom) and node.lineno == line and node.level > 0
        for node in ast.walk(ast.parse(source))
    )


def project_files() -> list[Path]:
    return sorted(path for package in FLOORS for path in (ROOT / package).rglob("*.py"))


def test_every_floor_imports_only_the_floors_below_it():
    files = project_files()
    assert len(files) > 30 and CLI_ENTRY in files
    problems = [problem for path in files for problem in violations(path)]
    assert problems == []


@pytest.mark.parametrize(
    "path, source, expected",
    [
        (
            "osprey/measuring/bench_suites.py",
            "def f():\n    from trainers.corpora.loading import x\n",
            "imports trainers.corpora.loading, floor 2",
        ),
        (
            "osprey/models/zoo.py",
            "import importlib\nimportlib.import_module('space.app')\n",
            "imports space.app, floor 2",
        ),
        ("trainers/corpora/loading.py", "from space import allowlist\n", "imports space, floor 2"),
        (
            "trainers/corpora/loading.py",
            "M = 'benchmarks.x'\nimportlib.import_module(M)\n",
            "imports benchmarks.x, floor 3",
        ),
        ("modeling_osprey/modeling_osprey.py", "def f():\n    from osprey.models.hub import push\n", "cannot count on"),
        ("modeling_osprey/modeling_osprey.py", "from modeling_osprey import configuration_osprey\n", "absolutely"),
    ],
)
def test_the_checker_catches_upward_imports(path, source, expected):
    """The control: each of these would be reported (lazy, importlib with a constant or a computed name, remote code
    importing the pipeline or itself absolutely)."""
    problems = violations(ROOT / path, source)
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_cli_entry_alone_may_dispatch_to_every_floor():
    source = "import importlib\nimportlib.import_module('trainers.cli')\n"
    assert violations(CLI_ENTRY, source) == []
    assert violations(ROOT / "osprey" / "bench.py", source) != []


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(sources: dict[Path, str]) -> list[list[str]]:
    """Cycles in the graph of project modules importing one another (lazy imports included)."""
    names = {module_name(path): path for path in sources}
    graph = {
        name: {module for _, module in imported_modules(sources[path], path) if module in names and module != name}
        for name, path in names.items()
    }
    cycles, state = [], {}

    def visit(name, stack):
        state[name] = "open"
        for neighbour in sorted(graph[name]):
            if state.get(neighbour) == "open":
                cycles.append(stack[stack.index(neighbour) :] + [neighbour])
            elif neighbour not in state:
                visit(neighbour, [*stack, neighbour])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_two_modules_import_each_other():
    sources = {path: path.read_text(encoding="utf-8") for path in project_files()}
    assert import_cycles(sources) == []
    # The control: the cycle this test was written for (feature_cache lazily importing distill, which imports it).
    feature_cache = ROOT / "trainers" / "features" / "feature_cache.py"
    sources[feature_cache] += "\ndef f():\n    from ..distill import load_target\n"
    assert ["trainers.distill", "trainers.features.feature_cache", "trainers.distill"] in import_cycles(sources)


# Code that runs in vLLM's own environment, where the osprey package is not installed (its transformers pin conflicts
# with vLLM's): the osprey-vllm plugin and the scripts that drive vLLM engines.
VLLM_SIDE = sorted((ROOT / "serving" / "vllm").rglob("*.py")) + [
    ROOT / "osprey" / "serving" / "vllm_engine.py",
    ROOT / "tests" / "vllm_engine.py",
    ROOT / "tests" / "vllm_v2_calls.py",
]


def project_imports(path: Path, source: str | None = None) -> list[str]:
    source = path.read_text(encoding="utf-8") if source is None else source
    return [module for _, module in imported_modules(source, path) if module.split(".")[0] in FLOORS]


def test_code_run_in_vllms_environment_imports_nothing_of_the_project():
    assert len(VLLM_SIDE) >= 5 and all(path.exists() for path in VLLM_SIDE)
    assert {str(path.relative_to(ROOT)): project_imports(path) for path in VLLM_SIDE} == {
        str(path.relative_to(ROOT)): [] for path in VLLM_SIDE
    }
    # The control: a lazy import of the pipeline is found.
    assert project_imports(VLLM_SIDE[0], "def f():\n    from osprey.serving.export import VLLM\n") == [
        "osprey.serving.export"
    ]


# Rooms of `osprey`, by rank: a module imports its own room and the rooms ranked below its own. `osprey/__init__.py`
# (the package's face: the classes and `load_drafter`) ranks with `models`; `osprey/cli.py` may import every room.
ROOMS = {"ground": 0, "models": 1, "stages": 2, "decoding": 2, "measuring": 3, "serving": 4}


def room_of(module: str) -> str:
    """The room of a dotted `osprey` module name (`osprey.models.zoo` -> models, `osprey.ground` -> ground)."""
    parts = module.split(".")
    return "models" if len(parts) == 1 else parts[1]


def room_violations(path: Path, source: str | None = None) -> list[str]:
    """Why `path`'s imports break the order of `osprey`'s rooms (empty when they do not)."""
    source = path.read_text(encoding="utf-8") if source is None else source
    own = room_of(module_name(path))
    problems = []
    for line, module in imported_modules(source, path):
        if module.split(".")[0] != "osprey":
            continue
        room = room_of(module)
        if room != own and ROOMS[room] >= ROOMS[own]:
            problems.append(f"{path.relative_to(ROOT)}:{line} imports {module}, room {room} (its own: {own})")
    return problems


def test_osprey_rooms_import_only_the_rooms_below_them():
    files = [path for path in sorted((ROOT / "osprey").rglob("*.py")) if path != CLI_ENTRY]
    assert {room_of(module_name(path)) for path in files} == set(ROOMS)
    assert [problem for path in files for problem in room_violations(path)] == []
    for room in set(ROOMS) - {"ground"}:  # each room says what it holds and what it may import
        assert "May import" in (ROOT / "osprey" / room / "__init__.py").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "path, source, expected",
    [
        ("osprey/models/zoo.py", "from ..measuring.bench import x\n", "imports osprey.measuring.bench, room measuring"),
        ("osprey/stages/convert.py", "def f():\n    from ..decoding import decode\n", "room decoding"),
        ("osprey/decoding/decode.py", "from osprey.stages.prune import prune\n", "room stages"),
        ("osprey/measuring/bench.py", "import importlib\nimportlib.import_module('osprey.serving.tune')\n", "serving"),
        ("osprey/ground.py", "from .models.zoo import ZOO\n", "room models (its own: ground)"),
    ],
)
def test_the_room_checker_catches_imports_up_or_across(path, source, expected):
    """The control: an import of a higher room, lazy or by importlib, and one across a rank, are each reported."""
    problems = room_violations(ROOT / path, source)
    assert len(problems) == 1 and expected in problems[0], problems
    assert room_violations(ROOT / "osprey" / "serving" / "tune.py", source.replace("serving", "measuring")) == []
