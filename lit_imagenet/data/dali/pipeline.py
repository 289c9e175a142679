"""The DALI pipeline graph (that of DALI's ResNet-50 example), and the external sources of its crops and sizes.

The crop windows, flips and erased boxes come from the samples' seeds (``lit_imagenet.data.crops``, ``augment``)
through an external source, so that a resumed epoch cuts the same crops again. Only an auto-augment policy is drawn
in the pipeline, by ``nvidia.dali.auto_aug`` from the pipeline's seed (``pipeline_seed``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from lit_imagenet.data.augment import Augment, erase_boxes
from lit_imagenet.data.crops import crop_draws, crop_windows, eval_geometry, flips, uniform_draws

# torchvision's RandAugment shifts by up to 150/331 of the image; its policies fill uncovered pixels with black.
_RA_TRANSLATE = 150 / 331
_POLICY_FILL = 0


class _Source:
    """An external source: per batch ``i``, the rows of ``indices`` the reader reads, padded like the reader's."""

    def __init__(self, indices: np.ndarray, sizes: Callable[[np.ndarray], np.ndarray], batch_size: int) -> None:
        self.indices = indices
        self.sizes = sizes  # ``(height, width)`` of samples (``images.ImageSizes.get``)
        self.batch_size = batch_size
        self.batches = max(1, math.ceil(len(indices) / batch_size))

    def rows(self, iteration: int) -> np.ndarray:
        start = (iteration % self.batches) * self.batch_size
        return np.minimum(np.arange(start, start + self.batch_size), len(self.indices) - 1)


class GeometrySource(_Source):
    """The external source of an evaluation pipeline: each batch's resized sizes and centre crop positions."""

    def __init__(
        self, indices: np.ndarray, sizes: Callable[[np.ndarray], np.ndarray], batch_size: int, resize: int, crop: int
    ) -> None:
        super().__init__(indices, sizes, batch_size)
        self.resize, self.crop = resize, crop

    def __call__(self, iteration: int) -> tuple[np.ndarray, np.ndarray]:
        return eval_geometry(self.sizes(self.indices[self.rows(iteration)]), self.resize, self.crop)


class CropSource(_Source):
    """A training pipeline's external source: each batch's crop windows and flips, from the samples' ``seeds``, and
    with ``erase`` (``(p, crop side)``) the boxes to erase (``augment.erase_boxes``) as ``fn.erase`` takes them."""

    def __init__(
        self,
        indices: np.ndarray,
        seeds: np.ndarray,
        sizes: Callable[[np.ndarray], np.ndarray],
        batch_size: int,
        scale: tuple[float, float],
        erase: tuple[float, int] | None = None,
    ) -> None:
        super().__init__(indices, sizes, batch_size)
        self.seeds = np.asarray(seeds, dtype=np.uint64)
        self.scale = scale
        self.erase = erase

    def __call__(self, iteration: int) -> tuple[np.ndarray, ...]:
        rows = self.rows(iteration)
        draws = crop_draws(self.seeds[rows], self.scale)
        box = crop_windows(self.sizes(self.indices[rows]), draws)
        anchor = np.ascontiguousarray(box[:, [1, 0]])  # DALI takes (x, y): left, top
        shape = np.ascontiguousarray(box[:, [3, 2]])  # and (width, height)
        mirror = flips(draws)
        if self.erase is None:
            return anchor, shape, mirror
        p, side = self.erase
        top, left, height, width = erase_boxes(self.seeds[rows], side, side, p).T
        # Erased before crop_mirror_normalize mirrors: a mirrored crop's box is mirrored here, so that the output's
        # erased pixels are those of erase_boxes, as on the other decoders.
        left = np.where((mirror == 1) & (width > 0), side - left - width, left)
        corner, extent = np.stack([top, left], 1), np.stack([height, width], 1)  # fn.erase's (y, x) order
        return anchor, shape, mirror, corner.astype(np.float32), extent.astype(np.float32)


def pipeline_seed(seed: int, epoch: int, skipped: int, rank: int) -> int:
    """The seed of a training pipeline, from which DALI draws the auto-augment policy: fixed by the run's ``seed``,
    the ``epoch``, the samples of the epoch ``skipped`` by a resume and the process's ``rank``."""
    key = ((((seed & 0xFFFFFFFF) * 1_000_003 + epoch) * 1_000_003 + skipped) * 1_000_003 + rank) & 0x7FFFFFFFFFFFFFFF
    return int(uniform_draws([key], 1)[0, 0] * 2**31)


def _policy(images: Any, augment: Augment, crop_size: int) -> Any:
    """``augment``'s policy by ``nvidia.dali.auto_aug`` on uint8 HWC crops (the pipeline needs conditionals)."""
    from nvidia.dali.auto_aug import rand_augment, trivial_augment

    if augment.policy == "ta_wide":
        return trivial_augment.trivial_augment_wide(images, fill_value=_POLICY_FILL)
    if augment.policy == "ra":
        return rand_augment.rand_augment(
            images, n=2, m=augment.ra_magnitude, shape=(crop_size, crop_size), fill_value=_POLICY_FILL,
            max_translate_rel=_RA_TRANSLATE,
        )  # fmt: skip
    raise ValueError(f"DALI has no {augment.policy!r} policy")


def build_pipeline(
    files: list[str],
    labels: list[int],
    source: CropSource | GeometrySource,
    *,
    batch_size: int,
    threads: int,
    device_id: int | None,
    crop_size: int,
    dtype: torch.dtype,
    channels_last: bool,
    mean: Sequence[float],
    std: Sequence[float],
    hw_decoder_load: float,
    augment: Augment | None = None,
    seed: int = 0,
) -> Any:
    """A DALI pipeline yielding ``(images, labels)`` batches of ``files`` in order, cropped as ``source`` says
    (``CropSource``: resized crops and flips; ``GeometrySource``: centre crops). ``device_id`` ``None``: on the CPU.
    With ``augment`` (training), its policy drawn from ``seed`` and the erasing of ``source``'s boxes follow the crop.
    """
    from nvidia.dali import fn, pipeline_def, types

    cuda = device_id is not None
    decode_device = "mixed" if cuda else "cpu"
    # EXIF orientation is left alone, as PIL and torchvision.io leave it on the other paths.
    decode_args: dict[str, Any] = {"output_type": types.RGB, "adjust_orientation": False}
    if cuda:
        decode_args["hw_decoder_load"] = hw_decoder_load

    policy = augment is not None and augment.policy is not None
    options: dict[str, Any] = {"enable_conditionals": True} if policy else {}  # auto_aug picks its ops by `if`

    # seed: only a policy is drawn in the pipeline, the crops come from the samples' seeds
    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id, seed=seed, **options)
    def pipeline() -> tuple[Any, Any]:
        encoded, label = fn.readers.file(
            files=files, labels=labels, random_shuffle=False, pad_last_batch=True, name="Reader"
        )
        mirror: Any = 0
        crop: dict[str, Any] = {}
        if isinstance(source, CropSource):
            erasing = source.erase is not None
            outputs = fn.external_source(
                source=source, num_outputs=5 if erasing else 3, batch=True,
                dtype=[types.INT32, types.INT32, types.INT32, *([types.FLOAT, types.FLOAT] if erasing else [])],
            )  # fmt: skip
            anchor, box, mirror = outputs[:3]
            images = fn.decoders.image_slice(
                encoded, anchor, box, normalized_anchor=False, normalized_shape=False, device=decode_device,
                **decode_args,
            )  # fmt: skip
            images = fn.resize(images, resize_x=crop_size, resize_y=crop_size, antialias=True)
            if augment is not None and augment.policy is not None:
                images = _policy(images, augment, crop_size)
            if erasing and augment is not None:  # a 0 x 0 box erases nothing
                fill = list(augment.fill)
                images = fn.erase(images, anchor=outputs[3], shape=outputs[4], axis_names="HW", fill_value=fill)
        else:
            images = fn.decoders.image(encoded, device=decode_device, **decode_args)
            resized, position = fn.external_source(
                source=source, num_outputs=2, batch=True, dtype=[types.FLOAT, types.FLOAT]
            )
            images = fn.resize(images, resize_x=resized[0], resize_y=resized[1], antialias=True)
            crop = {"crop": (crop_size, crop_size), "crop_pos_x": position[0], "crop_pos_y": position[1]}
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT16 if dtype == torch.float16 else types.FLOAT,
            output_layout="HWC" if channels_last else "CHW",
            mean=[255 * m for m in mean],
            std=[255 * s for s in std],
            mirror=mirror,
            **crop,
        )
        label = fn.reshape(fn.cast(label, dtype=types.INT64), shape=[])
        return images, label.gpu() if cuda else label

    return pipeline()
