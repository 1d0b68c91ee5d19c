"""The package's layers, read from its own imports (every `import`, at the top or inside a
function): which modules may sit at the top of `qurl_jax/`, no import circle, no import from a
lower layer to a higher one, the `ConfigDict` kept to the config package and the command lines,
and a trainer that reads typed settings only. docs/architecture.md draws the same rule."""

from __future__ import annotations

import ast
import pathlib

import pytest

import qurl_jax

ROOT = pathlib.Path(qurl_jax.__file__).parent

# Bottom to top: a module may import its own package and any package below it.
LAYERS = ("runtime", "cpu_kernels", "quant", "lora", "rl", "data", "parallel", "models",
          "sampling", "learner", "config", "plan", "train", "study", "bench", "<top>")
# The only modules at the top of qurl_jax/: the package and its two command lines.
TOP_MODULES = {"__init__", "main", "evaluate"}
# Where a ConfigDict may be handled: the config package, the command lines (they parse one),
# the study and the benchmarks (they build configs of variants), and the trainer's constructor,
# which hands it to `config.resolve` (checked on its own below).
CONFIG_DICT_ALLOWED = ("config", "bench", "study", "<top>")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(("qurl_jax",) + parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: pathlib.Path) -> set[str]:
    """The qurl_jax modules `module` imports (a `from package import name` of a sub-module
    counts as that sub-module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        out.update(r for n in names if n.startswith("qurl_jax") and (r := _resolve(n)))
    out.discard(module)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "<top>"


def test_only_the_command_lines_sit_at_the_top():
    top = {p.stem for p in ROOT.glob("*.py")}
    assert top == TOP_MODULES, f"move {sorted(top - TOP_MODULES)} into a package by concern"
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == set(LAYERS) - {"<top>"}, "a new package needs its place in LAYERS"


def test_no_import_circle():
    # Tarjan's strongly connected components over the module graph.
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_no_import_from_a_lower_layer_to_a_higher_one():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
                    if rank[_layer(b)] > rank[_layer(a)])
    assert not upward, upward


def test_the_config_dict_stays_in_the_config_package_and_the_command_lines():
    def imports_ml_collections(path: pathlib.Path) -> bool:
        return any(isinstance(n, ast.Import) and any(a.name.startswith("ml_collections")
                                                     for a in n.names)
                   or isinstance(n, ast.ImportFrom) and (n.module or "").startswith(
                       "ml_collections") for n in ast.walk(ast.parse(path.read_text())))

    users = sorted(m for m, p in MODULES.items()
                   if imports_ml_collections(p) and _layer(m) not in CONFIG_DICT_ALLOWED)
    assert users == ["qurl_jax.train.trainer"], users


def test_the_trainer_reads_typed_settings_only():
    """`Trainer.__init__`'s `config` goes to `config.resolve` and nowhere else."""
    tree = ast.parse(MODULES["qurl_jax.train.trainer"].read_text())
    uses = [(node.lineno, node.id) for node in ast.walk(tree)
            if isinstance(node, ast.Name) and node.id == "config"]
    resolved = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "resolve"
                and [getattr(a, "id", None) for a in node.args] == ["config"]]
    assert len(uses) == 1 and [u[0] for u in uses] == resolved, uses
    assert "self.config" not in MODULES["qurl_jax.train.trainer"].read_text()


@pytest.mark.parametrize("public", ["qurl_jax.Trainer", "qurl_jax.rl.objectives.policy_loss"])
def test_public_entry_points(public):
    import importlib

    module, _, name = public.rpartition(".")
    assert getattr(importlib.import_module(module), name)


def test_the_reader_sees_an_upward_import_inside_a_function(tmp_path):
    """The checks above are only as good as the reader: a lower module's function-level import of
    a higher one is an edge, and an upward one."""
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from qurl_jax.train import trainer\n    return trainer\n")
    found = _imports("qurl_jax.runtime.x", path)
    assert found == {"qurl_jax.train.trainer"}
    rank = LAYERS.index
    assert rank(_layer("qurl_jax.train.trainer")) > rank(_layer("qurl_jax.runtime.x"))
