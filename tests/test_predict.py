import csv
from pathlib import Path

import pytest
import torch

from lit_imagenet.callbacks import PredictionWriter
from lit_imagenet.cli import main
from lit_imagenet.data.synthetic import SHAPES, make_shapes
from lit_imagenet.training.models import build_model
from tests.cli_args import error_lines


@pytest.fixture(scope="module")
def six_classes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All six shapes, so that there is a top 5 to write."""
    return make_shapes(
        str(tmp_path_factory.mktemp("data") / "six"), train_per_class=2, val_per_class=1, width=32, height=32
    )


def _common(tmp_path: Path) -> list[str]:
    return [
        "--data.batch_size", "4", "--data.workers", "0", "--data.crop_size", "32", "--data.val_resize", "32",
        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(six_classes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint fine-tuned for one epoch from a local weights file, which is then deleted."""
    tmp_path = tmp_path_factory.mktemp("fit")
    pretrained = tmp_path / "pretrained.pt"
    torch.save(build_model("resnet18", 1000).state_dict(), pretrained)
    main(["fit", "--data.root", str(six_classes), "--model.arch", "resnet18", "--model.weights", str(pretrained),
          "--trainer.max_epochs", "1", *_common(tmp_path)])  # fmt: skip
    pretrained.unlink()  # predicting needs only the checkpoint, not the file fine-tuning started from
    return next(tmp_path.rglob("last.ckpt"))


def test_predict_from_a_checkpoint_writes_top5_names_for_every_image(
    six_classes: Path, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt = checkpoint
    # Any folder of images, nested at will: they are found recursively.
    images = tmp_path / "to_classify"
    (images / "nested").mkdir(parents=True)
    for i, src in enumerate(sorted((six_classes / "train").rglob("*.jpg"))[:5]):
        (images / ("nested" if i % 2 else "") / f"img{i}.jpg").write_bytes(src.read_bytes())
    out = tmp_path / "out" / "preds.csv"
    capsys.readouterr()
    main(["predict", "--ckpt_path", str(ckpt), "--data.predict_root", str(images),
          "--predict_writer.output", str(out), *_common(tmp_path / "predict")])  # fmt: skip
    assert f"Predictions for 5 images: {out}" in capsys.readouterr().out

    rows = list(csv.DictReader(open(out)))
    assert sorted(Path(r["path"]) for r in rows) == sorted(images.rglob("*.jpg"))
    for row in rows:
        names = [row[f"class_{i}"] for i in range(1, 6)]
        probs = [float(row[f"prob_{i}"]) for i in range(1, 6)]
        assert len(set(names)) == 5 and set(names) <= set(SHAPES)
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-5
        assert "class_6" not in row


def test_predictions_with_loader_workers_are_those_without(shapes_root: Path, checkpoint: Path, tmp_path: Path) -> None:
    """Each row's image is the one its prediction is of, however many workers decode the batches."""
    rows = {}
    for workers in ("0", "3"):
        out = tmp_path / f"workers-{workers}.csv"
        args = _common(tmp_path / workers)
        args[args.index("--data.workers") + 1] = workers
        main(["predict", "--ckpt_path", str(checkpoint), "--data.predict_root", str(shapes_root / "val"),
              "--predict_writer.output", str(out), *args])  # fmt: skip
        rows[workers] = list(csv.DictReader(open(out)))
    assert len(rows["3"]) == len({row["path"] for row in rows["3"]}) == 15
    assert sorted(rows["3"], key=lambda row: row["path"]) == sorted(rows["0"], key=lambda row: row["path"])


def test_predict_writes_into_the_run_of_its_checkpoint_by_default(
    shapes_root: Path, checkpoint: Path, tmp_path: Path
) -> None:
    cli = main(["predict", "--ckpt_path", str(checkpoint), "--data.predict_root", str(shapes_root / "val"),
                *_common(tmp_path)])  # fmt: skip
    (writer,) = [c for c in cli.trainer.callbacks if isinstance(c, PredictionWriter)]
    assert writer.path == checkpoint.parent.parent / "predictions.csv"
    assert len(list(csv.DictReader(open(writer.path)))) == 15


def test_predict_without_checkpoint_or_classes_is_one_line(shapes_root: Path, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--data.predict_root", str(shapes_root / "val"), *_common(tmp_path)])
    assert exc.value.code == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: The number of classes is unknown; give --ckpt_path of a trained model or --data.root."
    ]


def test_predict_keeps_no_probabilities_in_memory_unless_asked(
    shapes_root: Path, checkpoint: Path, tmp_path: Path
) -> None:
    args = ["predict", "--ckpt_path", str(checkpoint), "--data.predict_root", str(shapes_root / "val"),
            *_common(tmp_path)]  # fmt: skip
    assert main(args).trainer.predict_loop.predictions == []
    kept = main([*args, "--return_predictions", "true"]).trainer.predict_loop.predictions
    assert sum(len(batch["probs"]) for batch in kept) == 15
