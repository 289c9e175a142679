"""The scan that ``train.py`` starts at launch: what it reads from the command line, the index it leaves, its errors."""

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lit_imagenet.data import folders, prescan
from lit_imagenet.data.index import index_path, read_index, write_index
from lit_imagenet.errors import DataError
from tests.test_index import _age, _counting_scans, _module, _tree

REPO = Path(__file__).resolve().parents[1]


def test_the_data_options_come_from_the_configs_in_turn_then_the_flags(tmp_path: Path) -> None:
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "other" / "train").mkdir(parents=True)
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(f"data:\n  root: {tmp_path / 'other'}\n  index_dir: {tmp_path / 'idx'}\n")
    second.write_text(f"data:\n  root: {tmp_path / 'data'}\nmodel:\n  arch: resnet18\n")
    config = ["--config", str(first), f"--config={second}"]
    assert prescan.target(["fit", *config]) == (tmp_path / "data", tmp_path / "idx")
    assert prescan.target(["fit", *config, "--data.root", str(tmp_path / "other")]) == (
        tmp_path / "other",
        tmp_path / "idx",
    )
    assert prescan.target(["validate", *config, f"--data.index_dir={tmp_path / 'x'}"]) == (
        tmp_path / "data",
        tmp_path / "x",
    )
    assert prescan.target(["fit", "--trainer.max_epochs", "1", "--data.root", str(tmp_path / "data")])[0] == (
        tmp_path / "data"
    )


def test_the_index_folder_is_the_data_modules_default_where_none_is_given(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "data" / "train").mkdir(parents=True)
    monkeypatch.setenv("LIT_IMAGENET_CACHE", str(tmp_path / "cache"))
    assert prescan.target(["fit", "--data.root", str(tmp_path / "data")]) == (
        tmp_path / "data",
        tmp_path / "cache" / "index",
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["fit", "--data.index", "false"],  # no index: the data module scans every time
        ["fit", "--help"],  # the command does not run
        ["fit", "--print_config"],
        ["--help"],
        [],  # no subcommand
        ["fit"],  # no root given (the parser then says so)
    ],
)
def test_nothing_is_scanned_early_where_the_run_would_not_use_an_index(tmp_path: Path, argv: list[str]) -> None:
    (tmp_path / "data" / "train").mkdir(parents=True)
    root = ["--data.root", str(tmp_path / "data")] if argv and argv[0] == "fit" and len(argv) > 1 else []
    assert prescan.target([*argv[:1], *root, *argv[1:]]) is None
    assert prescan.start([*argv[:1], *root, *argv[1:]]) is None


def test_a_root_without_a_train_folder_and_a_later_process_of_a_node_start_nothing(tmp_path: Path, monkeypatch) -> None:
    _tree(tmp_path / "data")
    assert prescan.target(["fit", "--data.root", str(tmp_path / "missing")]) is None
    argv = ["fit", "--data.root", str(tmp_path / "data"), "--data.index_dir", str(tmp_path / "index")]
    for variable in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.setenv(variable, "1")
        assert prescan.start(argv) is None
        monkeypatch.delenv(variable)


def test_the_early_scan_leaves_the_index_that_the_data_module_reads_without_walking_the_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, index = _tree(tmp_path / "data"), tmp_path / "index"
    scan = prescan.start(["fit", "--data.root", str(root), "--data.index_dir", str(index)])
    assert scan is not None
    assert scan.wait(timeout=120) == 0
    for split in ("train", "val"):
        assert len(read_index(index_path(index, root / split), root / split).samples) == 12
    scanned = _counting_scans(monkeypatch)
    dm = _module(root, index)
    assert scanned == [] and dm.classes == ["class0", "class1", "class2"] and len(dm.samples("train")) == 12
    prescan.stop(scan)


def _big_tree(root: Path, classes: int, per_class: int) -> Path:
    """``classes`` class folders of ``per_class`` hard links to one small JPEG in train/ (one each in val/),
    aged: a tree whose scan takes a while."""
    source = _tree(root / "source", classes=1, per_class=1) / "train" / "class0" / "img0.jpg"
    for split, count in (("train", per_class), ("val", 1)):
        for c in range(classes):
            folder = root / "data" / split / f"c{c:04d}"
            folder.mkdir(parents=True)
            for i in range(count):
                os.link(source, folder / f"{i}.jpg")
    _age(root / "data")
    return root / "data"


def _held_by(scan: subprocess.Popen, lock: Path, timeout: float = 60) -> bool:
    """Waits until another process holds ``lock`` (True), or ``scan`` ends first (False)."""
    deadline = time.monotonic() + timeout
    while scan.poll() is None and time.monotonic() < deadline:
        if lock.exists():
            with lock.open("ab") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return True
                fcntl.flock(f, fcntl.LOCK_UN)
        time.sleep(0.001)
    return False


def _train_lock(index: Path, root: Path) -> Path:
    path = index_path(index, root / "train")
    return path.with_name(path.name + ".lock")


def test_a_data_module_that_comes_while_the_early_scan_walks_a_split_waits_for_its_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan holds the split's index lock while it walks it; the data module takes the lock, so it waits, then
    reads the index instead of walking the split again."""
    root, index = _big_tree(tmp_path, classes=400, per_class=100), tmp_path / "index"
    scan = prescan.start(["fit", "--data.root", str(root), "--data.index_dir", str(index)])
    assert scan is not None
    assert _held_by(scan, _train_lock(index, root)), "the scan ended before it was seen walking train/"
    scanned = _counting_scans(monkeypatch)
    dm = _module(root, index)
    assert scan.wait(timeout=120) == 0
    assert "train" not in scanned and len(dm.samples("train")) == 400 * 100
    prescan.stop(scan)


def test_a_tree_the_scan_finds_wrong_leaves_no_index_and_no_output_and_the_run_names_the_folder(
    tmp_path: Path,
) -> None:
    root, index = _tree(tmp_path / "data"), tmp_path / "index"
    (root / "train" / "class1" / "empty.jpg").write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "lit_imagenet.data.prescan", str(root), str(index)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == "" and proc.stderr == ""
    assert not index.exists() or not any(index.glob("*.index"))
    with pytest.raises(DataError, match="empty.jpg"):
        _module(root, index)


def test_a_damaged_index_is_written_anew_by_the_early_scan_with_its_one_warning(tmp_path: Path) -> None:
    root, index = _tree(tmp_path / "data"), tmp_path / "index"
    _module(root, index)
    index_path(index, root / "train").write_bytes(b"damaged")
    proc = subprocess.run([sys.executable, "-m", "lit_imagenet.data.prescan", str(root), str(index)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("warning: the index ") and "could not be read" in line and "wrote it anew" in line
    assert len(read_index(index_path(index, root / "train"), root / "train").samples) == 12


def test_a_scan_stopped_while_it_runs_ends_at_once_with_an_orderly_exit(tmp_path: Path) -> None:
    """``stop`` sends SIGTERM, which the scan turns into ``SystemExit`` (status 143): the ``finally`` blocks run,
    so an index file being written is removed (next test)."""
    code = (
        "import sys, time\n"
        "from lit_imagenet.data import folders, prescan\n"
        "folders.scan_root = lambda root, index_dir: (print('walking', flush=True), time.sleep(60))\n"
        "sys.exit(prescan._scan(sys.argv[1], sys.argv[2]))\n"
    )
    scan = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(tmp_path / "index")], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert scan.stdout.readline() == "walking\n"
    began = time.monotonic()
    prescan.stop(scan)
    assert scan.returncode == 143 and time.monotonic() - began < 5


def test_an_index_file_being_written_when_the_process_exits_is_removed(tmp_path: Path, monkeypatch) -> None:
    root, index = _tree(tmp_path / "data"), tmp_path / "index"
    found = folders.scan_split(root / "train")

    def exit_now(fd: int) -> None:
        raise SystemExit(143)  # what the scan's SIGTERM handler raises, here while the file is being written

    monkeypatch.setattr(os, "fsync", exit_now)
    with pytest.raises(SystemExit):
        write_index(index_path(index, root / "train"), found)
    assert list(index.iterdir()) == []


def test_train_py_starts_the_scan_before_its_imports(tmp_path: Path) -> None:
    """``train.py``'s imports before its run are the lean imports' module, the early scan's and the GPU warm-up's,
    which load neither torch nor Lightning; the scan starts first, as the warm-up imports torch."""
    code = (
        "import sys; import lit_imagenet.lean_imports, lit_imagenet.data.prescan, lit_imagenet.training.warmup; "
        "print(sorted(m for m in ('torch', 'pytorch_lightning', 'numpy', 'lit_imagenet.cli') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
    lines = (REPO / "train.py").read_text().splitlines()
    imports = [line for line in lines if line.startswith(("import ", "from ")) and "sys" not in line]
    assert imports == [
        "from lit_imagenet import lean_imports",
        "from lit_imagenet.data import prescan",
        "from lit_imagenet.training import warmup",
    ]
    calls = [line.strip() for line in lines if ".start(" in line]
    assert [call.split("=")[1].split("(")[0].strip() for call in calls] == ["prescan.start", "warmup.start"]


def test_the_data_options_also_come_from_short_configs_yaml_text_and_a_data_mapping(tmp_path: Path) -> None:
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "other" / "train").mkdir(parents=True)
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  class_path: x.Data\n  init_args:\n    root: {tmp_path / 'data'}\n")
    index = ["--data.index_dir", str(tmp_path / "idx")]
    assert prescan.target(["fit", "-c", str(config), *index]) == (tmp_path / "data", tmp_path / "idx")
    text = f"{{data: {{root: {tmp_path / 'other'}}}}}"
    assert prescan.target(["fit", "-c", str(config), "--config", text, *index])[0] == tmp_path / "other"
    assert prescan.target(["fit", f"--data={{root: {tmp_path / 'data'}, index: false}}"]) is None
    data = tmp_path / "data.yaml"  # what --data takes: the data module's own mapping
    data.write_text(f"init_args:\n  root: {tmp_path / 'other'}\n")
    assert prescan.target(["fit", "-c", str(config), "--data", str(data), *index])[0] == tmp_path / "other"


def test_a_config_given_before_the_subcommand_gives_its_section_of_that_subcommand(tmp_path: Path) -> None:
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "other" / "train").mkdir(parents=True)
    every = tmp_path / "every.yaml"  # what the parser takes before the subcommand: a section per subcommand
    every.write_text(
        f"fit:\n  data:\n    root: {tmp_path / 'data'}\n    index_dir: {tmp_path / 'idx'}\n"
        f"validate:\n  data:\n    root: {tmp_path / 'other'}\n    index: false\n"
    )
    assert prescan.target(["--config", str(every), "fit"]) == (tmp_path / "data", tmp_path / "idx")
    assert prescan.target([f"-c{every}", "fit"]) == (tmp_path / "data", tmp_path / "idx")
    assert prescan.target(["-c", str(every), "validate"]) is None  # its section turns the index off
    # the subcommand's own configs and flags come after, and override it
    own = tmp_path / "own.yaml"
    own.write_text(f"data:\n  root: {tmp_path / 'other'}\n")
    assert prescan.target([f"--config={every}", "fit", "-c", str(own)]) == (tmp_path / "other", tmp_path / "idx")
    assert prescan.target(["-c", str(every), "validate", "--data.index", "true", "--data.index_dir", "/i"]) == (
        tmp_path / "other",
        Path("/i"),
    )
    # a section of another subcommand, or data at the top, is not this one's (the parser ignores it too)
    (tmp_path / "top.yaml").write_text(f"data:\n  root: {tmp_path / 'data'}\n")
    assert prescan.target(["-c", str(tmp_path / "top.yaml"), "fit"]) is None
    assert prescan.target(["-c", str(every), "test"]) is None
    # nothing but configs may come before the subcommand
    assert prescan.target(["--seed", "1", "fit", "--data.root", str(tmp_path / "data")]) is None
    assert prescan.target(["--config", str(every), "--print_config", "fit"]) is None
    assert prescan.target(["--config"]) is None
