"""Reaching the Hugging Face hub: fail fast and clearly offline instead of retrying for half a minute."""

import os
import socket
from functools import cache

HUB_HOST = "huggingface.co"


def offline_mode() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


@cache
def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the hub; False under HF_HUB_OFFLINE=1 or without network."""
    if offline_mode():
        return False
    try:
        with socket.create_connection((HUB_HOST, 443), timeout=timeout):
            return True
    except OSError:
        return False
