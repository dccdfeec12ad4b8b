"""Who may call the policy service: API keys sent as ``Authorization: Bearer <key>`` (as vLLM's ``--api-key``
and OpenAI's clients send them), on every route but the probes; ``bentos.admission.RequestGuard`` asks.

Keys: ``RLVR_API_KEYS`` and the file ``RLVR_API_KEYS_FILE``, each ``id:secret`` or a bare secret (id ``key-`` +
8 hex digits of its hash). Only SHA-256 digests are kept, compared in constant time. ``/metrics`` takes
``RLVR_METRICS_TOKEN`` when set, else the keys. Per key: ``RLVR_RATE_PER_KEY`` requests/s (burst
``RLVR_BURST_PER_KEY``), ``RLVR_CONCURRENCY_PER_KEY`` in the engine, and a daily token quota
(``RLVR_DAILY_TOKENS_PER_KEY``, overrides ``RLVR_DAILY_TOKENS_BY_KEY``): past any, 429 with ``Retry-After``.
No key configured: open to anyone (the service warns); keys named but none found: refused unless
``RLVR_ALLOW_UNAUTHENTICATED=1``.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Mapping

KEYS_ENV, KEYS_FILE_ENV, METRICS_TOKEN_ENV = "RLVR_API_KEYS", "RLVR_API_KEYS_FILE", "RLVR_METRICS_TOKEN"
ALLOW_OPEN_ENV = "RLVR_ALLOW_UNAUTHENTICATED"
RATE_ENV, BURST_ENV, CONCURRENCY_ENV = "RLVR_RATE_PER_KEY", "RLVR_BURST_PER_KEY", "RLVR_CONCURRENCY_PER_KEY"
DAILY_TOKENS_ENV, DAILY_TOKENS_BY_KEY_ENV = "RLVR_DAILY_TOKENS_PER_KEY", "RLVR_DAILY_TOKENS_BY_KEY"
PROBES = ("/livez", "/healthz", "/readyz")  # open: the kubelet and compose's healthcheck send no key
METRICS_PATH = "/metrics"
MIN_SECRET_CHARS = 16
NEW_KEY = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
STARTING_RETRY_AFTER_S = 2
_SECRET = re.compile(r"[A-Za-z0-9._~+/=-]+")  # RFC 6750's b64token: no ':', ',', '#' or space
_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def secret_digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def derived_key_id(secret: str) -> str:
    """The id of a key given without one: a hash of it, apart from the digest it is checked against."""
    return "key-" + hashlib.sha256(b"rlvr-api-key-id:" + secret.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class KeyRing:
    """Named key digests; ``match`` finds which one a presented key is."""

    ids: tuple[str, ...]
    digests: tuple[bytes, ...]

    def match(self, presented: bytes) -> str | None:
        """The id of the key ``presented`` is, or None. Its SHA-256 is compared with every key's digest, each
        comparison ``hmac.compare_digest`` of two 32-byte strings and none skipped, so the time taken says
        neither which key matched nor how much of one did (nor, beyond the hash, how long it is)."""
        candidate, found = secret_digest(presented), None
        for key_id, stored in zip(self.ids, self.digests):
            if hmac.compare_digest(candidate, stored):
                found = key_id
        return found


def parse_keys(text: str, source: str) -> KeyRing:
    """The keys in ``text``, separated by commas or lines (``#`` starts a comment line), each ``id:secret`` or
    a bare secret. A ValueError names ``source`` and the entry by position, never by its secret."""
    entries = [e.strip() for line in text.splitlines() if not line.lstrip().startswith("#") for e in line.split(",")]
    ids, digests = [], []
    for n, entry in enumerate((e for e in entries if e), 1):
        key_id, _, secret = entry.rpartition(":")
        where = f"{source}: key {n}"
        if key_id and not _KEY_ID.fullmatch(key_id):
            raise ValueError(f"{where}: its id (before ':') must be 1 to 64 letters, digits, '.', '_' or '-'")
        check_secret(secret, where)
        key_id = key_id or derived_key_id(secret)
        if key_id in ids:
            raise ValueError(f"{where}: the id {key_id!r} is taken by key {ids.index(key_id) + 1}")
        digest = secret_digest(secret.encode())
        if digest in digests:
            raise ValueError(f"{where}: the same secret as key {digests.index(digest) + 1}")
        ids.append(key_id)
        digests.append(digest)
    return KeyRing(tuple(ids), tuple(digests))


def check_secret(secret: str, where: str) -> None:
    """A ValueError unless ``secret`` is at least ``MIN_SECRET_CHARS`` of a bearer token's characters."""
    if not _SECRET.fullmatch(secret):
        raise ValueError(f"{where}: a secret may hold only letters, digits and . _ ~ + / = - (make one: {NEW_KEY})")
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{where}: {len(secret)} characters; a secret needs at least {MIN_SECRET_CHARS} (make one: {NEW_KEY})")


@dataclass(frozen=True)
class KeyLimits:
    """What one key may use: ``rate_per_s`` requests a second, up to ``burst`` at once after a pause
    (None: no rate limit), at most ``concurrency`` requests in the engine (None: no limit of its own), and
    ``daily_tokens`` a UTC day, unless ``daily_tokens_by_key`` names its own (None: no quota)."""

    rate_per_s: float | None = None
    burst: int = 1
    concurrency: int | None = None
    daily_tokens: int | None = None
    daily_tokens_by_key: tuple[tuple[str, int], ...] = ()

    def daily_tokens_of(self, key_id: str | None) -> int | None:
        """The daily token quota of ``key_id`` (None: none; an open service's callers have none)."""
        if key_id is None:
            return None
        return dict(self.daily_tokens_by_key).get(key_id, self.daily_tokens)

    @property
    def has_quota(self) -> bool:
        return self.daily_tokens is not None or bool(self.daily_tokens_by_key)


@dataclass(frozen=True)
class AccessConfig:
    """The service's keys (None: open to anyone), ``/metrics``' own token (None: the keys) and per-key limits."""

    keys: KeyRing | None = None
    metrics_token: KeyRing | None = None
    limits: KeyLimits = KeyLimits()

    def summary(self) -> str:
        """One log line: the key ids (never a secret), what ``/metrics`` takes, each key's limits."""
        if self.keys is None:
            return (
                f"OPEN TO ANYONE: no API key is configured ({KEYS_ENV}, {KEYS_FILE_ENV}), so every route answers "
                "whoever reaches this port; set a key (deploy/README.md, Security)"
            )
        limits = self.limits
        rate = "no rate limit" if limits.rate_per_s is None else f"{limits.rate_per_s:g} requests/s (burst {limits.burst})"
        share = "no concurrency limit" if limits.concurrency is None else f"at most {limits.concurrency} at once"
        metrics = "its own token" if self.metrics_token else "the API keys"
        quota = ""
        if limits.has_quota:
            own = "".join(f", {key_id} {tokens}" for key_id, tokens in limits.daily_tokens_by_key)
            quota = f", {'no daily token quota' if limits.daily_tokens is None else f'{limits.daily_tokens} tokens a day'}{own}"
        return f"API keys {', '.join(self.keys.ids)}; /metrics takes {metrics}; per key: {rate}, {share}{quota}"


def access_from_env(environ: Mapping[str, str]) -> AccessConfig:
    """The service's ``AccessConfig`` from its environment (module docstring). A ValueError names the
    setting that is wrong: a malformed key, a missing keys file, keys named but none found."""
    named = [name for name in (KEYS_ENV, KEYS_FILE_ENV) if name in environ]
    ids, digests = [], []
    if KEYS_ENV in environ:
        ring = parse_keys(environ[KEYS_ENV], KEYS_ENV)
        ids, digests = list(ring.ids), list(ring.digests)
    if KEYS_FILE_ENV in environ:
        path = Path(environ[KEYS_FILE_ENV])
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{KEYS_FILE_ENV}={path}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
        ring = parse_keys(text, f"{KEYS_FILE_ENV} {path}")
        for key_id, digest in zip(ring.ids, ring.digests):
            if key_id in ids or digest in digests:
                raise ValueError(f"{KEYS_FILE_ENV} {path}: the key {key_id!r} is also in {KEYS_ENV} (the same id or secret)")
            ids.append(key_id)
            digests.append(digest)
    if named and not ids and environ.get(ALLOW_OPEN_ENV, "").strip() != "1":
        verb = "holds" if len(named) == 1 else "hold"
        raise ValueError(f"{' and '.join(named)} {verb} no key: set one, or {ALLOW_OPEN_ENV}=1 to serve anyone who reaches the port")
    metrics_token = None
    if METRICS_TOKEN_ENV in environ:
        token = environ[METRICS_TOKEN_ENV].strip()
        check_secret(token, METRICS_TOKEN_ENV)
        metrics_token = KeyRing(("metrics",), (secret_digest(token.encode()),))
    limits = limits_from_env(environ)
    for key_id, _ in limits.daily_tokens_by_key:
        if key_id not in ids:
            raise ValueError(f"{DAILY_TOKENS_BY_KEY_ENV}: {key_id!r} is not the id of a configured key ({KEYS_ENV}, {KEYS_FILE_ENV})")
    return AccessConfig(KeyRing(tuple(ids), tuple(digests)) if ids else None, metrics_token, limits)


def limits_from_env(environ: Mapping[str, str]) -> KeyLimits:
    """``KeyLimits`` from ``RLVR_RATE_PER_KEY`` (> 0), ``RLVR_BURST_PER_KEY`` (default: a second's worth, at
    least 1), ``RLVR_CONCURRENCY_PER_KEY``, ``RLVR_DAILY_TOKENS_PER_KEY`` and ``RLVR_DAILY_TOKENS_BY_KEY``
    (``id=tokens``, separated by commas); unset or empty: no limit. A ValueError names a bad value."""

    def number(name: str, kind: type, least: float) -> float | None:
        value = environ.get(name, "").strip()
        if not value:
            return None
        try:
            parsed = kind(value)
        except ValueError:
            parsed = None
        if parsed is None or not math.isfinite(parsed) or parsed < least:
            raise ValueError(f"{name} must be {'a whole number' if kind is int else 'a number'} of at least {least:g}; got {value!r}")
        return parsed

    rate = number(RATE_ENV, float, 0.001)
    burst = number(BURST_ENV, int, 1)
    if burst is not None and rate is None:
        raise ValueError(f"{BURST_ENV} is set without {RATE_ENV}: set the rate it is the burst of")
    by_key = []
    for entry in (e.strip() for e in environ.get(DAILY_TOKENS_BY_KEY_ENV, "").split(",")):
        if not entry:
            continue
        key_id, _, tokens = (part.strip() for part in entry.partition("="))
        if not _KEY_ID.fullmatch(key_id) or not tokens.isdigit() or int(tokens) < 1 or key_id in dict(by_key):
            raise ValueError(f"{DAILY_TOKENS_BY_KEY_ENV}: each entry must be id=tokens (a whole number of at least 1), each id once; got {entry!r}")
        by_key.append((key_id, int(tokens)))
    return KeyLimits(
        rate,
        burst or max(1, math.ceil(rate or 1)),
        number(CONCURRENCY_ENV, int, 1),
        number(DAILY_TOKENS_ENV, int, 1),
        tuple(by_key),
    )


def utc_day(now_s: float) -> str:
    """The UTC day (``YYYY-MM-DD``) of a time in seconds since the epoch."""
    return datetime.fromtimestamp(now_s, timezone.utc).date().isoformat()


def seconds_to_utc_midnight(now_s: float) -> int:
    """Whole seconds (at least 1) from ``now_s`` until the next UTC midnight: when a day's quota resets."""
    return max(1, math.ceil(next_utc_midnight(now_s).timestamp() - now_s))


def next_utc_midnight(now_s: float) -> datetime:
    today = datetime.fromtimestamp(now_s, timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    return today + timedelta(days=1)


class DailyTokens:
    """Tokens each key used on the current UTC day (of ``clock``, seconds since the epoch): counted from zero
    again at every UTC midnight."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.day = utc_day(clock())
        self.used: Counter = Counter()

    def today(self) -> str:
        """The current UTC day; the counts start again when it changed."""
        day = utc_day(self.clock())
        if day != self.day:
            self.day, self.used = day, Counter()
        return day

    def add(self, key_id: str | None, tokens: int) -> None:
        self.today()
        self.used[key_id] += tokens

    def used_today(self, key_id: str | None) -> int:
        self.today()
        return self.used[key_id]

    def restore(self, day: str, used: Mapping[str | None, int]) -> None:
        """Add ``used`` (tokens by key id, of ``day``: e.g. today's traffic log read at start) when ``day`` is today."""
        if day == self.today():
            self.used.update(used)


class TokenBucket:
    """``rate_per_s`` tokens a second, at most ``burst`` saved up (full at first); each request takes one."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate_per_s, self.burst, self.clock = rate_per_s, burst, clock
        self.tokens, self.stamp = float(burst), clock()

    def take(self) -> float:
        """0 when a token was taken, else the seconds until there will be one."""
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate_per_s)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate_per_s


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the id of its key (None on an open service)."""

    key_id: str | None


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: its status, a message, OpenAI's error ``code``, ``Retry-After`` and ``WWW-Authenticate``."""

    status: int
    message: str
    code: str
    retry_after_s: int | None = None
    challenge: str | None = None
    detail: dict | None = None  # more of why, as fields of the native error body


@dataclass
class Access:
    """This worker's ``AccessConfig`` (set when the service module is imported: until then every guarded
    request is 503) and what each key is using: its token bucket, its requests in the engine, its tokens today."""

    config: AccessConfig | None = None
    clock: Callable[[], float] = time.monotonic
    buckets: dict[str, TokenBucket] = field(default_factory=dict)
    in_flight: Counter = field(default_factory=Counter)
    tokens_today: DailyTokens = field(default_factory=DailyTokens)

    def configure(self, config: AccessConfig) -> None:
        self.config = config
        self.buckets.clear()
        self.in_flight.clear()
        self.tokens_today.used.clear()

    def caller(self, path: str, headers: list[tuple[bytes, bytes]]) -> Caller | Refusal:
        """Who sent a request for ``path`` with these headers, or why it is refused: 401 without the right key
        (a probe needs none), 429 past its key's rate."""
        config = self.config
        if config is None:
            return Refusal(503, "the service is starting", "service_unavailable", retry_after_s=STARTING_RETRY_AFTER_S)
        ring = config.metrics_token if path == METRICS_PATH and config.metrics_token is not None else config.keys
        if ring is None:
            return Caller(None)
        presented = bearer_token(headers)
        if presented is None:
            return Refusal(401, "no API key: send it in the header 'Authorization: Bearer <key>'", "invalid_api_key", challenge="Bearer")
        key_id = ring.match(presented)
        if key_id is None:
            return Refusal(401, "incorrect API key", "invalid_api_key", challenge='Bearer error="invalid_token"')
        if ring is config.keys and config.limits.rate_per_s is not None:
            wait_s = self._bucket(key_id).take()
            if wait_s > 0:
                rate = f"{config.limits.rate_per_s:g} requests/s (burst {config.limits.burst})"
                return Refusal(429, f"rate limit of this API key reached: {rate}", "rate_limit_exceeded", retry_after_s=math.ceil(wait_s))
        return Caller(key_id)

    def over_quota(self, caller: Caller) -> Refusal | None:
        """A 429 until the next UTC midnight when ``caller``'s key used its daily token quota today, else None."""
        quota = self.config.limits.daily_tokens_of(caller.key_id) if self.config else None
        if quota is None or (used := self.tokens_today.used_today(caller.key_id)) < quota:
            return None
        now_s = self.tokens_today.clock()
        resets_at = next_utc_midnight(now_s).isoformat().replace("+00:00", "Z")
        message = f"daily token quota of this API key reached: {used} of {quota} tokens used today (UTC); it resets at {resets_at}"
        detail = {"daily_token_quota": quota, "tokens_used_today": used, "resets_at": resets_at}
        return Refusal(429, message, "insufficient_quota", retry_after_s=seconds_to_utc_midnight(now_s), detail=detail)

    def take_share(self, caller: Caller, retry_after_s: int) -> Refusal | None:
        """Count one more request of ``caller`` in the engine, or refuse it (429) past its key's share; a request
        counted must be released with ``release``."""
        limit = self.config.limits.concurrency if self.config else None
        if caller.key_id is not None and limit is not None and self.in_flight[caller.key_id] >= limit:
            return Refusal(429, f"this API key has {limit} requests in progress, its most at once", "rate_limit_exceeded", retry_after_s=retry_after_s)
        self.in_flight[caller.key_id] += 1
        return None

    def release(self, caller: Caller) -> None:
        self.in_flight[caller.key_id] -= 1

    def _bucket(self, key_id: str) -> TokenBucket:
        if key_id not in self.buckets:  # one per configured key: the dict never outgrows the key ring
            limits = self.config.limits
            self.buckets[key_id] = TokenBucket(limits.rate_per_s, limits.burst, self.clock)
        return self.buckets[key_id]


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the request's one ``Authorization: Bearer <token>`` header (the scheme in any case);
    None when there is none, several, or another scheme. A key in the query string or a cookie is never read."""
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


ACCESS = Access()
