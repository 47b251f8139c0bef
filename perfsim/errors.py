"""The one exception type that means "the user's input is wrong".

The CLI turns it into `perfsim: error: <message>` and exit status 2; anything else that escapes
is a bug and keeps its traceback.
"""


class PerfsimError(ValueError):
    """Bad input: the message says what is wrong and how to fix it, in one line."""
