"""Reading rank failures: which failure is a cause and which only the echo of a lost peer."""
from __future__ import annotations

from ..errors import is_peer_loss


def is_secondary(traceback_text: str) -> bool:
    """True for a failure that only says a peer went away (the cause is another rank's error).

    >>> is_secondary("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    True
    """
    return is_peer_loss(traceback_text)
