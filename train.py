"""Train, validate, test or predict with a torchvision classifier: ``python train.py --help``."""

from lit_imagenet.cli import main

if __name__ == "__main__":
    main()
