"""User-facing errors.

A `UserError` is a mistake the user can fix (bad flag, bad checkpoint, bad request). Its message is one line
naming the flag, field or tensor and what to do. The CLI prints it without a traceback and exits non-zero;
the server turns it into an OpenAI-style 400.
"""


class UserError(Exception):
    """A problem with user input; the message names the thing and the fix."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded (missing/extra/mis-shaped tensor, bad config, corrupt file)."""
