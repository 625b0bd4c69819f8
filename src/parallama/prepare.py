"""`python -m parallama.prepare`: the same as parallama-prepare."""

from parallama.cli.prepare import main

if __name__ == "__main__":
    main()
