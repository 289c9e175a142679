import csv
import json
import os
from pathlib import Path

import pytest
import torch

nbformat = pytest.importorskip("nbformat", reason="the notebook test needs the test extras (nbformat, nbclient)")
NotebookClient = pytest.importorskip("nbclient", reason="the notebook test needs the test extras").NotebookClient

REPO = Path(__file__).resolve().parents[1]


def test_finetune_notebook_runs_and_reaches_its_accuracy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel is started with this interpreter (jupyter_client swaps it in for "python") and in tmp_path.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(REPO / "notebooks" / "finetune.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    result = json.loads((tmp_path / "data" / "nb_result.json").read_text())
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert f"Validation top-1 after fine-tuning: {result['val_top1']:.3f}" in printed
    assert result["val_top1"] >= 0.6
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for c in nb.cells
               for o in c.get("outputs", []))  # fmt: skip
    # It fine-tuned from the weights file it saved: a plain state dict with the 6-class head it replaced.
    weights = torch.load(tmp_path / "data" / "nb_pretrained_resnet18.pth", weights_only=True)
    assert weights["fc.weight"].shape == (6, 512)
    # The curve it plotted: a validation point for each of the 8 epochs, and training losses between them.
    version = tmp_path / "data" / "nb_logs" / "finetune" / "version_0"
    rows = list(csv.DictReader(open(version / "metrics.csv")))
    assert len([r for r in rows if r.get("val/top1")]) == 8
    assert len([r for r in rows if r.get("train/loss_step")]) >= 8
    # default_callbacks() gave the command line's behaviour: checkpoints, the console line, curves, throughput.
    assert (version / "checkpoints" / "last.ckpt").is_file() and (version / "training_curves.png").is_file()
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert (
        "Epoch 7 [12/12] step 96 |" in printed and "Epoch 7: " in printed and "images/s over all processes" in printed
    )
