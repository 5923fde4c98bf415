"""Python imports this at start-up from the first sitecustomize on sys.path: the engine
processes the harness starts (kvferry_dev/engines.py puts this folder first on their
PYTHONPATH). What it does and why: kvferry_nixl_poll.py."""

import kvferry_nixl_poll  # noqa: F401 - installs its import hook
