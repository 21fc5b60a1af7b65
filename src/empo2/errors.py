"""The one base class of the errors a user can cause, in the lowest layer so every package can raise one.

A bad config key, an unknown task or model, missing Java or data, a run folder another run holds: each module keeps
its own subclass (callers and tests catch those by name), and the CLI catches :class:`UserError` once, printing its
message as one line and exiting with code 2.
"""


class UserError(Exception):
    """An error the user can fix (input, files, machine); its message is the whole explanation, shown as one line."""
