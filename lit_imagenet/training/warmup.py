"""The GPU's start, made in a thread while ``train.py`` imports Lightning and the package.

A process's first use of a GPU creates its CUDA context and loads the cuBLAS and cuDNN libraries: a second or
more, which a run otherwise pays when Lightning sets the device up and at its first step, after its imports.
``start`` reads the run's ``--trainer.accelerator``, ``--trainer.devices`` and ``--trainer.strategy`` from the
command line and its ``--config`` files (as ``data.prescan`` reads the data options) and, where the run is sure to
train on this process's GPU, does that work in a thread meanwhile: on device ``LOCAL_RANK`` (else
``SLURM_LOCALID``, else 0), the device Lightning gives this process where ``--trainer.devices`` is a count.

No thread starts where the device is not certain or the GPU must not be touched before Lightning starts its
processes: an accelerator other than ``auto``, ``gpu`` or ``cuda``; devices given as a list; a strategy that starts
its processes with ``multiprocessing`` (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``: a forked process cannot use
CUDA that its parent initialised, and a spawning parent would hold a context on a GPU it does not train on), or one
given option by option or as a class, whose start method is not read here; a subcommand that does not run; no GPU;
``LIT_IMAGENET_WARMUP=0`` in the environment. The warm-up only saves time: an error in it is left for the run to
meet and report.

Where the run decodes with DALI (``--data.decoder dali``, or ``auto`` on one GPU of one node with DALI installed,
which ``auto`` then picks), the thread goes on to build DALI's decoder on that GPU (``data.dali_primer``), so that
the DALI loader's first pipeline finds it started; ``stop`` lets it go where the loader did not.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from lit_imagenet.data.prescan import section_options

#: Strategies whose launcher starts processes with ``multiprocessing`` (words in their registered names).
_MULTIPROCESSING = ("spawn", "fork", "notebook")


def _plain(value: Any) -> str | None:
    return None if value is None else str(value).strip().lower()


def warm_device(argv: list[str], environ: Mapping[str, str] | None = None) -> int | None:
    """The index of the GPU that the run of ``argv`` trains on in this process, where it is certain; else ``None``."""
    environ = os.environ if environ is None else environ
    if environ.get("LIT_IMAGENET_WARMUP", "1").strip() == "0":
        return None
    options = section_options(argv, "trainer", ("accelerator", "devices", "strategy"))
    if options is None:
        return None
    accelerator, devices, strategy = (options.get(key) for key in ("accelerator", "devices", "strategy"))
    if _plain(accelerator) not in (None, "auto", "gpu", "cuda", "null"):  # a mapping reads as none of them
        return None
    given = _plain(devices)
    if given is not None and given not in ("auto", "-1") and not (given.isdigit() and int(given) >= 1):
        return None  # a list of devices, "0,1", or no device
    if isinstance(strategy, dict):
        return None  # a strategy's class or options: how it starts processes is not read here
    if any(word in (_plain(strategy) or "") for word in _MULTIPROCESSING):
        return None
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if environ.get(name, "").strip().isdigit():
            return int(environ[name])
    return 0


def primes_dali(argv: list[str], gpus: int) -> bool:
    """Whether the run of ``argv``, warmed up on one of this machine's ``gpus`` GPUs, decodes with DALI there."""
    data = section_options(argv, "data", ("decoder",))
    trainer = section_options(argv, "trainer", ("devices", "num_nodes"))
    if data is None or trainer is None:
        return False
    decoder = _plain(data.get("decoder"))
    if decoder == "auto":
        devices, nodes = _plain(trainer.get("devices")), _plain(trainer.get("num_nodes"))
        count = gpus if devices in (None, "auto", "-1") else int(devices) if devices.isdigit() else 0
        if count * (int(nodes) if nodes is not None and nodes.isdigit() else 1) != 1:
            return False  # auto picks nvjpeg on several processes (data.datamodule.choose_decoder)
    elif decoder != "dali":
        return False
    from lit_imagenet.data import dali_primer

    return dali_primer.library_folder() is not None


def _warm(index: int, dali: bool) -> None:
    import torch

    try:
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)  # this thread's device: the context is made on it, not on device 0
        torch.nn.functional.conv2d(torch.ones(1, 3, 8, 8, device=device), torch.ones(4, 3, 3, 3, device=device))
        torch.mm(torch.ones(4, 4, device=device), torch.ones(4, 4, device=device))  # cuBLAS
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001  (the run meets it again, and says what it is)
        pass
    if dali:
        from lit_imagenet.data import dali_primer

        dali_primer.make(index)


def start(argv: list[str]) -> threading.Thread | None:
    """Starts the GPU's warm-up for the run of ``argv`` in a thread (see the module's text); ``None`` where none is
    started. Torch is imported first, in the calling thread, so that two threads never import it at once."""
    index = warm_device(argv)
    if index is None:
        return None
    import torch

    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    dali = primes_dali(argv, torch.cuda.device_count())
    if dali:
        from lit_imagenet.data import dali_primer

        dali_primer.expect()
    thread = threading.Thread(target=_warm, args=(index, dali), name="cuda-warmup", daemon=True)
    thread.start()
    return thread


def stop(thread: threading.Thread | None) -> None:
    """Waits for the warm-up's thread, if one started, so that the process never ends inside a CUDA call, and lets
    DALI's primer go if the loader did not."""
    if thread is not None:
        thread.join()
        from lit_imagenet.data import dali_primer

        dali_primer.release()
