"""DALI's image decoder, made ready in the warm-up thread at launch, before the DALI loader needs it.

A process's first DALI pipeline with a GPU decoder pays once for what every later one shares: DALI's libraries
loaded, nvImageCodec and its nvJPEG back-ends started on the device, DALI's memory pools made. On one H200 that
held the loader's first batch 2.3 s after the start of training, of which a pipeline built beforehand saved
1.35 s (docs/benchmarks.md). Built with DALI's Python package, the same primer cost the launch as much: importing
``nvidia.dali`` is about 0.8 s of Python work, which holds the interpreter that the launch's own imports need.

So the primer is built through DALI's C API alone (``dali/dali.h``, loaded with ``ctypes``): a pipeline of one
external input and one ``decoders.image`` operator on the device, built and never run. ``ctypes`` lets the
interpreter go during each call, and the libraries' files are read before they are loaded, since loading holds it.
DALI's Python package is imported later, where it always was, when the data module picks its decoder.

``expect`` (in the launching thread), then ``make`` (in the warm-up thread) build it; the loader's first pipeline
``settle`` s for it, then ``release`` s it, as does the end of the run. Any failure (no DALI, a DALI version other
than those in ``KNOWN_VERSIONS``, no such device) leaves no primer, and the loader builds as it would have without one.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import threading
from pathlib import Path

#: Seconds the loader waits for a primer still being made before it builds its pipeline regardless.
SETTLE_SECONDS = 60.0

_SUCCESS_CODES = (0, 1, 2)  # DALI_SUCCESS, DALI_NO_DATA, DALI_NOT_READY
_STORAGE_CPU, _STORAGE_GPU = 0, 1
_BACKEND_CPU, _BACKEND_MIXED = 0, 2
_UINT8 = 0  # DALI_UINT8
#: The DALI versions (major, minor) whose C API the structures below were written from (``dali/dali.h``). DALI's
#: C API is young and may change its structures' layout; another version's gets no primer rather than a misread one.
KNOWN_VERSIONS = ((2, 4),)
#: Loaded in this order: the operators' library registers the operators and needs the others; ``libdali.so``
#: holds the C API.
_LIBRARIES = ("libdali_core.so", "libdali_kernels.so", "libdali.so", "libdali_operators.so")


class _PipelineParams(ctypes.Structure):
    """``daliPipelineParams_t``: a word of ``*_present`` bits (bit 0 ``max_batch_size``, 1 ``num_threads``,
    2 ``device_id``), then the values; ``daliBool`` is one byte."""

    _fields_ = [
        ("present", ctypes.c_uint64),
        ("max_batch_size", ctypes.c_int),
        ("num_threads", ctypes.c_int),
        ("device_id", ctypes.c_int),
        ("seed", ctypes.c_int64),
        ("exec_type", ctypes.c_int),
        ("exec_flags", ctypes.c_int),
        ("prefetch_cpu", ctypes.c_int),
        ("prefetch_gpu", ctypes.c_int),
        ("enable_checkpointing", ctypes.c_uint8),
        ("enable_memory_stats", ctypes.c_uint8),
        ("bytes_per_sample_hint", ctypes.c_size_t),
    ]


class _PipelineIODesc(ctypes.Structure):
    """``daliPipelineIODesc_t``: bit 0 of ``present`` says ``dtype`` is given, bit 1 ``ndim``."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("device", ctypes.c_int),
        ("present", ctypes.c_uint),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("layout", ctypes.c_char_p),
    ]


class _IODesc(ctypes.Structure):
    """``daliIODesc_t``."""

    _fields_ = [("name", ctypes.c_char_p), ("device_type", ctypes.c_int)]


class _OperatorDesc(ctypes.Structure):
    """``daliOperatorDesc_t``; the primer's operator takes no arguments (``args`` and ``arg_inputs`` stay NULL)."""

    _fields_ = [
        ("schema_name", ctypes.c_char_p),
        ("instance_name", ctypes.c_char_p),
        ("backend", ctypes.c_int),
        ("num_inputs", ctypes.c_int),
        ("num_outputs", ctypes.c_int),
        ("num_args", ctypes.c_int),
        ("num_arg_inputs", ctypes.c_int),
        ("inputs", ctypes.POINTER(_IODesc)),
        ("outputs", ctypes.POINTER(_IODesc)),
        ("args", ctypes.c_void_p),
        ("arg_inputs", ctypes.c_void_p),
    ]


class _Failed(Exception):
    """A step of the primer's build did not succeed; the message says which and why."""


class _Primer:
    def __init__(self, api: ctypes.CDLL, handle: ctypes.c_void_p) -> None:
        self.api, self.handle = api, handle


_lock = threading.Lock()
_ready = threading.Event()  # set while no primer is being made
_ready.set()
_held: _Primer | None = None
_reason: str | None = None  # why the last attempt made none


def library_folder() -> Path | None:
    """The folder of DALI's libraries (that of the ``nvidia.dali`` package), found without importing the package;
    ``None`` where DALI is not installed."""
    try:
        spec = importlib.util.find_spec("nvidia.dali")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / "libdali.so").is_file() else None


def installed_version(folder: Path) -> str | None:
    """The version of the DALI package in ``folder``, read from its ``__init__.py`` without importing it; ``None``
    where that file does not say."""
    try:
        text = (folder / "__init__.py").read_text(errors="replace")
    except OSError:
        return None
    found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
    return found.group(1) if found else None


def _check_version(folder: Path) -> None:
    version = installed_version(folder)
    numbers = re.match(r"(\d+)\.(\d+)", version or "")
    if numbers is None or (int(numbers.group(1)), int(numbers.group(2))) not in KNOWN_VERSIONS:
        known = ", ".join(f"{major}.{minor}" for major, minor in KNOWN_VERSIONS)
        raise _Failed(f"NVIDIA DALI {version or 'of an unknown version'} in {folder}: the primer knows the C API of "
                      f"DALI {known} only")  # fmt: skip


def _read_ahead(path: Path, buffer: bytearray) -> None:
    """Reads ``path`` once, so that loading it finds it in memory: a read lets the interpreter go, a load does not."""
    with open(path, "rb", buffering=0) as file:
        while file.readinto(buffer):
            pass


def _load(folder: Path) -> ctypes.CDLL:
    buffer = bytearray(1 << 24)
    for name in _LIBRARIES:
        if (folder / name).is_file():
            _read_ahead(folder / name, buffer)
    del buffer
    api = None
    for name in _LIBRARIES:
        if (folder / name).is_file():
            library = ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)
            api = library if name == "libdali.so" else api
    assert api is not None  # library_folder checked that libdali.so is there
    for function in ("daliPipelineCreate", "daliPipelineAddExternalInput", "daliPipelineAddOperator",
                     "daliPipelineSetOutputs", "daliPipelineBuild", "daliPipelineDestroy"):  # fmt: skip
        getattr(api, function).restype = ctypes.c_int
    api.daliGetLastErrorMessage.restype = ctypes.c_char_p
    return api


def _check(api: ctypes.CDLL, code: int, step: str) -> None:
    if code not in _SUCCESS_CODES:
        message = api.daliGetLastErrorMessage()
        raise _Failed(f"{step}: {message.decode(errors='replace') if message else f'error {code:#x}'}")


def _build(api: ctypes.CDLL, device: int | None) -> ctypes.c_void_p:
    params = _PipelineParams(present=0b011, max_batch_size=1, num_threads=1)
    if device is not None:
        params.present |= 0b100
        params.device_id = device
    handle = ctypes.c_void_p()
    _check(api, api.daliPipelineCreate(ctypes.byref(handle), ctypes.byref(params)), "daliPipelineCreate")
    try:
        encoded = _PipelineIODesc(name=b"encoded", device=_STORAGE_CPU, present=0b11, dtype=_UINT8, ndim=1)
        _check(api, api.daliPipelineAddExternalInput(handle, ctypes.byref(encoded)), "daliPipelineAddExternalInput")
        storage = _STORAGE_CPU if device is None else _STORAGE_GPU
        inputs, outputs = _IODesc(b"encoded", _STORAGE_CPU), _IODesc(b"decoded", storage)
        decoder = _OperatorDesc(
            schema_name=b"decoders__Image", instance_name=b"primer_decoder",
            backend=_BACKEND_CPU if device is None else _BACKEND_MIXED, num_inputs=1, num_outputs=1,
            inputs=ctypes.pointer(inputs), outputs=ctypes.pointer(outputs),
        )  # fmt: skip
        _check(api, api.daliPipelineAddOperator(handle, ctypes.byref(decoder)), "daliPipelineAddOperator")
        out = _PipelineIODesc(name=b"decoded", device=storage)
        _check(api, api.daliPipelineSetOutputs(handle, 1, ctypes.byref(out)), "daliPipelineSetOutputs")
        _check(api, api.daliPipelineBuild(handle), "daliPipelineBuild")
    except _Failed:
        api.daliPipelineDestroy(handle)
        raise
    return handle


def expect() -> None:
    """Says that a primer is about to be made, so that ``settle`` waits for it; ``make`` must follow."""
    _ready.clear()


def make(device: int | None) -> bool:
    """Builds the primer on CUDA device ``device`` (``None``: DALI's CPU decoder) and holds it; whether it was made.

    Nothing is raised: where it cannot be made, ``reason`` says why and the DALI loader builds as it would have.
    """
    global _held, _reason
    try:
        folder = library_folder()
        if folder is None:
            raise _Failed("NVIDIA DALI is not installed")
        _check_version(folder)
        api = _load(folder)
        handle = _build(api, device)
        with _lock:
            previous, _held = _held, _Primer(api, handle)
        _reason = None
        if previous is not None:
            previous.api.daliPipelineDestroy(previous.handle)
        return True
    except Exception as error:  # noqa: BLE001  (another version's C API, a library that does not load: no primer)
        _reason = str(error) or type(error).__name__
        return False
    finally:
        _ready.set()


def settle(timeout: float = SETTLE_SECONDS) -> None:
    """Waits, at most ``timeout`` seconds, for a primer being made."""
    _ready.wait(timeout)


def held() -> bool:
    """Whether a primer is held."""
    return _held is not None


def reason() -> str | None:
    """Why the last ``make`` made no primer; ``None`` when it made one."""
    return _reason


def release() -> None:
    """Destroys the primer, if one is held: the decoder's buffers go, what it started in the process stays."""
    global _held
    with _lock:
        primer, _held = _held, None
    if primer is not None:
        primer.api.daliPipelineDestroy(primer.handle)
