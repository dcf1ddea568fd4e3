"""What names this process in Redis when no node id or producer name is configured."""

from __future__ import annotations

import os
import socket


def default_node_id() -> str:
    """``<hostname>-<pid>``: what names this process when no node id or producer name is set."""
    return f"{socket.gethostname()}-{os.getpid()}"
