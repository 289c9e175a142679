"""The index of a split: scanned once, read instead of the tree by later runs, rebuilt when a folder changed."""

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lit_imagenet.data import folders
from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.data.index import SampleTable, cached_scan, index_path, read_index
from lit_imagenet.errors import DataError
from tests.cli_args import fit_args
from tests.runs import run_train

REPO = Path(__file__).resolve().parents[1]


def _tree(root: Path, classes: int = 3, per_class: int = 4) -> Path:
    """A small ImageFolder whose folders were last changed a minute ago (a scan may then write its index)."""
    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.new("RGB", (12, 10), (40 * c, 10 * i, 0)).save(folder / f"img{i}.jpg")
    _age(root)
    return root


def _age(root: Path) -> None:
    past = time.time() - 60
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        os.utime(folder, (past, past))


def _counting_scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    scanned: list[str] = []
    original = folders.scan_split

    def counted(split_dir):
        scanned.append(Path(split_dir).name)
        return original(split_dir)

    monkeypatch.setattr(folders, "scan_split", counted)
    return scanned


def _module(root: Path, index_dir: Path, **kwargs) -> ImageFolderDataModule:
    return ImageFolderDataModule(str(root), workers=0, index_dir=str(index_dir), **kwargs)


def test_a_run_on_an_unchanged_tree_reads_the_index_instead_of_walking_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, index = _tree(tmp_path / "data"), tmp_path / "index"
    scanned = _counting_scans(monkeypatch)
    first = _module(root, index)
    assert scanned == ["train", "val"] and len(list(index.glob("*.index"))) == 2
    walked = []
    monkeypatch.setattr(os, "scandir", lambda *a: walked.append(a) or pytest.fail("the tree was walked"))
    again = _module(root, index)
    assert scanned == ["train", "val"] and walked == []
    assert again.classes == first.classes == ["class0", "class1", "class2"]
    for split in ("train", "val"):
        assert again.samples(split) == first.samples(split) and list(again.samples(split)) == list(first.samples(split))
    assert again.samples("train")[5] == (str(root / "train" / "class1" / "img1.jpg"), 1)


@pytest.mark.parametrize("change", ["file added", "file removed", "class folder added", "file renamed"])
def test_a_stale_index_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    root, index = _tree(tmp_path / "data"), tmp_path / "index"
    _module(root, index)
    scanned = _counting_scans(monkeypatch)
    if change == "file added":
        Image.new("RGB", (12, 10)).save(root / "train" / "class2" / "new.jpg")
    elif change == "file removed":
        (root / "train" / "class0" / "img3.jpg").unlink()
    elif change == "file renamed":
        (root / "train" / "class0" / "img3.jpg").rename(root / "train" / "class0" / "moved.jpg")
    else:
        for split in ("train", "val"):
            (root / split / "class9").mkdir()
            Image.new("RGB", (12, 10)).save(root / split / "class9" / "x.jpg")
    if change != "class folder added":
        _age(root)  # a change long enough ago that the rebuilt index is written too
    rebuilt = _module(root, index)
    assert "train" in scanned
    paths = [Path(p).name for p, _ in rebuilt.samples("train")]
    expected = {"file added": 13, "file removed": 11, "file renamed": 12, "class folder added": 13}[change]
    assert len(paths) == expected
    assert ("new.jpg" in paths) == (change == "file added") and ("moved.jpg" in paths) == (change == "file renamed")
    if change == "class folder added":
        assert rebuilt.classes[-1] == "class9"
        assert not list(index.glob(".*.tmp"))
    else:
        scanned.clear()
        _module(root, index)
        assert scanned == []  # the rebuilt index was written, and is read now


def test_an_index_written_while_the_tree_changed_is_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder changed during the scan, or so shortly before it that its time may not move again, writes none."""
    root, index = _tree(tmp_path / "data"), tmp_path / "index"
    Image.new("RGB", (12, 10)).save(root / "train" / "class1" / "late.jpg")  # a moment ago
    scanned = _counting_scans(monkeypatch)
    dm = _module(root, index)
    assert "late.jpg" in {Path(p).name for p, _ in dm.samples("train")}
    assert not index_path(index, root / "train").exists() and index_path(index, root / "val").exists()
    _module(root, index)
    assert scanned == ["train", "val", "train"]


def test_the_checks_of_the_scan_still_stop_a_run_whose_tree_changed(tmp_path: Path) -> None:
    root, index = _tree(tmp_path / "data"), tmp_path / "index"
    _module(root, index)
    (root / "train" / "class1" / "notes.txt").write_text("not an image")
    with pytest.raises(DataError, match=r"notes.txt is not an image file"):
        _module(root, index)
    (root / "train" / "class1" / "notes.txt").unlink()
    (root / "val" / "class0").rename(root / "val" / "other")
    with pytest.raises(DataError, match=r"have different class folders"):
        _module(root, index)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "flipped byte", "empty"])
def test_a_corrupt_index_is_rebuilt_with_one_warning_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, damage: str
) -> None:
    root, index = _tree(tmp_path / "data"), tmp_path / "index"
    expected = list(_module(root, index).samples("train"))
    path = index_path(index, root / "train")
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"x" * 100, "empty": b"",
                      "flipped byte": data[:-3] + bytes([data[-3] ^ 1]) + data[-2:]}[damage])  # fmt: skip
    scanned = _counting_scans(monkeypatch)
    capsys.readouterr()
    assert list(_module(root, index).samples("train")) == expected and scanned == ["train"]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: the index {path} of {root / 'train'} could not be read")
    assert lines[0].endswith("scanned the folder and wrote it anew.")
    assert read_index(path, root / "train").samples == _module(root, index).samples("train")  # rewritten whole


def test_an_unwritable_index_folder_costs_one_warning_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = _tree(tmp_path / "data")
    blocker = tmp_path / "file"
    blocker.write_text("a file where the index folder should be")
    dm = _module(root, blocker / "index")
    assert len(dm.samples("train")) == 12
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"warning: cannot write the index of {root / 'train'}")
    assert lines[0].endswith("set --data.index_dir to a writable folder, or --data.index false.")


def test_index_false_scans_every_time_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, index = _tree(tmp_path / "data"), tmp_path / "index"
    scanned = _counting_scans(monkeypatch)
    for _ in range(2):
        ImageFolderDataModule(str(root), workers=0, index=False, index_dir=str(index))
    assert scanned == ["train", "val"] * 2 and not index.exists()


def test_the_index_lives_in_the_cache_folder_of_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _tree(tmp_path / "data")
    monkeypatch.setenv("LIT_IMAGENET_CACHE", str(tmp_path / "cache"))
    ImageFolderDataModule(str(root), workers=0)
    assert len(list((tmp_path / "cache" / "index").glob("*.index"))) == 2


def _scan_in_a_process(split: str, index: str, log: str, barrier) -> None:
    def slow(split_dir):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        return folders.scan_split(split_dir)

    barrier.wait()
    scan = cached_scan(Path(split), Path(index), slow)
    with open(log + ".done", "a") as f:
        f.write(f"{len(scan.samples)}\n")


def test_of_processes_starting_together_one_scans_and_the_others_read_its_index(tmp_path: Path) -> None:
    root, index, log = _tree(tmp_path / "data"), tmp_path / "index", tmp_path / "scans.log"
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(4)
    procs = [context.Process(target=_scan_in_a_process, args=(str(root / "train"), str(index), str(log), barrier))
             for _ in range(4)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(log.read_text().split()) == 1  # one scan
    assert log.with_name("scans.log.done").read_text().split() == ["12"] * 4


def test_a_sample_table_is_a_sequence_of_pairs_without_python_objects(tmp_path: Path) -> None:
    pairs = [(str(tmp_path / "a" / "x.jpg"), 0), (str(tmp_path / "b" / "ü y.jpg"), 1), (str(tmp_path / "b" / "z"), 1)]
    table = SampleTable.from_pairs(tmp_path, pairs)
    assert list(table) == pairs and len(table) == 3 and table[-1] == pairs[-1] and table[1:] == pairs[1:]
    assert table.paths(np.array([2, 0])) == [pairs[2][0], pairs[0][0]]
    assert table.names.dtype == np.uint8 and table.offsets.dtype == np.int64 and table.labels.dtype == np.int32
    with pytest.raises(IndexError):
        table[3]
    assert SampleTable.of(pairs) == SampleTable.from_pairs("", pairs) and list(SampleTable.of(pairs)) == pairs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("decoder", ["pil", pytest.param("dali", marks=pytest.mark.dali)])
def test_two_processes_read_each_file_at_most_once_before_training_and_only_their_own(
    tmp_path: Path, decoder: str
) -> None:
    """Before the first step, over both ranks: each image read at most once, by the rank whose shard holds it."""
    from lit_imagenet.data.samplers import epoch_order

    root, reads = _tree(tmp_path / "data", classes=4, per_class=8), tmp_path / "reads"
    record = tmp_path / "record.yaml"
    record.write_text("trainer:\n  callbacks:\n    - class_path: tests.run_callbacks.RecordReads\n"
                      f"      init_args: {{folder: {reads}, root: {root}}}\n")  # fmt: skip
    args = fit_args(root, tmp_path / "out", "--trainer.devices", "2", "--trainer.max_steps", "1",
                    "--data.decoder", decoder, "--data.crop_size", "8", "--data.val_resize", "8",
                    "--trainer.limit_val_batches", "1", "--data.index_dir", str(tmp_path / "index"),
                    "--seed_everything", "5", "--config", str(record), batch_size=4, workers=1)  # fmt: skip
    proc = run_train(args, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split(" ", 3) for f in reads.glob("reads-*.txt") for line in f.read_text().splitlines()]
    rank_of = {pid: int(what.split()[1]) for _, pid, _, what in lines if what.startswith("TRAIN")}
    assert sorted(rank_of.values()) == [0, 1]
    started = min(float(t) for t, _, _, what in lines if what.startswith("TRAIN"))
    before = [(rank_of.get(pid, rank_of.get(parent)), what) for t, pid, parent, what in lines
              if float(t) < started and not what.startswith("TRAIN")]  # fmt: skip
    files = [what for _, what in before]
    assert files and len(files) == len(set(files)), sorted(files)
    names = {split: [str(root / split / f"class{c}" / f"img{i}.jpg") for c in range(4) for i in range(8)]
             for split in ("train", "val")}  # fmt: skip
    for rank in (0, 1):
        own = {names["train"][i] for i in epoch_order(32, 5, 0, 2, rank)} | set(names["val"][rank::2])
        assert {what for r, what in before if r == rank} <= own
