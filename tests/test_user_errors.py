"""Errors a user can cause share one base, :class:`empo2.errors.UserError`, and the CLI catches that one type.

Each module keeps its own subclass (callers catch ``ConfigError``, ``EnvError`` … by name). The real paths that raise
them through the CLI are tested where the input is made: a bad config value (test_faults_input.py), an unknown task
or model, a held or read-only run folder (test_faults_input.py, test_faults.py), a damaged memory file
(test_memory_cli.py). Here every type goes through the CLI's one handler, so a type left off the base would end in a
traceback instead of one line.
"""

from __future__ import annotations

import importlib

import pytest

from empo2.cli import app as cli
from empo2.errors import UserError

USER_ERRORS = [
    ("empo2.config", "ConfigError"),
    ("empo2.rundir.checkpoint", "CheckpointError"),
    ("empo2.envs.base", "EnvError"),
    ("empo2.envs.failures", "EnvFailuresError"),
    ("empo2.policy.loader", "ModelLoadError"),
    ("empo2.policy.backend", "BackendError"),
    ("empo2.memory.store", "MemoryStoreError"),
    ("empo2.memory.validate", "DimensionMismatchError"),
    ("empo2.memory.embedder", "EmbedderError"),
    ("empo2.memory.commands", "MemoryCliError"),
    ("empo2.rundir.runlock", "RunLockError"),
    ("empo2.rundir.storage", "RunWriteError"),
]
"""Every user error type, by the module callers import it from."""


def _error_type(module: str, name: str) -> type[Exception]:
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("module,name", USER_ERRORS)
def test_each_user_error_is_a_user_error(module, name):
    assert issubclass(_error_type(module, name), UserError)


@pytest.mark.parametrize("module,name", USER_ERRORS)
def test_each_user_error_reaches_the_cli_as_one_line_and_exit_2(module, name, monkeypatch, capsys, tmp_path):
    error = _error_type(module, name)
    message = f"{name}: the input named here is wrong (x=1)"

    def fails(args):
        raise error(message)

    monkeypatch.setattr(cli, "cmd_report", fails)
    assert cli.main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {message}\n"
    assert captured.out == ""


def test_an_error_that_is_not_the_users_is_not_swallowed(monkeypatch, tmp_path):
    """A bug keeps its traceback: only :class:`UserError` becomes one line."""

    def fails(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_report", fails)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["report", str(tmp_path), "--out", str(tmp_path / "out")])
