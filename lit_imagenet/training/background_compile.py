"""The network compiled by a process of its own while the run trains eagerly (``--model.compile background``).

torch.compile's first call compiles every graph of the network, which with empty caches takes far longer
than any eager step, and the run would wait for it before its first step. Here the run instead starts this
file as a script in a child process after its first (eager) step, handing it what decides the compiled code:

- the network's structure, pickled with its parameters and buffers on the ``meta`` device (their shapes,
  strides, dtypes and ``requires_grad``, not their values) and its modules' training flags;
- the first step's input to the network (shape, strides, dtype) and the autocast it ran under;
- the torch flags that change compiled code (float32 matmul precision, TF32, determinism), set in the
  child only where they differ from its own.

It compiles with a quarter of the cores' compile workers (``compile_threads``; ``TORCHINDUCTOR_COMPILE_THREADS``
sets another number) at a lower CPU priority, so that the loader keeps its cores and the run's host memory grows
by fewer processes.

The child imports torch and torchvision only, compiles the network with ``compile_network`` as the run
will, runs one training step (forward and backward) on random data of that input's form, and exits: its
compiler caches (``TORCHINDUCTOR_CACHE_DIR``, which the run has set) now hold the graphs. The run looks at
the child at each step start; once it has ended, the run compiles its own network with ``compile_network``,
and inductor finds the graphs in the caches instead of compiling them again. The child runs at a lower CPU
priority, ends with its parent (``PR_SET_PDEATHSIG`` on Linux, set before its imports), and writes what it
did to ``result.json`` and ``compile.log`` in its folder.

This module imports nothing of the package and no Lightning: the child runs it by path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the child: its own folder off sys.path, where training/'s modules would shadow others
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

# Flags of torch that change the code it compiles, by dotted path under ``torch``, in the order the child sets them:
# the TF32 switches of torch's first API, which also move its newer ``fp32_precision`` settings, then those, each
# above the ones it holds. A run may have used either API, and once the newer one is used the first one's getters
# raise: a flag that cannot be read is left out.
_FLAGS = (
    "get_float32_matmul_precision",
    "backends.cuda.matmul.allow_tf32",
    "backends.cudnn.allow_tf32",
    "backends.fp32_precision",
    "backends.cuda.matmul.fp32_precision",
    "backends.cudnn.fp32_precision",
    "backends.cudnn.conv.fp32_precision",
    "backends.cudnn.rnn.fp32_precision",
    "backends.mkldnn.fp32_precision",
    "backends.mkldnn.matmul.fp32_precision",
    "backends.mkldnn.conv.fp32_precision",
    "backends.mkldnn.rnn.fp32_precision",
    "backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
    "backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
    "backends.cudnn.deterministic",
    "backends.cudnn.benchmark",
    "backends.cudnn.enabled",
    "are_deterministic_algorithms_enabled",
    "is_deterministic_algorithms_warn_only_enabled",
)
_RESULT = "result.json"
_LOG = "compile.log"
_SPEC = "network.pt"
_HEAD = "child.json"  # what the child reads before it imports torch


def compile_threads() -> int:
    """The child's compile workers, where the user did not set ``TORCHINDUCTOR_COMPILE_THREADS``: a quarter of the
    cores this process may use, 1 to 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // 4))


def compile_network(network: Any) -> Any:
    """The network compiled as the run and its child both compile it: static shapes, inductor's default mode."""
    import torch

    return torch.compile(network, dynamic=False)


def _read_flag(name: str) -> Any:
    owner, _, attr = f"torch.{name}".rpartition(".")
    value = getattr(_resolve(owner), attr)
    return value() if callable(value) else value


def torch_flags() -> dict[str, Any]:
    """The flags that change compiled code, by name; those this torch lacks or cannot read are left out."""
    flags: dict[str, Any] = {}
    for name in _FLAGS:
        try:
            flags[name] = _read_flag(name)
        except (AttributeError, RuntimeError):
            continue
    return flags


def _resolve(dotted: str) -> Any:
    import torch

    obj: Any = torch
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def set_torch_flags(flags: dict[str, Any]) -> list[str]:
    """Sets, in ``_FLAGS``' order, each flag whose value differs from ``flags``; returns the names of those set.

    Setting a flag to the value it has is not a no-op: torch's float32 precision settings then read ``ieee``
    instead of ``none``, and inductor's cache keys differ.
    """
    import torch

    changed = []
    for name in [n for n in _FLAGS if n in flags]:
        value = flags[name]
        try:
            if _read_flag(name) == value:
                continue
        except RuntimeError:  # the two APIs mixed: set it
            pass
        if name == "get_float32_matmul_precision":
            torch.set_float32_matmul_precision(value)
        elif name in ("are_deterministic_algorithms_enabled", "is_deterministic_algorithms_warn_only_enabled"):
            torch.use_deterministic_algorithms(
                flags.get("are_deterministic_algorithms_enabled", False),
                warn_only=flags.get("is_deterministic_algorithms_warn_only_enabled", False),
            )
        else:
            owner, _, attr = f"torch.{name}".rpartition(".")
            setattr(_resolve(owner), attr, value)
        changed.append(name)
    return changed


def _meta_copy(network: Any) -> Any:
    """A copy of ``network`` whose parameters and buffers are on the meta device, with their strides and flags."""
    import copy

    import torch

    memo: dict[int, Any] = {}
    for tensor in [*network.parameters(), *network.buffers()]:
        meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        if isinstance(tensor, torch.nn.Parameter):
            meta = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return copy.deepcopy(network, memo)


def _tensor_forms(network: Any) -> dict[str, list[Any]]:
    named = [*network.named_parameters(remove_duplicate=False), *network.named_buffers(remove_duplicate=False)]
    return {name: [list(t.shape), list(t.stride()), str(t.dtype), bool(t.requires_grad)] for name, t in named}


def input_form(images: Any) -> dict[str, Any]:
    """What the child needs of a batch the network took: shape, strides, dtype, and the autocast around it."""
    import torch

    device_type = images.device.type
    return {
        "shape": list(images.shape),
        "stride": list(images.stride()),
        "dtype": str(images.dtype).removeprefix("torch."),
        "device": str(images.device),
        "autocast": torch.is_autocast_enabled(device_type),
        "autocast_dtype": str(torch.get_autocast_dtype(device_type)).removeprefix("torch."),
        "autocast_cache": torch.is_autocast_cache_enabled(),  # Lightning's autocast turns it off
    }


class BackgroundCompile:
    """A child process that compiles ``network`` for batches of ``form`` (``input_form``) into ``folder``'s caches.

    Args:
        network: The network as the run will compile it (its device, memory format, dtypes and training flags).
        form: ``input_form`` of a training batch the network took.
        folder: Where the child writes its spec, log and result; created.
        cache_dir: inductor's cache folder, shared with the run (``TORCHINDUCTOR_CACHE_DIR``).
        nice: How much lower the child's CPU priority is than the run's.
    """

    def __init__(self, network: Any, form: dict[str, Any], folder: str | Path, cache_dir: str, nice: int = 10) -> None:
        import torch

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for name in (_RESULT, _LOG, _HEAD):
            (self.folder / name).unlink(missing_ok=True)
        self.form = form
        spec = {
            "network": _meta_copy(network),
            "tensors": _tensor_forms(network),
            "eval_modules": [name for name, m in network.named_modules() if not m.training],
            "input": form,
            "flags": torch_flags(),
        }
        torch.save(spec, self.folder / _SPEC)
        (self.folder / _HEAD).write_text(json.dumps({"parent": os.getpid(), "nice": nice}))
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1"}
        # Fewer compile workers than inductor's one per core: each is a process that the run's host memory counts,
        # and the cores are the loader's first. A value the user set is kept.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(compile_threads()))
        self.started = time.perf_counter()
        with open(self.folder / _LOG, "wb") as log:
            # A session of its own: stop() ends the child and inductor's compile workers it started, together.
            self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(self.folder)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        self.pid = self._process.pid
        self.seconds: float | None = None

    @property
    def log(self) -> Path:
        """The child's output."""
        return self.folder / _LOG

    def done(self) -> bool:
        """Whether the child has ended (without waiting for it)."""
        if self._process is None:
            return True
        if self._process.poll() is None:
            return False
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.started
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Waits for the child to end."""
        if self._process is not None:
            self._process.wait(timeout)
            self.done()

    def result(self) -> dict[str, Any]:
        """What the ended child wrote: ``ok`` and ``seconds``, and ``error`` where it failed."""
        try:
            result = json.loads((self.folder / _RESULT).read_text())
        except (OSError, ValueError):
            code = self._process.returncode if self._process is not None else None
            result = {"ok": False, "error": f"it exited with status {code} and no result"}
        return result

    def stop(self) -> None:
        """Ends the child and its compile workers, if they run."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        import signal

        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


class CompileSwitch:
    """A network that trains eagerly until a ``BackgroundCompile`` has filled the caches, then compiled.

    ``network_for`` gives the network to call for a batch: the compiled one once switched, for batches of the
    form the child compiled (the first training batch's: shape, strides, dtype), in training; the eager one for
    any other batch (an epoch's short last one, evaluation), which would otherwise compile graphs of its own.
    The run calls ``launch`` after a training step, ``poll`` before each, and ``stop`` when it ends.

    Args:
        folder: The child's folder (``BackgroundCompile``).
        cache_dir: inductor's cache folder.
        in_process: Compile in the run's process at the next step, without a child.
    """

    def __init__(self, folder: str | Path, cache_dir: str, in_process: bool = False) -> None:
        self.folder = Path(folder)
        self.cache_dir = cache_dir
        self.in_process = in_process
        self.form: dict[str, Any] | None = None
        self.child: BackgroundCompile | None = None
        self.compiled: Any = None
        self.failed: str | None = None  # why the run stays eager

    @property
    def waiting(self) -> bool:
        """No child yet, nor a decision: ``launch`` has something to do."""
        return self.child is None and self.compiled is None and self.failed is None and not self.in_process

    def network_for(self, images: Any, network: Any) -> Any:
        """The network to call for training batch ``images``; the first such batch's form is kept for ``launch``.

        A batch larger than that form's (the first batch of a run resumed at an epoch's short last batch) starts
        over, eager, with its own form: the compiled network would otherwise serve that last batch alone.
        """
        import torch

        if torch.is_grad_enabled() and (self.form is None or _larger(images, self.form)):
            self.stop()
            self.child, self.compiled, self.failed, self.in_process = None, None, None, False
            self.form = input_form(images)
        if self.compiled is not None and _same_form(images, self.form):
            return self.compiled
        return network

    def launch(self, network: Any, free_memory: int | None = None, needed_memory: int | None = None) -> str | None:
        """Starts the child for ``network`` once a training batch has been seen; returns a line to log, if any.

        ``free_memory`` and ``needed_memory`` (bytes, the device's): where less is free than a second copy of the
        step needs, the network is compiled in the run's process at the next step instead.
        """
        if not self.waiting or self.form is None:
            return None
        if free_memory is not None and needed_memory is not None and free_memory < needed_memory:
            self.in_process = True
            return (
                f"Compile: default (too little free memory on {self.form['device']} for a background compile: "
                f"{free_memory / 2**30:.1f} GiB free, {needed_memory / 2**30:.1f} GiB needed); the network compiles in "
                "this process at the next step."
            )
        try:
            self.child = BackgroundCompile(network, self.form, self.folder, self.cache_dir)
        except Exception as err:  # noqa: BLE001  (a network that cannot be pickled, a folder that cannot be written)
            self.failed = f"the background compile could not start: {type(err).__name__}: {err}"
            return f"Compile: eager ({self.failed})."
        shape = "x".join(str(n) for n in self.form["shape"])
        return f"Compile: a background process compiles the network for batches of {shape} (log: {self.child.log})."

    def poll(self, network: Any) -> bool:
        """Switches to the compiled network where the child has ended well (or ``in_process``); whether it did now.

        A child that failed leaves the run eager, with ``failed`` saying why.
        """
        if self.compiled is not None or self.failed is not None:
            return False
        if not self.in_process:
            if self.child is None or not self.child.done():
                return False
            result = self.child.result()
            if not result.get("ok"):
                self.failed = f"the background compile failed ({result.get('error')}; its log: {self.child.log})"
                return False
        self.compiled = compile_network(network)
        return True

    def stop(self) -> None:
        """Ends a child still compiling; the next ``launch`` starts another."""
        if self.child is not None:
            self.child.stop()
            if self.compiled is None and self.failed is None:
                self.child = None


def _same_form(images: Any, form: dict[str, Any] | None) -> bool:
    return (
        form is not None
        and list(images.shape) == form["shape"]
        and list(images.stride()) == form["stride"]
        and str(images.dtype).removeprefix("torch.") == form["dtype"]
    )


def _larger(images: Any, form: dict[str, Any]) -> bool:
    return images.shape[0] > form["shape"][0] and list(images.shape[1:]) == form["shape"][1:]


def _die_with_parent(parent: int) -> None:
    """Has the kernel end this process when its parent ends (Linux); exits now if the parent already has."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(1)


def _child(folder: Path) -> dict[str, Any]:
    import torch

    spec = torch.load(folder / _SPEC, weights_only=False)
    changed = set_torch_flags(spec["flags"])
    form = spec["input"]
    device = torch.device(form["device"])
    network = spec["network"].to_empty(device=device)
    with torch.no_grad():
        for tensor in [*network.parameters(), *network.buffers()]:
            if tensor.is_floating_point():
                tensor.uniform_(0.5, 1.0)
            else:
                tensor.zero_()
    forms = _tensor_forms(network)
    for name, expected in spec["tensors"].items():
        if forms.get(name) != expected:
            raise RuntimeError(f"{name} came out as {forms.get(name)} (shape, stride, dtype, grad), not {expected}")
    eval_modules = [name for name, m in network.named_modules() if not m.training]
    if eval_modules != spec["eval_modules"]:
        raise RuntimeError(f"modules in evaluation mode differ: {eval_modules} against {spec['eval_modules']}")
    dtype = getattr(torch, form["dtype"])
    images = torch.empty_strided(form["shape"], form["stride"], dtype=dtype, device=device)
    images.uniform_(-2.0, 2.0) if images.is_floating_point() else images.random_(0, 256)
    compiled = compile_network(network)
    autocast = torch.autocast(device.type, dtype=getattr(torch, form["autocast_dtype"]), enabled=form["autocast"],
                              cache_enabled=form["autocast_cache"])  # fmt: skip
    with autocast:
        out = compiled(images)
        if not isinstance(out, torch.Tensor):  # GoogLeNet and Inception return auxiliary logits in training
            out = out[0]
        loss = out.float().sum()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"ok": True, "flags_set": sorted(changed)}


def main(folder: str) -> int:
    path = Path(folder)
    started = time.perf_counter()
    try:
        spec_head = _peek_spec(path)
        _die_with_parent(spec_head["parent"])
        os.nice(spec_head["nice"])
        result = _child(path)
        code = 0
    except Exception as err:  # noqa: BLE001  (whatever stops it is written down for the run to name)
        import traceback

        traceback.print_exc()
        result, code = {"ok": False, "error": f"{type(err).__name__}: {err}"}, 1
    result["seconds"] = round(time.perf_counter() - started, 2)
    tmp = path / (_RESULT + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path / _RESULT)
    print(json.dumps(result), flush=True)
    return code


def _peek_spec(folder: Path) -> dict[str, Any]:
    """The run's process id and the child's priority, read before torch is imported."""
    return json.loads((folder / _HEAD).read_text())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
