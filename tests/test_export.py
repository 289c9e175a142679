import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import torchvision

from lit_imagenet import ImageClassifier, ImageFolderDataModule
from lit_imagenet.export import export

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(shapes_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ImageClassifier]:
    tmp_path = tmp_path_factory.mktemp("export")
    dm = ImageFolderDataModule(str(shapes_root), batch_size=8, workers=0, crop_size=32, val_resize=36)
    model = ImageClassifier("resnet18", num_classes=3, class_names=dm.classes)
    trainer = pl.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, dm)  # so that the batchnorm running statistics are no longer their initial values
    ckpt = tmp_path / "model.ckpt"
    trainer.save_checkpoint(ckpt)
    return ckpt, model.eval()


def test_exported_state_dict_and_program_match_the_module(trained, tmp_path: Path) -> None:
    ckpt, module = trained
    paths = export(str(ckpt), str(tmp_path), image_size=32)
    torch.manual_seed(0)
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = module(images)
        plain = torchvision.models.resnet18(num_classes=3)
        plain.load_state_dict(torch.load(paths["state_dict"], weights_only=True))
        torch.testing.assert_close(plain.eval()(images), expected)
        program = torch.export.load(paths["program"]).module()
        torch.testing.assert_close(program(images), expected)
        torch.testing.assert_close(program(images[:1]), expected[:1], rtol=1e-4, atol=1e-5)  # another batch size
    assert "circle" in paths["metadata"].read_text()


def test_export_command_line(trained, tmp_path: Path) -> None:
    ckpt, _ = trained
    proc = subprocess.run(
        [sys.executable, "-m", "lit_imagenet.export", str(ckpt), str(tmp_path), "--image_size", "32"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "resnet18_state_dict.pth").is_file() and (tmp_path / "resnet18.pt2").is_file()


def test_export_refuses_a_plain_state_dict(tmp_path: Path) -> None:
    path = tmp_path / "plain.pth"
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), path)
    with pytest.raises(ValueError, match="plain.pth is not a checkpoint of this project"):
        export(str(path), str(tmp_path / "out"))
