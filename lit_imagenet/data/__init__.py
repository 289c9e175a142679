"""From the folder to the batch: folders and index (the scan), images and crops (decoding and the crop rule),
datasets, prefetch (to the GPU, normalised), dali (DALI pipelines), and the datamodule that composes them."""
