"""Train, validate, test or predict with a torchvision classifier: ``python train.py --help``."""

import sys

from lit_imagenet.data.prescan import start, stop

if __name__ == "__main__":
    scan = start(sys.argv[1:])  # the data folder's scan, while the imports below run
    try:
        from lit_imagenet.cli import main

        main()
    finally:
        stop(scan)
