"""``train.py`` does not import transformers, scipy and pyplot for torchmetrics' text, multimodal and audio metrics
and its plots."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from lit_imagenet import lean_imports

REPO = Path(__file__).resolve().parents[1]

# Stand-ins for the two packages, installed with their metadata, as torchmetrics finds packages: any name imported
# from them is a class, and scipy.signal has the function torchmetrics looks for.
STAND_IN = """def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})
"""

# train.py --help, in a process that says at its exit which modules it imported and what torchmetrics offers.
LAUNCH = """
import atexit, json, runpy, sys

def report():
    imported = ["torchmetrics", "transformers", "scipy.signal", "matplotlib.pyplot"]
    imported = {name: name in sys.modules for name in imported}
    text = sys.modules.get("torchmetrics.text")
    flags = sys.modules.get("torchmetrics.utilities.imports")
    flag = getattr(flags, "_TRANSFORMERS_GREATER_EQUAL_4_4", None)
    import torch, torchmetrics
    metric = torchmetrics.MeanMetric()
    metric.update(torch.tensor(1.0))
    try:
        plot = type(metric.plot()[0]).__name__
    except ModuleNotFoundError as error:
        plot = str(error)
    print("REPORT " + json.dumps({
        "imported": imported,
        "bert_score": text is not None and hasattr(text, "BERTScore"),
        "flag": None if flag is None else [bool(flag), getattr(flag, "message", None)],
        "plot": plot,
    }))

atexit.register(report)
sys.argv = ["train.py", "--help"]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    for package, version in (("transformers", "5.0.0"), ("scipy", "1.17.0")):
        (root / package).mkdir()
        (root / package / "__init__.py").write_text(STAND_IN)
        info = root / f"{package}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    (root / "scipy" / "signal").mkdir()
    (root / "scipy" / "signal" / "__init__.py").write_text("def hamming(*args, **kwargs):\n    return None\n")
    return root


def _launches(site: Path, settings: list[str | None]) -> list[dict]:
    """``LAUNCH`` once per setting of ``LIT_IMAGENET_LEAN_IMPORTS`` (None: unset), side by side; their reports."""
    runs = []
    for setting in settings:
        env = {k: v for k, v in os.environ.items() if k != lean_imports.ENV_VAR}
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        if setting is not None:
            env[lean_imports.ENV_VAR] = setting
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", LAUNCH],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        )
    reports = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        (line,) = [line for line in out.splitlines() if line.startswith("REPORT ")]
        reports.append(json.loads(line.removeprefix("REPORT ")))
    return reports


def test_train_py_leaves_out_transformers_scipy_and_pyplot_unless_turned_off(stand_ins: Path) -> None:
    """transformers and scipy are stand-ins; matplotlib is a requirement of the package, so the real one."""
    lean, full = _launches(stand_ins, [None, "0"])
    assert lean["imported"] == {
        "torchmetrics": True,
        "transformers": False,
        "scipy.signal": False,
        "matplotlib.pyplot": False,
    }
    assert lean["bert_score"] is False
    assert lean["flag"] == [
        False,
        "transformers is installed, but train.py does not import it for torchmetrics "
        "(_TRANSFORMERS_GREATER_EQUAL_4_4); set LIT_IMAGENET_LEAN_IMPORTS=0 to use the torchmetrics metrics and "
        "plots that need it.",
    ]
    assert lean["plot"] == (
        "matplotlib is installed, but train.py does not import it for torchmetrics (plot()); set "
        "LIT_IMAGENET_LEAN_IMPORTS=0 to use the torchmetrics metrics and plots that need it."
    )
    # Turned off, torchmetrics imports the stand-ins and pyplot as it loads, as it does with the packages themselves.
    assert full["imported"] == {
        "torchmetrics": True,
        "transformers": True,
        "scipy.signal": True,
        "matplotlib.pyplot": True,
    }
    assert full["bert_score"] is True and full["flag"][0] is True and full["plot"] == "Figure"


@pytest.mark.parametrize(
    ("value", "expected"), [(None, True), ("1", True), ("0", False), ("false", False), (" OFF ", False), ("no", False)]
)
def test_the_environment_variable_turns_it_off(value: str | None, expected: bool) -> None:
    assert lean_imports.enabled({} if value is None else {lean_imports.ENV_VAR: value}) is expected


def test_nothing_is_installed_once_torchmetrics_is_imported() -> None:
    import torchmetrics  # noqa: F401  (the test process has it imported already)

    before = list(sys.meta_path)
    assert lean_imports.skip_unused_optional_imports() is False
    assert sys.meta_path == before


def test_the_flags_it_marks_are_torchmetrics_own() -> None:
    """An upgrade of torchmetrics that renames them would leave the imports in, silently."""
    from torchmetrics.utilities import imports

    assert [name for name in lean_imports.SKIPPED_FLAGS if not hasattr(imports, name)] == []
    source = Path(sys.modules["torchmetrics"].__file__).read_text()
    assert 'package_available("scipy")' in source
    from torchmetrics.utilities import plot

    assert callable(plot._error_on_missing_matplotlib)


def test_a_plot_without_matplotlib_installed_keeps_torchmetrics_own_error() -> None:
    """Only a skipped matplotlib gets the error that names the variable; a missing one keeps the advice to install."""
    from lightning_utilities.core.imports import RequirementCache

    def own_error() -> None:
        raise ModuleNotFoundError("install matplotlib")

    missing = types.ModuleType("plots")
    missing._MATPLOTLIB_AVAILABLE = RequirementCache("no_such_package_here")
    missing._error_on_missing_matplotlib = own_error
    lean_imports._run_then_explain_plots(lambda module: None, missing)
    assert missing._error_on_missing_matplotlib is own_error

    skipped = types.ModuleType("imports")
    skipped._MATPLOTLIB_AVAILABLE = True
    lean_imports.mark_skipped(skipped)
    plots = types.ModuleType("plots")
    plots._MATPLOTLIB_AVAILABLE = skipped._MATPLOTLIB_AVAILABLE
    plots._error_on_missing_matplotlib = own_error
    lean_imports._run_then_explain_plots(lambda module: None, plots)
    with pytest.raises(ModuleNotFoundError, match="set LIT_IMAGENET_LEAN_IMPORTS=0"):
        plots._error_on_missing_matplotlib()
