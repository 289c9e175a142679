"""The LightningModule and what it trains with: the network, metrics, optimizer, schedule, precision, strategies.

``module.ImageClassifier`` is the LightningModule; ``models`` builds the torchvision network and
splits it into head and backbone; ``metrics`` holds top-1/top-5, exact across ranks; ``optim`` and
``schedule`` the reference's SGD and learning-rate rule; ``precision`` the apex AMP plugin and the
native equivalents of the reference's AMP flags; ``strategies`` the DDP variants the command line
registers; ``readback`` reads GPU values on the host without waiting for the GPU's queue.
"""
