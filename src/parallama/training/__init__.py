"""The training run: the LightningModule, its callbacks, loggers and progress display."""
