"""The LightningModule and what it trains with: network, metrics, optimizer, schedule, precision, strategies."""
