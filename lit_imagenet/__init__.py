"""lit_imagenet: train and fine-tune torchvision classifiers on ImageFolder data with PyTorch Lightning."""

from lit_imagenet.callbacks import CUDAPrefetch, LearningRateLog, PredictionWriter, Throughput
from lit_imagenet.data import DataError, ImageFolderDataModule, collate_uint8
from lit_imagenet.module import ImageClassifier
from lit_imagenet.prefetch import PrefetchLoader, Uint8Normalize
from lit_imagenet.schedule import WarmupMultiStep, scaled_lr

__all__ = [
    "CUDAPrefetch",
    "DataError",
    "ImageClassifier",
    "ImageFolderDataModule",
    "LearningRateLog",
    "PredictionWriter",
    "PrefetchLoader",
    "Throughput",
    "Uint8Normalize",
    "WarmupMultiStep",
    "collate_uint8",
    "scaled_lr",
]
