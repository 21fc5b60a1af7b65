"""Helpers the tests import (``from helpers.processes import kill_tree``) and the scripts they run as child processes
(torchrun workers, the CLI held in a phase); none of them is a test. ``tests/`` is on ``sys.path`` under pytest, so
``helpers`` is found there."""
