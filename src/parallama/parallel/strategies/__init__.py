"""One module per strategy family of the Hydra `strategy` group."""
