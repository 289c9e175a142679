"""From the folder to the batch: everything between ``--data.root`` and the images the model trains on.

The data flow, top to bottom::

    root/<split>/<class>/*.jpg
      -> folders       the scan of a split and its checks; the samples as numpy arrays (index)
      -> images        decoding on the CPU (pil, torchvision), a file's bytes and size (nvjpeg, dali)
      -> crops         the crop and flip of each sample, fixed by its seed (samplers), for every decoder
      -> datasets      (image, label) samples collated into uint8 batches; nvjpeg: encoded batches
      -> prefetch      on CUDA: copied, decoded (nvjpeg) and normalised one batch ahead
         dali/         or: read, decoded, cropped and normalised in an NVIDIA DALI pipeline
      -> datamodule    the LightningDataModule that composes them, one loader per split
"""
