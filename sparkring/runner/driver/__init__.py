"""The driver side of the runner: the launch plan, what the session offers, the barrier stage
and how its ranks are followed, the environment check, TorchDistributor. Imports the task side
(to ship it) and the shared modules of ``sparkring.runner``; the task side never imports it."""
