"""The package's folders are its layers: imports go from the command line down, never up and never sideways.

``LAYERS`` lists them, top first: the package's public names, the command lines, ``callbacks/``,
``training/``, ``data/``, and the base (``compat``, ``errors``). A module may import
the modules of the layers below its own and, inside a folder, the other modules of that folder, as
long as no import loop closes there. A new top-level module or folder must be given a place here.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lit_imagenet"

LAYERS: list[tuple[str, set[str]]] = [
    ("the package's public names", {"__init__"}),
    ("command lines", {"cli", "export"}),
    ("callbacks", {"callbacks"}),
    ("training", {"training"}),
    ("data", {"data"}),
    ("base", {"compat", "errors"}),
]
LAYER = {top: (index, name) for index, (name, tops) in enumerate(LAYERS) for top in tops}
FOLDERS = {top for _, tops in LAYERS for top in tops if (PACKAGE / top).is_dir()}


def package_modules(package: Path | None = None) -> list[str]:
    """Every module of the package, dotted: ``cli``, ``data.dali.loader``; ``data`` stands for its ``__init__``."""
    package = PACKAGE if package is None else package
    names = []
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts) or "__init__")
    return sorted(names)


def _is_module(package: Path, dotted: str) -> bool:
    path = package.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _source(package: Path, module: str) -> Path:
    path = package.joinpath(*module.split(".")) if module != "__init__" else package
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def package_imports(module: str, package: Path | None = None) -> set[str]:
    """The package's modules that ``module`` imports, at the top or inside functions, dotted from the package."""
    package = PACKAGE if package is None else package
    tree = ast.parse(_source(package, module).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # from lit_imagenet.data import presets: the submodule when there is one, else the package itself
            names = [
                f"{node.module}.{a.name}" if _is_module(package, f"{node.module}.{a.name}".partition(".")[2]) else
                node.module for a in node.names
            ]  # fmt: skip
        else:
            continue
        for name in names:
            head, _, rest = name.partition(".")
            if head == "lit_imagenet":
                found.add(rest or "__init__")
    return found


def layer_of(module: str) -> tuple[int, str]:
    return LAYER[module.split(".")[0]]


def folder_of(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in FOLDERS else None


def test_every_module_has_a_layer() -> None:
    missing = sorted({m.split(".")[0] for m in package_modules()} - set(LAYER))
    assert not missing, f"lit_imagenet/{missing[0]} has no place in LAYERS of {__file__}; add it to a layer"
    gone = sorted(top for top in LAYER if not _is_module(PACKAGE, top) and top != "__init__")
    assert not gone, f"LAYERS names modules or folders that do not exist: {gone}"


@pytest.mark.parametrize("module", package_modules())
def test_imports_go_down(module: str) -> None:
    check_imports_go_down(module, PACKAGE)


def check_imports_go_down(module: str, package: Path) -> None:
    level, layer = layer_of(module)
    for imported in sorted(package_imports(module, package)):
        their_level, their_layer = layer_of(imported)
        same_folder = folder_of(module) is not None and folder_of(module) == folder_of(imported)
        assert their_level > level or same_folder, (
            f"lit_imagenet.{module} (layer {level}, {layer}) imports lit_imagenet.{imported} (layer {their_level}, "
            f"{their_layer}): a module may import only from the layers below its own, or from its own folder"
        )


def import_loops(package: Path) -> list[list[str]]:
    """The loops of imports between the modules of one folder, each as the modules it passes through."""
    graph = {m: {i for i in package_imports(m, package) if folder_of(i) and folder_of(i) == folder_of(m)}
             for m in package_modules(package) if folder_of(m)}  # fmt: skip
    loops, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            loops.append(path[path.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return loops


def test_no_import_loop_inside_a_folder() -> None:
    loops = import_loops(PACKAGE)
    assert not loops, f"these modules import each other in a loop: {' -> '.join(loops[0])}"


def test_the_checker_sees_an_upward_import_and_a_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training module importing a callback is refused, also inside a function; so is a loop in data/."""
    (tmp_path / "training").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "callbacks").mkdir()
    for folder in ("training", "data", "callbacks"):
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "training" / "module.py").write_text(
        "from lit_imagenet.callbacks import guard\n\ndef f():\n    from lit_imagenet import cli\n"
    )
    (tmp_path / "callbacks" / "guard.py").write_text("")
    (tmp_path / "cli.py").write_text("")
    assert package_imports("training.module", tmp_path) == {"callbacks.guard", "cli"}
    with pytest.raises(AssertionError, match=r"lit_imagenet.training.module \(layer 3.*imports lit_imagenet.callbacks"):
        check_imports_go_down("training.module", tmp_path)
    (tmp_path / "data" / "a.py").write_text("from lit_imagenet.data.b import x\n")
    (tmp_path / "data" / "b.py").write_text("from lit_imagenet.data import a\n")
    monkeypatch.setattr(f"{__name__}.FOLDERS", FOLDERS | {"data"})
    assert import_loops(tmp_path) == [["data.a", "data.b", "data.a"]]
