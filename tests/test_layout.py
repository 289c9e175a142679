"""Imports go one way: from the command line down to the utilities, never up and never sideways.

Each module of the package has a place in ``LAYERS``, top first; it may import only modules of the
layers below its own. A new module must be given a place here.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lit_imagenet"

LAYERS: list[tuple[str, set[str]]] = [
    ("the package's public names", {"__init__"}),
    ("command lines", {"cli", "export"}),
    ("callbacks", {"callbacks", "checkpointing", "guard", "monitoring"}),
    ("the LightningModule and the DataModule", {"module", "datamodule"}),
    ("their parts", {"backbone", "decoders", "metrics", "optim"}),
    ("prefetching", {"prefetch"}),
    ("datasets and batch decoding", {"dali", "datasets", "gpu_decode"}),
    ("decoding, folders and sample order", {"decoding", "folders", "samplers"}),
    ("presets", {"presets"}),
    ("utilities", {"ddp", "host", "models", "precision", "schedule", "synthetic"}),
    ("base", {"compat", "errors"}),
]
LAYER = {module: (index, name) for index, (name, modules) in enumerate(LAYERS) for module in modules}


def package_modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py"))


def package_imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports, at the top or inside functions, by their short names."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "lit_imagenet":  # from lit_imagenet import compat: the submodule, else __init__
                names = [
                    f"lit_imagenet.{a.name}"
                    if a.name in LAYER or (PACKAGE / f"{a.name}.py").is_file()
                    else "lit_imagenet"
                    for a in node.names
                ]
            else:
                names = [node.module]
        else:
            continue
        for name in names:
            if name == "lit_imagenet":
                found.add("__init__")
            elif name.startswith("lit_imagenet."):
                found.add(name.split(".")[1])
    return found


def test_every_module_has_a_layer() -> None:
    missing = [m for m in package_modules() if m not in LAYER]
    assert not missing, f"lit_imagenet/{missing[0]}.py has no place in LAYERS of {__file__}; add it to a layer"
    gone = sorted(set(LAYER) - set(package_modules()))
    assert not gone, f"LAYERS names modules that do not exist: {gone}"


@pytest.mark.parametrize("module", package_modules())
def test_imports_go_down(module: str) -> None:
    level, layer = LAYER[module]
    for imported in sorted(package_imports(module)):
        assert imported in LAYER, f"{module} imports lit_imagenet.{imported}, which has no place in LAYERS"
        their_level, their_layer = LAYER[imported]
        assert their_level > level, (
            f"lit_imagenet.{module} (layer {level}, {layer}) imports lit_imagenet.{imported} (layer {their_level}, "
            f"{their_layer}): a module may import only from the layers below its own"
        )


def test_the_checker_sees_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module importing a callback, as it once did, is refused; so is an import inside a function."""
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path)
    (tmp_path / "module.py").write_text(
        "from lit_imagenet.callbacks import PredictionWriter\n\ndef f():\n    from lit_imagenet import cli\n"
    )
    assert package_imports("module") == {"callbacks", "cli"}
    with pytest.raises(
        AssertionError, match=r"lit_imagenet.module \(layer 3.*imports lit_imagenet.callbacks \(layer 2"
    ):
        test_imports_go_down("module")
