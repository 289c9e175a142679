"""The DALI pipeline graph (that of DALI's ResNet-50 example), and the external sources of its crops and sizes.

Nothing is drawn at random in the pipeline: the crop windows come from the samples' seeds
(``lit_imagenet.data.crops``) through an external source, so that a resumed epoch cuts the same crops again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from lit_imagenet.data.crops import crop_draws, crop_windows, eval_geometry, flips


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
    """A training pipeline's external source: each batch's crop windows and flips, from the samples' ``seeds``."""

    def __init__(
        self,
        indices: np.ndarray,
        seeds: np.ndarray,
        sizes: Callable[[np.ndarray], np.ndarray],
        batch_size: int,
        scale: tuple[float, float],
    ) -> None:
        super().__init__(indices, sizes, batch_size)
        self.seeds = np.asarray(seeds, dtype=np.uint64)
        self.scale = scale

    def __call__(self, iteration: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = self.rows(iteration)
        draws = crop_draws(self.seeds[rows], self.scale)
        box = crop_windows(self.sizes(self.indices[rows]), draws)
        anchor = np.ascontiguousarray(box[:, [1, 0]])  # DALI takes (x, y): left, top
        shape = np.ascontiguousarray(box[:, [3, 2]])  # and (width, height)
        return anchor, shape, flips(draws)


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
) -> Any:
    """A DALI pipeline yielding ``(images, labels)`` batches of ``files`` in order, cropped as ``source`` says
    (``CropSource``: resized crops and flips; ``GeometrySource``: centre crops). ``device_id`` ``None``: on the CPU."""
    from nvidia.dali import fn, pipeline_def, types

    cuda = device_id is not None
    decode_device = "mixed" if cuda else "cpu"
    # EXIF orientation is left alone, as PIL and torchvision.io leave it on the other paths.
    decode_args: dict[str, Any] = {"output_type": types.RGB, "adjust_orientation": False}
    if cuda:
        decode_args["hw_decoder_load"] = hw_decoder_load

    # seed: nothing is drawn in the pipeline, the crops come from the samples' seeds
    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id, seed=0)
    def pipeline() -> tuple[Any, Any]:
        encoded, label = fn.readers.file(
            files=files, labels=labels, random_shuffle=False, pad_last_batch=True, name="Reader"
        )
        mirror: Any = 0
        crop: dict[str, Any] = {}
        if isinstance(source, CropSource):
            anchor, box, mirror = fn.external_source(
                source=source, num_outputs=3, batch=True, dtype=[types.INT32, types.INT32, types.INT32]
            )
            images = fn.decoders.image_slice(
                encoded, anchor, box, normalized_anchor=False, normalized_shape=False, device=decode_device,
                **decode_args,
            )  # fmt: skip
            images = fn.resize(images, resize_x=crop_size, resize_y=crop_size, antialias=True)
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
