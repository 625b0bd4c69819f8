"""What this machine's environment says of W&B, without importing it or Lightning: the command line's checks read
it before any work, the loggers when they pick `mode: auto` (training/loggers.py)."""

from __future__ import annotations

import netrc
import os
from urllib.parse import urlparse


def wandb_api_key_configured() -> bool:
    """WANDB_API_KEY, or `wandb login`'s netrc entry for the W&B host."""

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False
