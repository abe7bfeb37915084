"""The `tandem` command's exit codes, and the one line on stderr that says what failed
and what to do, for each kind of failure a script handles differently."""

from __future__ import annotations

from enum import IntEnum

from tandem_client.errors import (
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    TandemError,
    Unauthenticated,
    Unavailable,
)


class ExitCode(IntEnum):
    """What `tandem COMMAND` returns; `tandem --help` lists them (EXIT_CODES_HELP)."""

    OK = 0
    ERROR = 1  # anything else: the router failed the request, two plugins claim a name...
    USAGE = 2  # a wrong command line (argparse's own code), or a command needing tandem-server
    UNAVAILABLE = 3  # the router cannot be reached, is not SERVING, or had no worker
    INVALID_REQUEST = 4  # the router refused the request (its message names the field)
    TIMEOUT = 5  # no answer within --timeout
    OVERLOADED = 6  # the cluster has no room now
    UNAUTHENTICATED = 7  # the router refused the credentials (--token)
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)


EXIT_CODES_HELP = """\
exit codes:
  0    success (`tandem health`: the router is SERVING)
  1    any other error
  2    wrong command line, or a command that needs the tandem-server distribution
  3    the router is unreachable, not SERVING (workers starting, lost, or a drain)
  4    the router refused the request (the message names the field)
  5    timed out (--timeout)
  6    the cluster is overloaded; retry later
  7    the router refused the credentials (--token)
  130  interrupted (Ctrl-C)"""


def exit_code(error: TandemError) -> ExitCode:
    """The exit code of a failed call."""
    if isinstance(error, Unavailable):
        return ExitCode.UNAVAILABLE
    if isinstance(error, InvalidRequest | NotFound):
        return ExitCode.INVALID_REQUEST
    if isinstance(error, DeadlineExceeded):
        return ExitCode.TIMEOUT
    if isinstance(error, Overloaded):
        return ExitCode.OVERLOADED
    if isinstance(error, Unauthenticated):
        return ExitCode.UNAUTHENTICATED
    return ExitCode.ERROR


def error_line(command: str, error: TandemError, address: str, timeout_s: float | None) -> str:
    """One line saying what happened to a call to the router at ``address`` and what to
    do about it (the server's message kept, on one line)."""
    message = " ".join(error.message.split())
    if isinstance(error, Unavailable):
        what = (
            f"the router at {address} is unavailable ({message}); check that `tandem serve` "
            "runs there, or pass --router HOST:PORT (or set TANDEM_ROUTER)"
        )
    elif isinstance(error, InvalidRequest | NotFound):
        what = f"the router refused the request: {message}; correct that option and try again"
    elif isinstance(error, DeadlineExceeded):
        within = f"within {timeout_s:g} s" if timeout_s is not None else "in time"
        what = (
            f"no answer {within} ({message}); raise --timeout, or ask for fewer tokens "
            "(--max-tokens)"
        )
    elif isinstance(error, Overloaded):
        what = f"the cluster is overloaded ({message}); retry later"
    elif isinstance(error, Unauthenticated):
        what = f"the router refused the credentials ({message}); pass --token (or set TANDEM_TOKEN)"
    else:
        what = f"the router failed the request: {error.code.name}: {message}"
    return f"tandem {command}: error: {what}"
