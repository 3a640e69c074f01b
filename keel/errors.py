"""Errors a user can act on. The CLI turns any `InputError` into one line on stderr and exit 2."""


class InputError(ValueError):
    """Bad input: the message names the input, the key and what was expected."""


class RunFailed(RuntimeError):
    """The work itself failed (exit code 1), for example a run that could not absorb a fault."""
