"""The one exception type that means "the user's input is wrong", and the suggestion its
messages give for a misspelt name.

The CLI turns it into `perfsim: error: <message>` and exit status 2; anything else that escapes
is a bug and keeps its traceback.
"""


class PerfsimError(ValueError):
    """Bad input: the message says what is wrong and how to fix it, in one line."""


def one_line(text: str) -> str:
    """`text` as one line of a message: a newline a path or value holds is shown as \\n."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


def did_you_mean(word, choices) -> str:
    """' (did you mean X?)' when one of `choices` is close to a misspelt `word`, else ''."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
