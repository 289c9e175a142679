"""A launch of ``train.py`` does not import the packages that torchmetrics loads for metrics this package never builds.

Lightning imports torchmetrics, and torchmetrics imports all of its metrics as it loads. Where the environment holds
transformers, its text and multimodal metrics import it then (``AutoModel``, ``CLIPModel``); where it holds scipy,
its package imports ``scipy.signal`` to patch it for a third-party audio package; and its plotting module imports
``matplotlib.pyplot``: seconds of every launch and every restart of every process, for metrics and plots that
training an image classifier does not use (this package draws its curves with matplotlib's figure module, not
pyplot, and only when it draws them).

``skip_unused_optional_imports()``, called by ``train.py`` before its imports, has torchmetrics find these packages
unavailable as it loads: its metrics that need transformers (``BERTScore``, ``InfoLM``, ``CLIPScore``,
``CLIPImageQualityAssessment``) are absent from that process, ``scipy.signal`` is not patched (scipy's other uses,
imported when a metric runs, are unchanged), and a metric's ``plot()`` raises an error that says how to have it.
``LIT_IMAGENET_LEAN_IMPORTS=0`` turns it off, for a run whose own callbacks or module use those metrics or plots.
Python code that imports the package (a notebook) is not affected.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

#: The environment variable that turns the skip off (``0``).
ENV_VAR = "LIT_IMAGENET_LEAN_IMPORTS"

#: torchmetrics' module that tells its other modules which optional packages are installed.
FLAGS_MODULE = "torchmetrics.utilities.imports"

#: torchmetrics' module of plots, whose error for a missing matplotlib is replaced by one that says why.
PLOT_MODULE = "torchmetrics.utilities.plot"

#: The packages that torchmetrics' package asks for (``package_available``) and imports as it loads, if found.
SKIPPED_AT_LOAD = ("scipy",)

#: torchmetrics' flags whose truth makes its modules import a package as they load, and that package.
SKIPPED_FLAGS = {
    "_TRANSFORMERS_AVAILABLE": "transformers",
    "_TRANSFORMERS_GREATER_EQUAL_4_4": "transformers",
    "_TRANSFORMERS_GREATER_EQUAL_4_10": "transformers",
    "_SCIPI_AVAILABLE": "scipy",  # (sic) only its audio metrics' patch of scipy.signal reads it
    "_MATPLOTLIB_AVAILABLE": "matplotlib",
}


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the skip is on: unless ``LIT_IMAGENET_LEAN_IMPORTS`` is ``0`` (or ``false``, ``no``, ``off``)."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "1")
    return value.strip().lower() not in {"0", "false", "no", "off"}


def skip_unused_optional_imports() -> bool:
    """Installs the skip for the torchmetrics import to come; whether it did.

    Nothing is installed when the skip is turned off or torchmetrics is already imported (its modules have read
    the flags by then).
    """
    if not enabled() or "torchmetrics" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _Finder())
    return True


def skipped_message(package: str, needed_for: str) -> str:
    """The one sentence that says why torchmetrics finds ``package`` unavailable, and how to have it."""
    return (
        f"{package} is installed, but train.py does not import it for torchmetrics ({needed_for}); "
        f"set {ENV_VAR}=0 to use the torchmetrics metrics and plots that need it."
    )


def mark_skipped(module: ModuleType) -> list[str]:
    """Sets ``SKIPPED_FLAGS`` false in torchmetrics' flags module where they are true; the names it set."""
    from lightning_utilities.core.imports import RequirementCache

    class Skipped(RequirementCache):
        """A requirement reported unavailable, whose message says why and how to have it."""

        def __init__(self, name: str, package: str) -> None:
            super().__init__(package)
            self.available = False
            self.message = skipped_message(package, name)
            self.skipped_package = package  # unlike a requirement found missing

    marked = []
    for name, package in SKIPPED_FLAGS.items():
        if getattr(module, name, False):
            setattr(module, name, Skipped(name, package))
            marked.append(name)
    return marked


def _run_without_scipy(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    """Runs torchmetrics' package with ``package_available`` answering no for ``SKIPPED_AT_LOAD``."""
    from lightning_utilities.core import imports

    available = imports.package_available

    def package_available(name: str) -> bool:
        return name not in SKIPPED_AT_LOAD and available(name)

    imports.package_available = package_available
    try:
        run(module)
    finally:
        imports.package_available = available
        if getattr(module, "package_available", None) is package_available:
            module.package_available = available


def _run_then_mark_flags(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    """Runs torchmetrics' flags module, then marks ``SKIPPED_FLAGS`` in it."""
    run(module)
    mark_skipped(module)


def _run_then_explain_plots(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    """Runs torchmetrics' plots module; where it found matplotlib skipped (not missing), its error for a plot says
    why."""
    run(module)
    flag = getattr(module, "_MATPLOTLIB_AVAILABLE", None)
    if getattr(flag, "skipped_package", None) == "matplotlib" and hasattr(module, "_error_on_missing_matplotlib"):

        def _error_on_missing_matplotlib() -> None:
            raise ModuleNotFoundError(skipped_message("matplotlib", "plot()"))

        module._error_on_missing_matplotlib = _error_on_missing_matplotlib


class _Finder(importlib.abc.MetaPathFinder):
    """Finds torchmetrics' package, flags and plots modules with the other finders; each runs through ``_Loader``."""

    def __init__(self) -> None:
        self.waiting = {
            "torchmetrics": _run_without_scipy,
            FLAGS_MODULE: _run_then_mark_flags,
            PLOT_MODULE: _run_then_explain_plots,
        }

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        how = self.waiting.pop(fullname, None)
        if how is None:
            return None
        if not self.waiting:
            sys.meta_path.remove(self)  # all found: torchmetrics is imported once per process
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None and finder is not self else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, how)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """Runs a module as ``how`` says, around its own loader's ``exec_module``; its other methods are that loader's."""

    def __init__(self, loader: Any, how: Callable[[Callable[[ModuleType], None], ModuleType], None]) -> None:
        self.loader = loader
        self.how = how

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.how(self.loader.exec_module, module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package
        return getattr(self.loader, name)
