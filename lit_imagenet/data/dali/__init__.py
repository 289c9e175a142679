"""NVIDIA DALI data path (``--data.decoder dali``): the pipeline graph (``pipeline``) and the loader (``loader``)."""

from lit_imagenet.data.dali.loader import HW_DECODER_LOAD, DALILoader, batch_dtype, dali_install_command, import_dali

__all__ = ["HW_DECODER_LOAD", "DALILoader", "batch_dtype", "dali_install_command", "import_dali"]
