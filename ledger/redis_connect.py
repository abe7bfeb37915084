"""How every Tandem process reaches the ledger's Redis: URL, ACL user, password and TLS.

A password need not appear on a command line (where `ps` shows it): it may come from
``--redis-password-file`` or ``$TANDEM_REDIS_PASSWORD``, which is how the launcher hands
it to its children. ``connect`` PINGs once, so a wrong password, a TLS failure or an
unreachable server stops a process at startup with a message saying what to check.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

if TYPE_CHECKING:  # imported where used: `tandem --help` builds these options, and stays fast
    import redis

PASSWORD_ENV = "TANDEM_REDIS_PASSWORD"
CERT_REQS = ("required", "optional", "none")
CONNECT_TIMEOUT_S = 10.0


class RedisConnectError(RuntimeError):
    """The ledger's Redis cannot be used as configured (bad options, unreachable, refused);
    the message says what to check."""


@dataclass(frozen=True)
class RedisSettings:
    """Where the ledger's Redis is and how to authenticate to it."""

    url: str  # redis://, rediss:// (TLS) or unix://; user:password@ in it move to the fields
    username: str | None = None  # ACL user; None: the URL's, else Redis's "default"
    password: str | None = field(default=None, repr=False)  # None: the URL's
    ca_file: str | None = None  # CA bundle that verifies the server; None: the system's
    cert_file: str | None = None  # client certificate, for servers with tls-auth-clients
    key_file: str | None = None  # its private key (None: inside cert_file)
    cert_reqs: str = "required"  # verification of the server's certificate

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"--redis-url: redis://, rediss:// (TLS) or unix://, got {parts.scheme}:"
            )
        if self.cert_reqs not in CERT_REQS:
            raise ValueError(f"--redis-cert-reqs: one of {', '.join(CERT_REQS)}")
        tls_options = (self.ca_file, self.cert_file, self.key_file)
        if not self.is_tls and any(tls_options):
            raise ValueError(
                "--redis-ca-file, --redis-cert-file, --redis-key-file: TLS options need a "
                f"rediss:// URL, got {parts.scheme}://"
            )
        if self.key_file and not self.cert_file:
            raise ValueError("--redis-key-file: needs --redis-cert-file")
        if parts.username and self.username is None:
            object.__setattr__(self, "username", unquote(parts.username))
        if parts.password and self.password is None:
            object.__setattr__(self, "password", unquote(parts.password))
        if "@" in parts.netloc:  # credentials live in the fields above, never in the URL
            host = parts.netloc.rsplit("@", 1)[1]
            object.__setattr__(self, "url", urlunsplit(parts._replace(netloc=host)))

    @property
    def is_tls(self) -> bool:
        return self.url.startswith("rediss://")

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, environ: Mapping[str, str] = os.environ
    ) -> RedisSettings:
        """From the options ``add_redis_arguments`` adds. The password: the file, else
        ``$TANDEM_REDIS_PASSWORD``, else the URL's."""
        password = environ.get(PASSWORD_ENV) or None
        if args.redis_password_file:
            path = Path(args.redis_password_file)
            try:
                password = path.read_text().rstrip("\r\n")
            except OSError as e:
                raise RedisConnectError(
                    f"--redis-password-file: cannot read {path}: {e.strerror}"
                ) from None
        try:
            return cls(
                url=args.redis_url,
                username=args.redis_username,
                password=password,
                ca_file=args.redis_ca_file,
                cert_file=args.redis_cert_file,
                key_file=args.redis_key_file,
                cert_reqs=args.redis_cert_reqs,
            )
        except ValueError as e:
            raise RedisConnectError(str(e)) from None

    def to_args(self) -> list[str]:
        """Options that give a child process these settings, all but the password."""
        args = ["--redis-url", self.url]
        for option, value in (
            ("--redis-username", self.username),
            ("--redis-ca-file", self.ca_file),
            ("--redis-cert-file", self.cert_file),
            ("--redis-key-file", self.key_file),
        ):
            if value:
                args += [option, value]
        if self.is_tls:
            args += ["--redis-cert-reqs", self.cert_reqs]
        return args

    def to_env(self) -> dict[str, str]:
        """The environment that carries the password to a child (``to_args`` leaves it out)."""
        return {PASSWORD_ENV: self.password} if self.password else {}

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``redis.Redis.from_url(self.url, ...)``."""
        kwargs: dict[str, Any] = {"username": self.username, "password": self.password}
        if self.is_tls:
            kwargs.update(
                ssl_ca_certs=self.ca_file,
                ssl_certfile=self.cert_file,
                ssl_keyfile=self.key_file,
                ssl_cert_reqs=self.cert_reqs,
                ssl_check_hostname=self.cert_reqs != "none",
            )
        return kwargs


def add_redis_arguments(parser: Any, *, required: bool, url_help: str | None = None) -> None:
    """The options ``RedisSettings.from_args`` reads; ``parser``: a parser or argument group."""
    parser.add_argument(
        "--redis-url",
        required=required,
        metavar="URL",
        help=url_help
        or "the ledger's Redis: redis://HOST:PORT/DB, rediss://... for TLS, or unix://PATH. "
        f"It may carry USER:PASSWORD@, but then ps shows the password: prefer "
        f"--redis-password-file or ${PASSWORD_ENV}",
    )
    parser.add_argument(
        "--redis-username",
        metavar="NAME",
        help="Redis ACL user (default: the URL's, else Redis's 'default' user)",
    )
    parser.add_argument(
        "--redis-password-file",
        metavar="PATH",
        help=f"read the Redis password from this file (trailing newline dropped); without it "
        f"${PASSWORD_ENV}, else the URL's password, is used",
    )
    parser.add_argument(
        "--redis-ca-file",
        metavar="PATH",
        help="rediss://: PEM CA bundle that signed the server's certificate (default: the "
        "system's CAs)",
    )
    parser.add_argument(
        "--redis-cert-file",
        metavar="PATH",
        help="rediss://: PEM client certificate, for servers that require one "
        "(tls-auth-clients yes)",
    )
    parser.add_argument(
        "--redis-key-file",
        metavar="PATH",
        help="rediss://: the client certificate's PEM private key (default: inside "
        "--redis-cert-file)",
    )
    parser.add_argument(
        "--redis-cert-reqs",
        choices=CERT_REQS,
        default="required",
        help="rediss://: verification of the server's certificate and host name; 'none' "
        "encrypts without knowing who answers (default: required)",
    )


def connect(settings: RedisSettings, **kwargs: Any) -> redis.Redis:
    """A redis-py client of ``settings`` that has answered one PING (keyword arguments go
    to ``Redis.from_url``); failures raise RedisConnectError saying what to check."""
    import redis

    for option, path in (
        ("--redis-ca-file", settings.ca_file),
        ("--redis-cert-file", settings.cert_file),
        ("--redis-key-file", settings.key_file),
    ):
        if path and not os.path.isfile(path):  # else redis-py says "Error 2 connecting to"
            raise RedisConnectError(f"{option}: no such file: {path}")
    kwargs = {"socket_connect_timeout": CONNECT_TIMEOUT_S, **settings.client_kwargs(), **kwargs}
    try:
        client = redis.Redis.from_url(settings.url, **kwargs)
    except (ValueError, OSError) as e:  # bad URL options, unreadable certificate files
        raise RedisConnectError(f"redis {settings.url}: {e}") from None
    try:
        client.ping()
    except (redis.RedisError, OSError) as e:
        client.close()
        raise RedisConnectError(explain(e, settings)) from None
    return client


def explain(error: BaseException, settings: RedisSettings) -> str:
    """One line on what failed talking to Redis and which options to check."""
    import redis

    where = f"redis {settings.url}"
    user = settings.username or "default"
    if isinstance(error, redis.AuthenticationError) or "WRONGPASS" in str(error):
        if settings.password is None:
            return (
                f"{where}: the server requires a password ({error}); give it with "
                f"--redis-password-file or ${PASSWORD_ENV}"
            )
        return (
            f"{where}: authentication as user {user!r} failed ({error}); check "
            f"--redis-username and the password (--redis-password-file, ${PASSWORD_ENV} "
            "or the URL)"
        )
    if isinstance(error, redis.exceptions.NoPermissionError):
        return (
            f"{where}: user {user!r} lacks a permission ({error}); the ledger needs its "
            "namespace's keys (~NS:*) and +@read +@write +@scripting +ping +time"
        )
    if isinstance(error, redis.ResponseError) and "AUTH" in str(error):
        return (
            f"{where}: the server has no password set but one was given ({error}); drop "
            f"the password or {PASSWORD_ENV}"
        )
    if _is_tls_error(error):
        return (
            f"{where}: TLS handshake failed ({error}); check --redis-ca-file (the CA that "
            "signed the server's certificate), that the certificate names the host in the "
            "URL, --redis-cert-file/--redis-key-file if the server requires client "
            "certificates, and that the port speaks TLS"
        )
    if isinstance(error, redis.ConnectionError | redis.TimeoutError | OSError):
        hint = "that the port speaks TLS" if settings.is_tls else "rediss:// if it speaks TLS"
        return (
            f"{where}: cannot reach Redis ({error}); check the host and port in --redis-url, "
            f"that redis-server runs there, and {hint}"
        )
    return f"{where}: {type(error).__name__}: {error}"


def _is_tls_error(error: BaseException) -> bool:
    import ssl

    if "SSL" in str(error):  # redis-py folds the ssl error's text into a ConnectionError
        return True
    cause = error.__cause__ or error.__context__
    return isinstance(error, ssl.SSLError) or (cause is not None and _is_tls_error(cause))
