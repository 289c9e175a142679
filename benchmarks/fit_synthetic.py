"""``train.py fit`` on random uint8 batches made on the GPU: the training loop's own speed, with no data loading.

Takes the arguments of ``train.py`` (``--model.*``, ``--trainer.*``, the callbacks' options), with
``--data.*`` those of ``lit_imagenet.data.synthetic.SyntheticDataModule`` (batch_size, crop_size,
num_classes, train_steps, val_steps, channels_last):

    python benchmarks/fit_synthetic.py fit --trainer.precision 16-mixed --data.train_steps 100
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from lit_imagenet.cli import main  # noqa: E402
from lit_imagenet.data.synthetic import SyntheticDataModule  # noqa: E402

if __name__ == "__main__":
    main(datamodule_class=SyntheticDataModule)
