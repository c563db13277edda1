"""Which Redis deployment a URL names: one server, a Sentinel-managed master, or a Cluster.

    redis://[[user]:password@]host[:port][/db][?...]     one server, parsed by redis-py as before
    rediss://...  unix:///path/to.sock?db=0               (TLS; a Unix socket)
    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<service>[/<db>][?options]
    redis+cluster://[[user]:password@]host[:port][,host[:port]...][?options]

Sentinel ports default to 26379, cluster ports to 6379; IPv6 hosts go in brackets. The user and
password are the data nodes' (percent-encode reserved characters); sentinels that require a
password of their own take ``sentinel_password``. Options, for the two multi-host forms only:

    failover_timeout=<s>    how long one command keeps retrying through a failover (default 10)
    wait_replicas=<n>       replicas that must confirm each write before it returns (default 1;
                            0: do not wait, and accept losing writes acknowledged just before
                            a master dies)
    wait_timeout_ms=<ms>    how long a write waits for those confirmations (default 50)
    sentinel_password=<p>   (sentinel only)

The deployment is in the scheme rather than in a separate mode setting so that one value says
everything: the URL and the mode cannot disagree, and every tool that takes a Redis URL (the
gateway, ``ivr calls``) understands all three without a second option.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from ivr.errors import ConfigError

Mode = Literal["single", "sentinel", "cluster"]
_N = TypeVar("_N", int, float)

SINGLE_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_PORTS = {"sentinel": 26379, "cluster": 6379}
DEFAULT_FAILOVER_TIMEOUT = 10.0
DEFAULT_WAIT_REPLICAS = 1
DEFAULT_WAIT_TIMEOUT_MS = 50
_OPTIONS = {
    "sentinel": ("failover_timeout", "wait_replicas", "wait_timeout_ms", "sentinel_password"),
    "cluster": ("failover_timeout", "wait_replicas", "wait_timeout_ms"),
}


@dataclass(frozen=True, slots=True)
class RedisTarget:
    mode: Mode
    url: str  # as given; a single server's is handed to redis-py unchanged
    nodes: tuple[tuple[str, int], ...] = ()  # sentinels, or cluster startup nodes
    service: str = ""  # the sentinel service (``sentinel monitor <service> ...``)
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    # A single server has no failover to wait for: fail at once so the caller degrades.
    failover_timeout: float = 0.0
    wait_replicas: int = 0
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS


def parse_redis_url(url: str) -> RedisTarget:
    """The deployment ``url`` names; ``ConfigError`` naming the bad part if it is malformed."""
    scheme, sep, _ = url.partition("://")
    scheme = scheme.lower()
    if sep and scheme in SINGLE_SCHEMES:
        return RedisTarget(mode="single", url=url)
    mode: Mode
    if sep and scheme == "redis+sentinel":
        mode = "sentinel"
    elif sep and scheme == "redis+cluster":
        mode = "cluster"
    elif sep and scheme in ("rediss+sentinel", "rediss+cluster"):
        raise _bad(url, f"TLS to a sentinel or cluster ({scheme}://) is not supported yet")
    else:
        raise _bad(
            url,
            f"unknown scheme {scheme!r}: use redis://, rediss://, unix://, "
            "redis+sentinel://host:26379,.../<service>/<db> or redis+cluster://host:6379,...",
        )
    return _parse_multi_host(url, mode)


def _parse_multi_host(url: str, mode: Literal["sentinel", "cluster"]) -> RedisTarget:
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unbalanced '[' around an IPv6 host
        raise _bad(url, str(exc)) from None
    if parts.fragment:
        raise _bad(url, f"unexpected fragment '#{parts.fragment}'")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, password = _credentials(userinfo)
    nodes = _nodes(url, hosts, DEFAULT_PORTS[mode])
    options = _options(url, parts.query, mode)
    service, db = _path(url, parts.path, mode)
    failover = _number(url, options, "failover_timeout", DEFAULT_FAILOVER_TIMEOUT, float, 0)
    replicas = _number(url, options, "wait_replicas", DEFAULT_WAIT_REPLICAS, int, 0)
    wait_ms = _number(url, options, "wait_timeout_ms", DEFAULT_WAIT_TIMEOUT_MS, int, 1)
    return RedisTarget(
        mode=mode,
        url=url,
        nodes=nodes,
        service=service,
        db=db,
        username=username,
        password=password,
        sentinel_password=options.get("sentinel_password"),
        failover_timeout=failover,
        wait_replicas=replicas,
        wait_timeout_ms=wait_ms,
    )


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    if not userinfo:
        return None, None
    user, colon, password = userinfo.partition(":")
    if not colon:  # "secret@host" is the common mistake for ":secret@host"; redis-py reads
        return None, unquote(user)  # a bare userinfo as the password too
    return unquote(user) or None, unquote(password)


def _nodes(url: str, hosts: str, default_port: int) -> tuple[tuple[str, int], ...]:
    if not hosts:
        raise _bad(url, "no host: write host:port[,host:port...] after '://'")
    found = []
    for number, item in enumerate(hosts.split(","), start=1):
        where = f"host {number} ({item!r})"
        if item.startswith("["):  # [IPv6]:port
            host, bracket, port_text = item[1:].partition("]")
            if not bracket or (port_text and not port_text.startswith(":")):
                raise _bad(url, f"{where}: an IPv6 address is written [address]:port")
            port_text = port_text[1:]
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise _bad(url, f"{where}: empty host name")
        found.append((host, _port(url, where, port_text, default_port)))
    return tuple(found)


def _port(url: str, where: str, text: str, default: int) -> int:
    if not text:
        return default
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise _bad(url, f"{where}: port {text!r} is not a number from 1 to 65535")
    return int(text)


def _path(url: str, path: str, mode: str) -> tuple[str, int]:
    segments = [unquote(s) for s in path.strip("/").split("/")] if path.strip("/") else []
    if mode == "cluster":
        if segments not in ([], ["0"]):
            raise _bad(url, f"path {path!r}: a cluster has only database 0, so give no path")
        return "", 0
    if not segments:
        raise _bad(url, "no service name: write redis+sentinel://host:26379,.../<service>/<db>")
    if len(segments) > 2:
        raise _bad(url, f"path {path!r}: expected /<service> or /<service>/<db>")
    db_text = segments[1] if len(segments) == 2 else "0"
    if not db_text.isdigit():
        raise _bad(url, f"database {db_text!r} is not a number (path is /<service>/<db>)")
    return segments[0], int(db_text)


def _options(url: str, query: str, mode: Literal["sentinel", "cluster"]) -> dict[str, str]:
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in _OPTIONS[mode]:
            known = ", ".join(_OPTIONS[mode])
            raise _bad(url, f"unknown option {name!r} for redis+{mode}:// (known: {known})")
        if name in options:
            raise _bad(url, f"option {name!r} is given twice")
        options[name] = value
    return options


def _number(
    url: str, options: dict[str, str], name: str, default: _N, kind: type[_N], minimum: _N
) -> _N:
    text = options.get(name)
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise _bad(url, f"option {name}={text!r} is not a {kind.__name__}") from None
    if not math.isfinite(value) or value < minimum:
        raise _bad(url, f"option {name}={text!r} must be a finite number of at least {minimum}")
    return value


def redact(url: str) -> str:
    """``url`` with its passwords masked, for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not even splittable: mask whatever sits before an '@'
        return re.sub(r"//[^/]*@", "//***@", url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if at and userinfo:
        user, colon, _ = userinfo.partition(":")
        userinfo = f"{user}:***" if colon else "***"
        parts = parts._replace(netloc=f"{userinfo}@{hosts}")
    if "sentinel_password=" in parts.query:
        query = "&".join(
            f"{k}=***" if k == "sentinel_password" else f"{k}={v}"
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        )
        parts = parts._replace(query=query)
    return parts.geturl()


def _bad(url: str, problem: str) -> ConfigError:
    return ConfigError(f"redis URL {redact(url)!r}: {problem}")
