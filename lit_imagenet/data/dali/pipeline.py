"""The DALI pipeline graph (that of DALI's ResNet-50 example). The crop windows, flips and erased boxes come from the
samples' seeds through an external source, so that a resumed epoch cuts the same crops again; only an auto-augment
policy is drawn in the pipeline, by ``nvidia.dali.auto_aug`` from the pipeline's seed (``pipeline_seed``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lit_imagenet.data.augment import erase_boxes
from lit_imagenet.data.crops import crop_draws, crop_windows, eval_geometry, flips, uniform_draws

# torchvision's RandAugment shifts by up to 150/331 of the image; its policies fill uncovered pixels with black.
_RA_TRANSLATE = 150 / 331
_POLICY_FILL = 0


def _rows(iteration: int, count: int, batch_size: int) -> np.ndarray:
    """The rows of batch ``iteration`` of ``count`` samples, padded as the reader pads; iterations go on over resets."""
    start = iteration % max(1, math.ceil(count / batch_size)) * batch_size
    return np.minimum(np.arange(start, start + batch_size), count - 1)


@dataclass(eq=False)
class CropSource:
    """A training pipeline's external source: each batch's crop windows and flips from the samples' ``seeds``, and with
    ``erase`` (``(p, crop side)``) the boxes to erase; ``sizes`` gives samples' ``(height, width)``."""

    indices: np.ndarray
    seeds: np.ndarray
    sizes: Callable[[np.ndarray], np.ndarray]
    batch_size: int
    scale: tuple[float, float]
    erase: tuple[float, int] | None = None

    def __call__(self, iteration: int) -> tuple[np.ndarray, ...]:
        rows = _rows(iteration, len(self.indices), self.batch_size)
        draws = crop_draws(self.seeds[rows], self.scale)
        box = crop_windows(self.sizes(self.indices[rows]), draws)
        anchor = np.ascontiguousarray(box[:, [1, 0]])  # DALI takes (x, y): left, top
        shape = np.ascontiguousarray(box[:, [3, 2]])  # and (width, height)
        mirror = flips(draws)
        if self.erase is None:
            return anchor, shape, mirror
        p, side = self.erase
        top, left, height, width = erase_boxes(self.seeds[rows], side, side, p).T
        # fn.erase runs before crop_mirror_normalize mirrors: a mirrored crop's box is mirrored here in its stead.
        left = np.where((mirror == 1) & (width > 0), side - left - width, left)
        corner, extent = np.stack([top, left], 1), np.stack([height, width], 1)  # fn.erase's (y, x) order
        return anchor, shape, mirror, corner.astype(np.float32), extent.astype(np.float32)


def pipeline_seed(seed: int, epoch: int, skipped: int, rank: int) -> int:
    """The seed of a training pipeline's policy, from the run's ``seed``, ``epoch``, samples ``skipped``, ``rank``."""
    key = ((((seed & 0xFFFFFFFF) * 1_000_003 + epoch) * 1_000_003 + skipped) * 1_000_003 + rank) & 0x7FFFFFFFFFFFFFFF
    return int(uniform_draws([key], 1)[0, 0] * 2**31)


def build_pipeline(loader: Any, indices: np.ndarray, seeds: np.ndarray | None, seed: int) -> Any:
    """A DALI pipeline of ``(images, labels)`` batches of samples ``indices`` of ``loader`` (a ``DALILoader``): with
    their ``seeds``, their crops, flips and ``loader.augment`` (policy drawn from ``seed``); else centre crops."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import rand_augment, trivial_augment

    augment, crop_size, batch_size = loader.augment, loader.crop_size, loader.batch_size
    erase = (augment.random_erase, crop_size) if augment and augment.random_erase else None
    if seeds is not None:
        source = CropSource(indices, seeds, loader.sizes.get, batch_size, loader.crop_scale, erase)
    else:

        def source(iteration: int) -> tuple[np.ndarray, ...]:  # the resized sizes and centre crop positions
            rows = indices[_rows(iteration, len(indices), batch_size)]
            return eval_geometry(loader.sizes.get(rows), loader.val_resize, crop_size)

    files, labels = loader.samples.paths(indices), loader.samples.labels[indices].tolist()
    cuda = loader.device is not None
    # EXIF orientation is left alone, as PIL and torchvision.io leave it on the other paths.
    decode_args = dict(device="mixed" if cuda else "cpu", output_type=types.RGB, adjust_orientation=False)
    if cuda:
        decode_args["hw_decoder_load"] = loader.hw_decoder_load
    policy = augment.policy if augment is not None else None

    # seed: only a policy is drawn in the pipeline, with conditionals: auto_aug picks its ops by `if`.
    @pipeline_def(
        batch_size=batch_size, num_threads=loader.threads, device_id=loader.device.index if cuda else None, seed=seed,
        enable_conditionals=policy is not None,
    )  # fmt: skip
    def pipeline() -> tuple[Any, Any]:
        encoded, label = fn.readers.file(
            files=files, labels=labels, random_shuffle=False, pad_last_batch=True, name="Reader"
        )
        mirror: Any = 0
        crop: dict[str, Any] = {}
        if seeds is not None:
            erasing = erase is not None
            outputs = fn.external_source(
                source=source, num_outputs=5 if erasing else 3, batch=True,
                dtype=[types.INT32, types.INT32, types.INT32, *([types.FLOAT, types.FLOAT] if erasing else [])],
            )  # fmt: skip
            anchor, box, mirror = outputs[:3]
            images = fn.decoders.image_slice(
                encoded, anchor, box, normalized_anchor=False, normalized_shape=False, **decode_args
            )
            images = fn.resize(images, resize_x=crop_size, resize_y=crop_size, antialias=True)
            if policy == "ta_wide":  # on uint8 HWC crops
                images = trivial_augment.trivial_augment_wide(images, fill_value=_POLICY_FILL)
            elif policy == "ra":
                images = rand_augment.rand_augment(
                    images, n=2, m=augment.ra_magnitude, shape=(crop_size, crop_size), fill_value=_POLICY_FILL,
                    max_translate_rel=_RA_TRANSLATE,
                )  # fmt: skip
            if erasing:  # a 0 x 0 box erases nothing
                fill = list(augment.fill)
                images = fn.erase(images, anchor=outputs[3], shape=outputs[4], axis_names="HW", fill_value=fill)
        else:
            images = fn.decoders.image(encoded, **decode_args)
            resized, position = fn.external_source(source=source, num_outputs=2, batch=True, dtype=[types.FLOAT] * 2)
            images = fn.resize(images, resize_x=resized[0], resize_y=resized[1], antialias=True)
            crop = {"crop": (crop_size, crop_size), "crop_pos_x": position[0], "crop_pos_y": position[1]}
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT16 if loader.dtype == torch.float16 else types.FLOAT,
            output_layout="HWC" if loader.channels_last else "CHW",
            mean=[255 * m for m in loader.mean],
            std=[255 * s for s in loader.std],
            mirror=mirror,
            **crop,
        )
        label = fn.reshape(fn.cast(label, dtype=types.INT64), shape=[])
        return images, label.gpu() if cuda else label

    return pipeline()
