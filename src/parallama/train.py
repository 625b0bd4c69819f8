"""`python -m parallama.train` (as torchrun's `-m` launches it, docs/strategies.md): the same as parallama-train."""

from parallama.cli.train import main

if __name__ == "__main__":
    main()
