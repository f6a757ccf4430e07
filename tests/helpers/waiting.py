"""Waiting for what happens asynchronously (a process gone, a thread stopped, a frame received): one
polling helper, so that no test sleeps a fixed time for an effect."""
import time
from typing import Callable


def wait_until(condition: Callable[[], bool], timeout: float, every: float = 0.05) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds have passed; whether it held."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(every)
