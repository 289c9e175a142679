"""NVIDIA DALI data path (``--data.decoder dali``): read, decode, crop, resize, flip and normalise in DALI's threads.

``pipeline`` holds the pipeline graph and its external sources; ``loader`` the ``DALILoader`` that
builds, keeps and feeds the pipelines of a run.
"""

from lit_imagenet.data.dali.loader import HW_DECODER_LOAD, DALILoader, batch_dtype, dali_install_command, import_dali

__all__ = ["HW_DECODER_LOAD", "DALILoader", "batch_dtype", "dali_install_command", "import_dali"]
