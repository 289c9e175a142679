"""Train, validate, test or predict with a torchvision classifier: ``python train.py --help``."""

import sys

from lit_imagenet import lean_imports
from lit_imagenet.data import prescan
from lit_imagenet.training import warmup

if __name__ == "__main__":
    lean_imports.skip_unused_optional_imports()  # torchmetrics' transformers, scipy.signal and pyplot: not used
    scan = prescan.start(sys.argv[1:])  # the data folder's scan, while the imports below run
    warming = warmup.start(sys.argv[1:])  # the GPU's context and libraries, meanwhile too
    try:
        from lit_imagenet.cli import main

        main()
    finally:
        warmup.stop(warming)
        prescan.stop(scan)
