"""Errors a user can act on. The CLI turns any `InputError` into one line on stderr and exit 2."""


def one_line(text: str) -> str:
    """`text` with every character that is not printable (newlines, tabs, other control
    characters) written as its escape, so that a message quoting the input stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class InputError(ValueError):
    """Bad input: the message names the input, the key and what was expected; always one line
    (a quoted key or file name with a newline in it is escaped)."""

    def __init__(self, message: str = "", *rest: object):
        super().__init__(one_line(str(message)), *rest)


class RunFailed(RuntimeError):
    """The work itself failed (exit code 1), for example a run that could not absorb a fault."""


def read_input(path, what: str, error: type[InputError] = InputError) -> str:
    """The text of an input file; a missing or unreadable one is `error`, naming the file."""
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory; expected a {what} file") from None
    except OSError as e:
        raise error(f"{path}: cannot read the {what} file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x}); "
                    f"expected a {what} file in UTF-8") from None
