"""The product packages' dependencies point down, and the engine's boundaries hold.

* replica (the engine) < router (the HTTP ingress) < cluster (config, CLI, app building, benchmarks);
  no module imports itself back (no cycle).
* Inside replica, its packages in layers, lowest first: ``config`` < ``protocol`` < ``core`` <
  ``kernels`` < ``quant`` < ``attention`` < ``sample`` < ``lora`` < ``worker`` < ``spec_decode`` < ``engine`` < ``serve``; ``replica``'s own
  ``__init__`` (the public names) sits on top of them.
* Inside router, lowest first: its settings (the module ``router.config``) < ``observability`` <
  ``routing`` < ``request`` < ``lora`` < ``dispatch`` < ``response``; its top-level modules
  (``ingress``, ``ray_compat``) and its own ``__init__`` sit on top of them.
* Inside cluster.bench, lowest first: ``workloads`` (the request sets) < ``engine`` (the in-process
  benches) < ``serving`` (the benches over HTTP); its top-level modules (``cli``, ``options``,
  ``__main__``) and its own ``__init__`` sit on top of them.
* ``replica.protocol`` and ``replica.core`` import no torch (nor NumPy); only ``replica.serve`` imports Ray.
* ``replica.sample`` imports nothing of ``replica.core`` (the scheduler's request state): the sampler
  reads a step's ``SamplingMetadata``, which the worker's persistent batch builds.
* The router imports of the engine only its protocol (``replica.protocol``), its config
  (``replica.config``) and its Serve entry (the ``replica.serve`` package's own names).
* No module imports a private (``_``-prefixed) name from a module of another package.

Imports are read from the source (``ast``), deferred ones inside functions and ``TYPE_CHECKING``
blocks included: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("replica", "router", "cluster")  # lowest first
LAYER = {name: rank for rank, name in enumerate(PACKAGES)}
ENGINE_PACKAGES = (
    "config", "protocol", "core", "kernels", "quant", "attention", "sample", "lora", "worker", "spec_decode", "engine", "pooling", "serve"
)
ROUTER_PACKAGES = ("config", "observability", "routing", "request", "lora", "dispatch", "response", "responses", "embeddings")
ROUTER_MODULE_LAYERS = ("config",)  # modules, not packages: router/config.py, the settings every layer reads
ROUTER_MAY_IMPORT = ("replica.protocol", "replica.config")  # and their modules; plus replica.serve itself
BENCH_PACKAGES = ("workloads", "engine", "serving")  # cluster.bench's packages, lowest first


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules ``path`` imports: ``from a.b import c`` counts as ``a.b.c`` when that is a
    module, else as ``a.b``."""
    found: set[str] = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first = last), or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_graph_sees_known_imports():
    graph = import_graph()
    assert "replica.engine.llm_engine" in graph["replica.engine.async_engine"]
    assert "cluster.bench.engine.offline" in graph["cluster.bench.cli"]  # deferred, inside a function
    assert "replica.config.engine_config" in graph["cluster.config"]
    assert "replica.serve" in graph["router.ingress"]  # deferred; a package's own __init__
    assert "router.request.preparation" in graph["router.dispatch.fanout"]


def external_imports(path: Path) -> set[str]:
    """Top-level names of the non-product modules ``path`` imports (``torch``, ``ray``, ...),
    deferred and ``TYPE_CHECKING`` imports included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - set(PACKAGES)


class Layers:
    """The sub-packages of one package (``prefix``: ``("replica",)``, ``("cluster", "bench")``) in
    layers, lowest first (``order``); ``top``: the name of the package's own top (its ``__init__``
    and the modules that sit beside its sub-packages)."""

    def __init__(self, prefix: tuple[str, ...], order: tuple[str, ...], top: str) -> None:
        self.prefix, self.order, self.top = prefix, order, top
        self.rank = {name: rank for rank, name in enumerate(order)}

    def package(self, module: str) -> str | None:
        """The layer ``module`` belongs to; :attr:`top` for the top; None outside the package."""
        parts = module.split(".")
        n = len(self.prefix)
        if tuple(parts[:n]) != self.prefix:
            return None
        return parts[n] if len(parts) > n and parts[n] in self.rank else self.top

    def violations(self, graph: dict[str, set[str]]) -> list[str]:
        """Imports of a higher layer, or of the top, from a layer."""
        found = []
        for module, targets in graph.items():
            own = self.package(module)
            for target in targets:
                other = self.package(target)
                if own is None or other is None or own == other or own == self.top:
                    continue
                if other == self.top or self.rank[other] > self.rank[own]:
                    found.append(f"{module} imports {target}")
        return sorted(found)

    def folders(self) -> set[str]:
        """The sub-packages on disk (folders with an ``__init__.py``)."""
        return {p.parent.name for p in ROOT.joinpath(*self.prefix).glob("*/__init__.py")}


ENGINE = Layers(("replica",), ENGINE_PACKAGES, "replica")
ROUTER = Layers(("router",), ROUTER_PACKAGES, "router")
BENCH = Layers(("cluster", "bench"), BENCH_PACKAGES, "bench")
engine_package, engine_layer_violations = ENGINE.package, ENGINE.violations
router_package, router_layer_violations = ROUTER.package, ROUTER.violations
bench_package, bench_layer_violations = BENCH.package, BENCH.violations


def test_every_engine_package_has_a_layer():
    assert ENGINE.folders() == set(ENGINE_PACKAGES), "give each package of replica/ a layer in ENGINE_PACKAGES"


@pytest.mark.parametrize("layers", [ENGINE, ROUTER, BENCH], ids=["replica", "router", "cluster.bench"])
def test_packages_import_only_lower_layers(layers):
    upward = layers.violations(import_graph())
    assert not upward, f"a package of {'.'.join(layers.prefix)} imports a higher one:\n" + "\n".join(upward)


def test_core_and_protocol_import_no_torch_and_only_serve_imports_ray():
    found = []
    for module, path in product_modules().items():
        imported = external_imports(path)
        if engine_package(module) in ("core", "protocol", "config") and imported & {"torch", "numpy"}:
            found.append(f"{module} imports {sorted(imported & {'torch', 'numpy'})}")
        if engine_package(module) not in (None, "serve") and "ray" in imported:
            found.append(f"{module} imports ray")
    assert not found, "\n".join(found)


SAMPLE_MAY_NOT_IMPORT = "replica.core"  # and its modules (replica.core.request above all)


def sample_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if engine_package(module) == "sample"
        for target in targets
        if target == SAMPLE_MAY_NOT_IMPORT or target.startswith(SAMPLE_MAY_NOT_IMPORT + ".")
    )


def test_the_sampler_does_not_import_the_scheduler_s_request_state():
    found = sample_violations(import_graph())
    assert not found, "replica.sample reads SamplingMetadata, not the scheduler's requests:\n" + "\n".join(found)


def test_every_router_package_has_a_layer():
    assert ROUTER.folders() == set(ROUTER_PACKAGES) - set(ROUTER_MODULE_LAYERS), "give each package of router/ a layer in ROUTER_PACKAGES"
    assert all((ROOT / "router" / f"{name}.py").is_file() for name in ROUTER_MODULE_LAYERS)


def router_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.split(".")[0] == "router"
        for target in targets
        if target.split(".")[0] == "replica"
        and target != "replica.serve"
        and not any(target == allowed or target.startswith(allowed + ".") for allowed in ROUTER_MAY_IMPORT)
    )


def test_the_router_imports_only_the_engine_s_protocol_config_and_serve_entry():
    found = router_violations(import_graph())
    assert not found, "the router reaches into the engine:\n" + "\n".join(found)


def private_imports(modules: dict[str, Path]) -> list[str]:
    """``from a.b import _name`` where ``a.b`` is not in the importer's own package."""
    found = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in modules:
                source_package = node.module if modules[node.module].name == "__init__.py" else node.module.rpartition(".")[0]
                for alias in node.names:
                    if alias.name.startswith("_") and source_package != package:
                        found.append(f"{module} imports {node.module}.{alias.name}")
    return sorted(found)


def test_no_module_imports_a_private_name_of_another_package():
    found = private_imports(product_modules())
    assert not found, "\n".join(found)


def test_the_boundary_checks_catch_violations(tmp_path):
    """Each check fails on a graph or a file that breaks its rule."""
    assert engine_layer_violations({"replica.core.scheduler": {"replica.worker.model_runner"}}) == [
        "replica.core.scheduler imports replica.worker.model_runner"
    ]
    assert engine_layer_violations({"replica.worker.model_runner": {"replica.core.scheduler"}}) == []
    assert engine_layer_violations({"replica.protocol.outputs": {"replica"}})  # the public names sit on top
    assert router_violations({"router.ingress": {"replica.engine.metrics", "replica.protocol.errors"}}) == [
        "router.ingress imports replica.engine.metrics"
    ]
    assert router_violations({"router.ingress": {"replica.serve.deployment"}})  # not the entry itself
    assert router_layer_violations({"router.request.preparation": {"router.dispatch.fanout", "router.config"}}) == [
        "router.request.preparation imports router.dispatch.fanout"
    ]
    assert router_layer_violations({"router.config": {"router.request.tool_templates"}})  # the settings sit lowest
    assert router_layer_violations({"router.response.responses": {"router.ingress"}})  # the app sits on top
    assert router_layer_violations({"router.ingress": {"router.response.responses", "router.config"}}) == []
    assert sample_violations({"replica.sample.sampler": {"replica.core.request", "replica.protocol.outputs"}}) == [
        "replica.sample.sampler imports replica.core.request"
    ]
    assert sample_violations({"replica.worker.sampling_batch": {"replica.core.request"}}) == []
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.py").write_text("_secret = 1\n")
    (tmp_path / "b" / "y.py").write_text("from a.x import _secret\n")
    (tmp_path / "a" / "z.py").write_text("from a.x import _secret\n")  # same package: allowed
    modules = {"a.x": tmp_path / "a" / "x.py", "b.y": tmp_path / "b" / "y.py", "a.z": tmp_path / "a" / "z.py"}
    assert private_imports(modules) == ["b.y imports a.x._secret"]
    (tmp_path / "c.py").write_text("def f():\n    import torch\n")
    assert external_imports(tmp_path / "c.py") == {"torch"}


def test_dependencies_point_down():
    upward = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if LAYER[target.split(".")[0]] > LAYER[module.split(".")[0]]
    ]
    assert not upward, "a lower layer imports a higher one:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_bench_package_has_a_layer():
    assert BENCH.folders() == set(BENCH_PACKAGES), "give each package of cluster/bench/ a layer in BENCH_PACKAGES"


def test_the_bench_layer_check_catches_violations():
    assert bench_layer_violations({"cluster.bench.workloads.base": {"cluster.bench.engine.runner"}}) == [
        "cluster.bench.workloads.base imports cluster.bench.engine.runner"
    ]
    assert bench_layer_violations({"cluster.bench.engine.offline": {"cluster.bench.serving.serve"}})
    assert bench_layer_violations({"cluster.bench.serving.serve": {"cluster.bench.options"}})  # the commands sit on top
    assert bench_layer_violations({"cluster.bench.serving.serve": {"cluster.bench"}})
    assert bench_layer_violations({
        "cluster.bench.serving.serve": {"cluster.bench.engine.spec_decode", "cluster.bench.workloads.base", "cluster.config"},
        "cluster.bench.engine.offline": {"cluster.bench.engine.runner", "replica.engine.llm_engine"},
        "cluster.bench.cli": {"cluster.bench.serving.serve", "cluster.bench.options"},
        "cluster.cli": {"cluster.bench.cli"},
    }) == []
