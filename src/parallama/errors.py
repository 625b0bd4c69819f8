"""One exception type for bad input, so the CLIs can print it as one line instead of a traceback."""


class ConfigError(ValueError):
    """Bad user input (a config key, a file, a checkpoint). The message names it and says what is valid."""


class TrainingDiverged(FloatingPointError):
    """The loss became NaN/inf; raised before the optimizer step so the last checkpoint stays good."""
