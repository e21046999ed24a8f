"""The Hugging Face hub: load from the local cache first, find out at once when the hub cannot be reached, and turn
what loading raises into one line that names the flag."""

import os
from collections.abc import Callable
from contextlib import contextmanager

from safetensors import SafetensorError

# What loading raises for a folder or hub id without a loadable model: missing files, an unreachable hub and unknown
# repositories (OSError), a tokenizer that cannot be built (ValueError, ImportError), damaged weights (SafetensorError).
LOAD_ERRORS = (OSError, ValueError, ImportError, SafetensorError)


def first_line(error: Exception) -> str:
    """'ErrorType: the first line of its message', at most 300 characters: the reason in a one-line refusal."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]


def load_local_first(load: Callable, path: str):
    """load(**kwargs) of a `from_pretrained` call. A folder loads as it is; a hub id loads from the local Hugging Face
    cache first, so that a cached model loads offline at once, and from the hub only if it is not cached there."""
    if os.path.isdir(path):
        return load()
    try:
        return load(local_files_only=True)
    except OSError:
        if reason := hub_unreachable():
            raise SystemExit(
                f"--model-name-or-path {path!r}: not in the local Hugging Face cache, and the hub cannot be reached "
                f"({reason}). Without internet, pass a local folder saved with save_pretrained"
            ) from None
        return load()


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached, or None when it accepts a connection. One TCP connection with a short
    timeout, so that an offline machine is told so at once rather than after the hub client's minute of retries. With
    HF_HUB_OFFLINE set the answer says so; behind a proxy we cannot probe, so we let the hub client try."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout).close()
    except OSError as e:
        return f"{url.hostname}: {e.strerror or type(e).__name__}"
    return None


@contextmanager
def offline_unless_hub_reachable():
    """Load data sets in offline mode (the local cache only, at once) when the hub cannot be reached: a cached data set
    then loads without a minute of retries, and a missing one fails at once."""
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = saved or hub_unreachable() is not None
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved
