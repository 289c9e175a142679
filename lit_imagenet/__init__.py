"""lit_imagenet: train and fine-tune torchvision classifiers on ImageFolder data with PyTorch Lightning.

The data flow, from the folder to the model::

    root/<split>/<class>/*.jpg
      -> folders.scan_root         classes and (path, label) samples, checked before training
      -> datasets / decoding       workers decode (pil, torchvision) or read the JPEG bytes (nvjpeg)
      -> collate_uint8             uint8 (N, 3, H, W) batches, pinned
      -> prefetch.PrefetchLoader   on CUDA: copied, decoded (nvjpeg) and normalised one batch ahead
      -> module.ImageClassifier    channels_last, AMP, SGD; metrics on the device

The layers, each importing only from those below it (``tests/test_layout.py`` checks it)::

    cli, export                      the command lines
    callbacks, checkpointing,        Lightning callbacks around a run
      guard, monitoring
    module, datamodule               the LightningModule and the DataModule
    backbone, decoders, metrics,     their parts
      optim
    prefetch                         the side-stream prefetcher and its callback
    dali, datasets, gpu_decode       datasets, collation, GPU batch decoding, the DALI loader
    decoding, folders, samplers      CPU decoding, the folder layout, the sample order
    presets                          mean, std, transforms, crop boxes
    ddp, host, models, precision,    utilities
      schedule, synthetic
    compat, errors                   Lightning's private attributes; the user's errors
"""

from lit_imagenet.callbacks import PredictionWriter
from lit_imagenet.datamodule import ImageFolderDataModule
from lit_imagenet.datasets import collate_uint8
from lit_imagenet.errors import DataError
from lit_imagenet.module import ImageClassifier
from lit_imagenet.monitoring import LearningRateLog, Throughput
from lit_imagenet.prefetch import CUDAPrefetch, PrefetchLoader
from lit_imagenet.presets import Uint8Normalize
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
