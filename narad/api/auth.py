"""HTTP Basic authentication, the verified-credential cache, the failed-login
throttle hook, and the cross-site (415) guard.

With security on, every ``/v1`` request must carry Basic credentials that
match a bcrypt hash in the metastore. Verified credentials are cached per
worker, keyed by a digest of (user, password) and validated with one atomic
load of the users version counter, so a password change or user delete takes
effect on the next request. bcrypt runs in threads (it releases the GIL),
bounded per process, and identical concurrent credentials share one run.

Before any bcrypt check the worker takes a token from the supervisor's
failed-login throttle (per username 5, then one per 12 s, per node; plus a
node-wide failure budget) and reports the outcome after: a correct password
gives the token back. An unknown username is checked against a fixed dummy
hash under the same throttle, so a refusal takes as long for a name that does
not exist as for one that does (user names are not enumerable by timing);
when the node-wide budget is spent, the dummy check is replaced by a wait of
the same length, so unknown names cannot burn CPU. A name that breaks the
username rule, or a password over 72 bytes (bcrypt's limit), is a failed
login without bcrypt.

Imports narad.meta.{grants,requests,records,validate,versions}, narad.api.router
and narad.errors.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import bcrypt

from narad.api.router import Request
from narad.errors import InternalError, NaradError, TooManyRequests, Unauthorized, UnsupportedMediaType
from narad.meta import validate as VAL
from narad.meta import versions as V
from narad.meta.grants import Identity
from narad.meta.records import UserRecord
from narad.meta.requests import AuthAttemptReq, AuthAttemptResp, AuthOutcome

log = logging.getLogger("narad.api.auth")

# The credential cache's key function: CPython's own SHA-256 (no OpenSSL). Through
# OpenSSL 3 every digest takes and frees a context under the provider's locks, which
# py-spy showed costing several us per request in a worker; the digest is the same.
try:
    from _sha256 import sha256 as _sha256  # CPython 3.11
except ImportError:  # pragma: no cover - other versions
    try:
        from _sha2 import sha256 as _sha256  # type: ignore[no-redef]  # CPython 3.12+
    except ImportError:
        _sha256 = hashlib.sha256  # type: ignore[assignment]


def _key(header: str) -> bytes:
    return _sha256(header.encode("utf-8", "surrogateescape")).digest()

STATE_CHANGING = frozenset(("POST", "PUT", "PATCH"))
_CACHE_LIMIT = 50_000
# What an unknown username's password is checked against: a bcrypt hash of a random
# secret nobody knows, at the cost new users get (10), so the check takes as long.
DUMMY_HASH = b"$2b$10$HRc6PEGDwNWwvrZmJ36usuB3MAvoybxmXi9VGNrX.CjeGWOwCHcL."


def parse_basic(header: str | None) -> tuple[str, str] | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        raw = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, ValueError):  # ValueError: non-ASCII characters in the value
        return None
    user, sep, pw = raw.partition(":")
    if not sep:
        return None
    return user, pw


def csrf_ok(req: Request) -> bool:
    """POST/PUT/PATCH must declare JSON or octet-stream, or carry X-Narad-Client."""
    if req.method not in STATE_CHANGING:
        return True
    if req.headers.get("x-narad-client"):
        return True
    ctype = req.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return ctype in ("application/json", "application/octet-stream")


async def check_password(password: bytes, hashed: bytes) -> bool:
    """bcrypt check in a thread; a password over 72 bytes never matches (bcrypt
    would raise: no stored password is that long)."""
    if len(password) > VAL.PASSWORD_MAX:
        return False
    return await asyncio.to_thread(bcrypt.checkpw, password, hashed)


async def hash_password(password: bytes, rounds: int = 10) -> bytes:
    if len(password) > VAL.PASSWORD_MAX:  # callers validate first (VAL.password: a 400)
        raise ValueError("password longer than 72 bytes")
    return await asyncio.to_thread(bcrypt.hashpw, password, bcrypt.gensalt(rounds))


_OPEN = Identity(None, security=False)


class Authenticator:
    def __init__(
        self,
        *,
        security: bool,
        users: Callable[[str], UserRecord | None],
        versions: V.VersionTable,
        supervisor_call: Callable[[Any, type], Awaitable[Any]] | None,
        supervisor_note: Callable[[Any], None] | None,
        bcrypt_slots: int = 2,
    ) -> None:
        self.security = security
        self.users = users
        self.versions = versions
        self.call = supervisor_call
        self.note = supervisor_note
        self._sem = asyncio.Semaphore(max(1, bcrypt_slots))
        self._cache: dict[bytes, Identity] = {}
        self._cache_ver = -1
        self._inflight: dict[bytes, asyncio.Future[bool]] = {}
        self._check_seconds = 0.08  # how long one bcrypt check takes on this node (moving average)

    def identify_cached(self, req: Request) -> Identity | None:
        """``identify`` when it needs no await: security off, or credentials verified
        already (the cache hit). None: anything else (``identify`` decides)."""
        if not self.security:
            return _OPEN
        header = req.headers.get("authorization")
        if not header:
            return None
        ver = self.versions.load(V.USERS)
        if ver != self._cache_ver:
            return None
        return self._cache.get(_key(header))

    async def identify(self, req: Request) -> Identity:
        if not self.security:
            return Identity(None, security=False)
        header = req.headers.get("authorization")
        if not header:
            raise Unauthorized()
        # Keyed by a digest of the whole header: a hit needs no base64 parse, and
        # no plain credentials are kept in memory.
        key = _key(header)
        ver = self.versions.load(V.USERS)
        if ver != self._cache_ver:
            self._cache.clear()
            self._cache_ver = ver
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        creds = parse_basic(header)
        if creds is None:
            raise Unauthorized()
        name, pw = creds
        if not VAL.is_username(name):
            raise Unauthorized()  # no user can have this name: nothing to look up or check
        try:
            user = self.users(name)
        except Exception as e:  # the local user store is unreadable
            log.error("user store unreadable", extra={"err": str(e)})
            raise InternalError("authentication unavailable") from None
        ok = await self._verify(key, name, pw.encode(), None if user is None else user.password_hash)
        if not ok:
            raise Unauthorized()
        if len(self._cache) > _CACHE_LIMIT:
            self._cache.clear()
        ident = Identity(name)
        if self.versions.load(V.USERS) == ver:
            self._cache[key] = ident
        return ident

    async def _verify(self, key: bytes, name: str, pw: bytes, hashed: bytes | None) -> bool:
        """Check ``pw`` against ``hashed`` (None: the user does not exist) after
        taking a throttle token; the outcome goes back to the throttle."""
        fut = self._inflight.get(key)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            budget = True
            if self.call is not None:
                ans: AuthAttemptResp = await self.call(AuthAttemptReq(name), AuthAttemptResp)
                if not ans.allowed:
                    raise TooManyRequests(
                        "too many failed authentication attempts",
                        headers=[("Retry-After", str(max(1, int(ans.retry_after + 0.999))))],
                    )
                budget = ans.budget
            ok = False
            if len(pw) > VAL.PASSWORD_MAX:
                pass  # bcrypt refuses it, and no stored password is that long: a failed login
            elif hashed is not None:
                ok = await self._bcrypt(pw, hashed)
            elif budget:
                await self._bcrypt(pw, DUMMY_HASH)
            else:
                # The node-wide failure budget is spent: no CPU for a name that does
                # not exist, but the refusal still takes as long as a check.
                await asyncio.sleep(self._check_seconds)
            if self.note is not None:
                self.note(AuthOutcome(name, ok, budget))
            fut.set_result(ok)
            return ok
        except BaseException as e:
            if not fut.done():
                if isinstance(e, NaradError):
                    fut.set_exception(e)
                else:
                    fut.set_exception(InternalError("authentication unavailable"))
                fut.exception()  # mark retrieved
            raise
        finally:
            self._inflight.pop(key, None)

    async def _bcrypt(self, pw: bytes, hashed: bytes) -> bool:
        async with self._sem:
            t0 = time.perf_counter()
            ok = await check_password(pw, hashed)
            # A moving average of how long a check takes here (the stand-in wait).
            self._check_seconds += (time.perf_counter() - t0 - self._check_seconds) * 0.2
        return ok


def guard_415(req: Request) -> None:
    if not csrf_ok(req):
        raise UnsupportedMediaType()
