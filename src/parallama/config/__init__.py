"""The Hydra config: how a command line becomes a composed config (`compose`) and what it must satisfy (`checks`)."""
