"""DALI's decoder made ready at launch: through DALI's C API, without its Python package; waited for and let go."""

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import lit_imagenet.data.dali.loader as dali_loader
from lit_imagenet.data import dali_primer
from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.training import warmup

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("argv", "gpus", "installed", "primes"),
    [
        (["fit", "--config", "configs/resnet50.yaml"], 1, True, True),  # auto on one GPU picks dali
        (["fit", "--config", "configs/resnet50.yaml"], 1, False, False),  # ... unless DALI is missing
        (["fit", "--config", "configs/resnet50.yaml"], 8, True, True),  # devices: 1
        (["fit", "--config", "configs/resnet50.yaml", "--trainer.devices", "auto"], 8, True, False),  # nvjpeg's
        (["fit", "--config", "configs/resnet50.yaml", "--trainer.devices", "-1"], 1, True, True),
        (["fit", "--config", "configs/resnet50.yaml", "--trainer.num_nodes", "2", "--trainer.devices", "1"], 1, True,
         False),
        (["fit", "--config", "configs/resnet50.yaml", "--config", "configs/ddp.yaml"], 2, True, False),
        (["fit", "--data.decoder", "dali", "--trainer.devices", "8"], 8, True, True),  # named: on every process
        (["fit", "--data.decoder", "dali"], 1, False, False),
        (["fit", "--config", "configs/resnet50.yaml", "--data.decoder", "nvjpeg"], 1, True, False),
        (["fit", "--data", '{"decoder": "dali"}'], 1, True, True),
        (["fit"], 1, True, False),  # the data module's default decoder is pil
        (["fit", "--help"], 1, True, False),
    ],
)  # fmt: skip
def test_the_primer_is_made_only_where_the_run_decodes_with_dali(
    argv: list[str], gpus: int, installed: bool, primes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(dali_primer, "library_folder", lambda: Path("/dali") if installed else None)
    assert warmup.primes_dali(argv, gpus) is primes


def test_without_dali_no_primer_is_made_and_the_reason_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dali_primer, "library_folder", lambda: None)
    dali_primer.expect()
    assert dali_primer.make(0) is False and not dali_primer.held()
    assert dali_primer.reason() == "NVIDIA DALI is not installed"
    start = time.perf_counter()
    dali_primer.settle()
    assert time.perf_counter() - start < 1  # nothing is left to wait for


@pytest.mark.parametrize(
    ("init", "made"),
    [
        ("__version__ = '2.5.0'\n", "NVIDIA DALI 2.5.0"),
        ('__version__ = "1.52.0"\n', "NVIDIA DALI 1.52.0"),
        ("# no version here\n", "NVIDIA DALI of an unknown version"),
    ],
)
def test_a_dali_of_another_version_gets_no_primer_and_its_libraries_are_not_loaded(
    init: str, made: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The primer's structures are one DALI version's C API: another version's is not called with them."""
    (tmp_path / "__init__.py").write_text(init)
    (tmp_path / "libdali.so").write_bytes(b"not a library")  # loading it would fail with another reason
    monkeypatch.setattr(dali_primer, "library_folder", lambda: tmp_path)
    dali_primer.expect()
    assert dali_primer.make(0) is False and not dali_primer.held()
    assert dali_primer.reason() == f"{made} in {tmp_path}: the primer knows the C API of DALI 2.4 only"
    start = time.perf_counter()
    dali_primer.settle()
    assert time.perf_counter() - start < 1


@pytest.mark.dali
def test_the_installed_dalis_version_is_read_without_importing_it() -> None:
    out = _run(
        """
        import sys
        from lit_imagenet.data import dali_primer
        print(dali_primer.installed_version(dali_primer.library_folder()), "nvidia.dali" in sys.modules)
        import nvidia.dali
        print(nvidia.dali.__version__)
        """
    )
    assert out[1] == "False" and out[0] == out[2]


def _run(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.dali
def test_a_primer_is_built_through_the_c_api_without_importing_dalis_python_package() -> None:
    """DALI's C API alone: ``nvidia.dali`` is not imported, and a pipeline made with it afterwards decodes."""
    out = _run(
        """
        import io, sys
        import numpy as np
        from PIL import Image
        from lit_imagenet.data import dali_primer
        print(dali_primer.make(None), dali_primer.reason(), dali_primer.held(), "nvidia.dali" in sys.modules)
        import nvidia.dali.fn as fn, nvidia.dali.types as types
        from nvidia.dali import pipeline_def

        @pipeline_def(batch_size=2, num_threads=1, device_id=None)
        def decode():
            return fn.decoders.image(fn.external_source(name="encoded", dtype=types.UINT8), device="cpu")

        encoded = io.BytesIO()
        Image.new("RGB", (20, 10), (255, 0, 0)).save(encoded, "JPEG")
        pipe = decode()
        pipe.build()
        pipe.feed_input("encoded", [np.frombuffer(encoded.getvalue(), np.uint8)] * 2)
        image = np.array(pipe.run()[0].at(1))
        dali_primer.release()
        print(image.shape, int(image[..., 0].mean() > 240), dali_primer.held())
        """
    )
    assert out == ["True", "None", "True", "False", "(10,", "20,", "3)", "1", "False"]


@pytest.mark.dali
def test_a_device_that_does_not_exist_gives_no_primer_and_names_the_failed_call() -> None:
    out = _run(
        """
        from lit_imagenet.data import dali_primer
        dali_primer.expect()
        print(dali_primer.make(64), dali_primer.held(), dali_primer.reason().split(":")[0])
        dali_primer.settle(timeout=0)
        """
    )
    assert out == ["False", "False", "daliPipelineCreate"]


@pytest.mark.dali
def test_the_loaders_first_pipeline_waits_for_a_primer_being_made_then_lets_it_go(
    shapes_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The primer comes from the warm-up thread while the run starts; the loader's first build waits for it, so that
    the two do not start DALI's decoder twice at once, and destroys it once built."""
    held_at_build: list[bool] = []
    build = dali_loader.build_pipeline

    def recorded(**kwargs):
        held_at_build.append(dali_primer.held())
        return build(**kwargs)

    monkeypatch.setattr(dali_loader, "build_pipeline", recorded)
    loader = ImageFolderDataModule(
        str(shapes_root), batch_size=6, workers=2, crop_size=32, val_resize=36, decoder="dali", seed=3
    ).train_dataloader()
    dali_primer.expect()
    late = threading.Thread(target=lambda: (time.sleep(0.5), dali_primer.make(None)))
    late.start()
    try:
        images, _ = next(iter(loader))
    finally:
        late.join()
        dali_primer.release()
    assert images.shape == (6, 3, 32, 32)
    assert held_at_build[0] is True
    assert not dali_primer.held()  # let go once the first pipeline was built


@pytest.mark.gpu
@pytest.mark.dali
def test_the_warm_up_makes_the_primer_on_the_gpu_before_dali_is_imported_and_the_end_lets_it_go() -> None:
    out = _run(
        """
        import sys
        from lit_imagenet.data import dali_primer
        from lit_imagenet.training import warmup
        thread = warmup.start(["fit", "--config", "configs/resnet50.yaml", "--trainer.devices", "1"])
        thread.join()
        print(dali_primer.held(), "nvidia.dali" in sys.modules, dali_primer.reason())
        warmup.stop(thread)
        print(dali_primer.held())
        """
    )
    assert out == ["True", "False", "None", "False"]
