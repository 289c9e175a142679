"""GPU decoding (``--data.decoder nvjpeg``): workers read the JPEG bytes and draw the crops into an ``EncodedBatch``,
which ``decode`` turns into uint8 images on the device; the workers decode the rest (``gpu_share``, other formats)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.io import ImageReadMode, decode_jpeg

from lit_imagenet.data.augment import Augment, apply_policy, erase_boxes, policy_transform
from lit_imagenet.data.crops import CropBox, center_crop_box, crop_and_flip
from lit_imagenet.data.datasets import ImageFolderDataset
from lit_imagenet.data.images import decode_rgb_bytes, gpu_decodable, image_size, load_rgb_tensor, read_bytes


class EncodedImage(NamedTuple):
    """One encoded JPEG, its crop box, output side and flip; in training, its ``seed`` (used with ``augment``)."""

    data: Tensor
    box: CropBox
    size: int
    flip: bool
    path: str
    seed: int | None = None
    augment: Augment | None = None


def gpu_share_picks(index: int, share: float) -> bool:
    """Whether sample ``index`` is one of the ``share`` of the data decoded on the GPU (fixed per sample)."""
    return ((index * 2654435761) & 0xFFFFFFFF) < share * 2**32  # Knuth's multiplicative hash: an even spread


class EncodedImageFolderDataset(ImageFolderDataset):
    """Samples for GPU decoding: ``(EncodedImage, class index)``, or a worker-decoded crop for the rest.

    Args:
        transform: The CPU transform for the images decoded here (for training, with ``augment`` applied).
        samples, train, crop_size, crop_scale, val_resize: As in ``DALILoader``.
        gpu_share: Fraction of the images decoded on the GPU.
        augment: Training only: the augmentations of the images decoded on the GPU, from each sample's seed as on
            the workers (but for AugMix's mixing weights, which torch draws on the GPU's generator).
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        transform: Callable[[Any], Any],
        train: bool,
        crop_size: int,
        crop_scale: tuple[float, float],
        val_resize: int,
        gpu_share: float = 1.0,
        augment: Augment | None = None,
    ) -> None:
        super().__init__(samples, transform, load_rgb_tensor)
        self.train = train
        self.crop_size = crop_size
        self.crop_scale = crop_scale
        self.val_resize = val_resize
        self.gpu_share = gpu_share
        self.augment = augment if train and augment else None

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[Any, int]:
        index, seed = item if isinstance(item, tuple) else (item, None)
        path, target = self.samples[index]
        if not gpu_share_picks(index, self.gpu_share):
            return super().__getitem__(item)
        data = read_bytes(path)
        if not gpu_decodable(data):
            return super().__getitem__(item)
        height, width = image_size(path, data)
        if not self.train:
            box = center_crop_box(height, width, self.val_resize, self.crop_size)
            return EncodedImage(data, box, self.crop_size, False, path), target
        if self.augment is not None and seed is None:  # drawn as crop_and_flip would: the augmentation shares it
            seed = int(torch.randint(0, 2**62, (1,)).item())
        box, flip = crop_and_flip(height, width, seed, self.crop_scale)  # the rule of every decoder
        return EncodedImage(data, box, self.crop_size, flip, path, seed, self.augment), target


_policy = functools.cache(policy_transform)  # one transform per ``Augment``, not one per batch


@dataclass(frozen=True)
class GPUAugment:
    """``augment`` from each ``seed`` on a batch's images decoded on the device; apart from ``decode``, so that the
    training thread runs it, not the prefetcher's: the policy seeds torch's generators, which that thread draws from."""

    positions: list[int]
    seeds: list[int]
    augment: Augment

    def __call__(self, images: Tensor) -> Tensor:
        """``images`` (uint8 ``(N, 3, S, S)``) with the policy, then the erasing, applied at ``positions``, in place."""
        transform = _policy(self.augment)
        if transform is not None:
            for pos, seed in zip(self.positions, self.seeds):
                images[pos] = apply_policy(transform, images[pos], seed)
        if self.augment.random_erase > 0:  # one mask for the batch: a kernel or two, not one per image
            height, width = images.shape[-2:]
            boxes = erase_boxes(self.seeds, height, width, self.augment.random_erase)  # 0 x 0 ones erase nothing
            top, left, tall, wide = torch.from_numpy(boxes).to(images.device).unbind(1)
            rows, cols = torch.arange(height, device=images.device), torch.arange(width, device=images.device)
            in_rows = (rows >= top[:, None]) & (rows < (top + tall)[:, None])
            in_cols = (cols >= left[:, None]) & (cols < (left + wide)[:, None])
            mask = (in_rows[:, :, None] & in_cols[:, None, :])[:, None]
            where = torch.tensor(self.positions, dtype=torch.int64, device=images.device)
            fill = torch.tensor(self.augment.fill, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
            images.index_copy_(0, where, torch.where(mask, fill, images.index_select(0, where)))
        return images


@dataclass
class EncodedBatch:
    """A batch whose images are still (partly) encoded; ``decode`` turns it into ``[uint8 images, targets]``.

    Attributes:
        targets: int64 ``(N,)`` labels, in batch order.
        blob: uint8, the encoded files end to end (a tensor each would hold a shared-memory file descriptor each);
            ``lengths``: their sizes in bytes; ``crops``: each one's crop box, whether to mirror it, and its path.
        encoded_positions, decoded_positions: The positions in the batch of the encoded and the decoded images.
        decoded: uint8 ``(M, 3, S, S)`` images the workers decoded (and augmented), or ``None``.
        size, memory_format: The side ``S`` and the memory format of the output batch.
        seeds, augment: The encoded images' augmentation seeds and their augmentations, or ``[]`` and ``None``.
    """

    targets: Tensor
    blob: Tensor
    lengths: list[int]
    crops: list[tuple[CropBox, bool, str]]
    encoded_positions: list[int]
    decoded: Tensor | None
    decoded_positions: list[int]
    size: int
    memory_format: torch.memory_format = field(default=torch.contiguous_format)
    seeds: list[int] = field(default_factory=list)
    augment: Augment | None = None

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    @property
    def encoded(self) -> list[EncodedImage]:
        """The images to decode on the device, their bytes as slices of ``blob``."""
        seeds: list[int | None] = list(self.seeds) if self.augment is not None else [None] * len(self.crops)
        parts = zip(self.blob.split(self.lengths), self.crops, seeds)
        return [
            EncodedImage(data, box, self.size, flip, path, seed, self.augment)
            for data, (box, flip, path), seed in parts
        ]

    @property
    def gpu_augment(self) -> GPUAugment | None:
        """The augmentations ``decode`` applies to the images it decodes, or ``None``."""
        if self.augment is None or not self.encoded_positions:
            return None
        return GPUAugment(self.encoded_positions, self.seeds, self.augment)

    def pin_memory(self) -> EncodedBatch:
        """Pins the labels, the worker-decoded images and the encoded bytes (which nvJPEG then reads)."""
        return replace(
            self,
            targets=self.targets.pin_memory(),
            blob=self.blob.pin_memory(),
            decoded=self.decoded.pin_memory() if self.decoded is not None else None,
        )

    def decode(self, device: torch.device | str, augment: bool = True) -> list[Tensor]:
        """``[uint8 (N, 3, S, S) images, int64 (N,) targets]`` on ``device``, the JPEGs decoded there and, with
        ``augment``, augmented (``gpu_augment``; else left to the caller). Raises ``DataError`` naming a bad file."""
        device = torch.device(device)
        side = [self.size, self.size]
        images = torch.empty((len(self), 3, *side), dtype=torch.uint8, device=device, memory_format=self.memory_format)
        if self.decoded is not None and self.decoded_positions:
            where = torch.tensor(self.decoded_positions, dtype=torch.int64, device=device)
            images.index_copy_(0, where, self.decoded.to(device, non_blocking=True))
        encoded = self.encoded
        if encoded:
            pictures = _decode_all(encoded, device)
            boxes = [list(item.box) for item in encoded]
            flips = [k for k, item in enumerate(encoded) if item.flip]
            out = _scripted_resize_crops()(pictures, boxes, flips, self.size)
            where = torch.tensor(self.encoded_positions, dtype=torch.int64, device=device)
            images.index_copy_(0, where, out)
            if augment and self.gpu_augment is not None:
                images = self.gpu_augment(images)
        return [images, self.targets.to(device, non_blocking=True)]


def resize_crops(pictures: list[Tensor], boxes: list[list[int]], flips: list[int], size: int) -> Tensor:
    """Crops ``boxes[k]`` (top, left, height, width), resizes to ``size`` squared and mirrors ``flips``: uint8 NCHW."""
    resized = torch.empty((len(pictures), 3, size, size), dtype=torch.float32, device=pictures[0].device)
    for k in range(len(pictures)):
        box = boxes[k]
        crop = pictures[k][:, box[0] : box[0] + box[2], box[1] : box[1] + box[3]].unsqueeze(0).float()
        resized[k] = F.interpolate(crop, size=[size, size], mode="bilinear", antialias=True)[0]
    out = resized.round_().clamp_(0, 255).to(torch.uint8)
    if len(flips) > 0:  # mirrored in uint8: a quarter of the bytes of the float images
        which = torch.tensor(flips, dtype=torch.int64, device=out.device)
        out.index_copy_(0, which, out.index_select(0, which).flip(-1))
    return out


@functools.cache
def _scripted_resize_crops() -> Callable[[list[Tensor], list[list[int]], list[int], int], Tensor]:
    """``resize_crops`` compiled by TorchScript (so its loop does not take the GIL per operator), else itself."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript is deprecated in favour of torch.compile, which
            return torch.jit.script(resize_crops)  # cannot compile a loop over pictures of varying sizes
    except Exception:  # a PyTorch without TorchScript
        return resize_crops


def _decode_all(items: Sequence[EncodedImage], device: torch.device) -> list[Tensor]:
    """Decodes all images in one batched call; if that fails, one by one, to name the bad file."""
    try:
        return list(decode_jpeg([item.data for item in items], mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        pass
    out = []
    for item in items:
        try:
            out.append(decode_jpeg(item.data, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            out.append(decode_rgb_bytes(item.data, item.path).to(device))  # the JPEGs nvJPEG does not take
    return out


def collate_encoded(batch: Sequence[tuple[Any, int]], memory_format: torch.memory_format) -> EncodedBatch:
    """Collates ``(EncodedImage or uint8 (3, S, S) tensor, label)`` pairs into an ``EncodedBatch``."""
    sides = [item.size if isinstance(item, EncodedImage) else int(item.shape[-1]) for item, _ in batch]
    for pos, side in enumerate(sides):
        if side != sides[0]:
            raise ValueError(f"All images of a batch need one size. Image 0 is {sides[0]}, image {pos} is {side}")
    encoded = [(pos, item) for pos, (item, _) in enumerate(batch) if isinstance(item, EncodedImage)]
    decoded = [(pos, item) for pos, (item, _) in enumerate(batch) if not isinstance(item, EncodedImage)]
    return EncodedBatch(
        targets=torch.tensor([int(t) for _, t in batch], dtype=torch.int64),
        blob=torch.cat([item.data.reshape(-1) for _, item in encoded] or [torch.empty(0, dtype=torch.uint8)]),
        lengths=[int(item.data.numel()) for _, item in encoded],
        crops=[(item.box, item.flip, item.path) for _, item in encoded],
        encoded_positions=[pos for pos, _ in encoded],
        decoded=torch.stack([item for _, item in decoded]) if decoded else None,
        decoded_positions=[pos for pos, _ in decoded],
        size=sides[0],
        memory_format=memory_format,
        seeds=[int(item.seed) for _, item in encoded if item.augment is not None],
        augment=next((item.augment for _, item in encoded if item.augment is not None), None),
    )
