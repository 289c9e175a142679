import json
import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]


def test_finetune_notebook_runs_and_reaches_its_accuracy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel is started with this interpreter (jupyter_client swaps it in for "python") and in tmp_path.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(REPO / "notebooks" / "finetune.ipynb", as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    seconds = time.perf_counter() - start
    result = json.loads((tmp_path / "data" / "nb_result.json").read_text())
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert f"Validation top-1 after fine-tuning: {result['val_top1']:.3f}" in printed
    assert result["val_top1"] >= 0.6
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for c in nb.cells
               for o in c.get("outputs", []))  # fmt: skip
    assert seconds < 90, seconds
