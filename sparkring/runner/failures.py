"""Reading rank failures: which failure is a cause and which only the echo of a lost peer."""
from __future__ import annotations

# How a rank fails when *another* rank died under it: its transport lost the peer.
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "was stopped:")


def is_secondary(traceback_text: str) -> bool:
    """True for a failure that only says a peer went away (the cause is another rank's error).

    >>> is_secondary("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    True
    """
    return any(sign in traceback_text for sign in _PEER_LOSS)
