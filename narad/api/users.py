"""User routes: create, list, get, delete, replace grants, change password.

Admin only, except a user changing their own password with
``current_password``. Passwords are hashed here (bcrypt, in a thread) so the
plain text never leaves the worker; the supervisor's metadata service checks
the anti-escalation rules again against its replica and proposes the write.
Oversized bodies answer 400 here, as in Narad.

Imports narad.api.{auth,context,router}, narad.meta, narad.errors.
"""

from __future__ import annotations

from typing import Any

import msgspec

from narad.api.auth import check_password, hash_password
from narad.api.context import ApiContext, decode_json
from narad.api.router import Request, Response, Router, empty, json_response
from narad.errors import BadRequest, Forbidden, NotFound
from narad.meta import grants as G
from narad.meta import requests as Q
from narad.meta import validate as VAL
from narad.meta.records import Grant, UserRecord


class GrantBody(msgspec.Struct, forbid_unknown_fields=True):
    action: str
    patterns: list[str] = []


class CreateUserBody(msgspec.Struct, forbid_unknown_fields=True):
    username: str | None = None
    password: str | None = None
    grants: list[GrantBody] = []


class GrantsBody(msgspec.Struct, forbid_unknown_fields=True):
    grants: list[GrantBody] | None = None


class PasswordBody(msgspec.Struct, forbid_unknown_fields=True):
    new_password: str | None = None
    current_password: str | None = None


def user_json(u: UserRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"username": u.username}
    if u.grants:
        out["grants"] = [{"action": g.action, **({"patterns": list(g.patterns)} if g.patterns else {})}
                         for g in u.grants]
    if u.root:
        out["root"] = True
    out["created_at_ms"] = u.created_at_ms
    out["updated_at_ms"] = u.updated_at_ms
    return out


def _grants(items: list[GrantBody]) -> list[Grant]:
    return VAL.grants([Grant(g.action, list(g.patterns)) for g in items])


class UsersAPI:
    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx

    def register(self, r: Router) -> None:
        lim = {"oversize_status": 400}
        r.add("POST", "/v1/users", self.create, **lim)
        r.add("GET", "/v1/users", self.list)
        r.add("GET", "/v1/users/{username}", self.get)
        r.add("DELETE", "/v1/users/{username}", self.delete)
        r.add("PUT", "/v1/users/{username}/grants", self.set_grants, **lim)
        r.add("PUT", "/v1/users/{username}/password", self.set_password, **lim)

    def _caller(self, req: Request) -> UserRecord | None:
        who: G.Identity = req.identity
        if who.unrestricted or who.name is None:
            return None
        return self.ctx.store.user(who.name)

    def _require_admin(self, req: Request) -> UserRecord | None:
        who: G.Identity = req.identity
        caller = self._caller(req)
        if not who.unrestricted and not G.is_admin(caller):
            raise Forbidden("admin privileges required")
        return caller

    def _target(self, name: str) -> UserRecord:
        u = self.ctx.store.user(name)
        if u is None:
            raise NotFound(f'user "{name}" not found')
        return u

    async def create(self, req: Request) -> Response:
        caller = self._require_admin(req)
        body = decode_json(req, CreateUserBody)
        name = VAL.username(body.username)
        pw = VAL.password(body.password)
        grants = _grants(body.grants)
        if any(g.action == "admin" for g in grants) and caller is not None and not caller.root:
            raise Forbidden("only the root admin may grant admin")
        hashed = await hash_password(pw)
        rec = await self.ctx.call(Q.CreateUserReq(req.identity, name, hashed, grants), UserRecord)
        return json_response(201, user_json(rec))

    async def list(self, req: Request) -> Response:
        self._require_admin(req)
        with self.ctx.store.read() as r:
            users = r.users()
        return json_response(200, [user_json(u) for u in users])

    async def get(self, req: Request) -> Response:
        self._require_admin(req)
        return json_response(200, user_json(self._target(req.params["username"])))

    async def delete(self, req: Request) -> Response:
        caller = self._require_admin(req)
        target = self._target(req.params["username"])
        if target.root:
            raise Forbidden("the root admin cannot be deleted")
        if caller is not None and caller.username == target.username:
            raise Forbidden("nobody can delete their own account")
        await self.ctx.call(Q.DeleteUserReq(req.identity, target.username), Q.Empty)
        return empty(204)

    async def set_grants(self, req: Request) -> Response:
        caller = self._require_admin(req)
        body = decode_json(req, GrantsBody)
        if body.grants is None:
            raise BadRequest("invalid argument: grants required (send [] to remove all)")
        grants = _grants(body.grants)
        target = self._target(req.params["username"])
        if caller is not None and caller.username == target.username:
            raise Forbidden("nobody can change their own grants")
        if target.root:
            raise Forbidden("the root admin's grants cannot change")
        if any(g.action == "admin" for g in grants) and caller is not None and not caller.root:
            raise Forbidden("only the root admin may grant admin")
        rec = await self.ctx.call(Q.SetGrantsReq(req.identity, target.username, grants), UserRecord)
        return json_response(200, user_json(rec))

    async def set_password(self, req: Request) -> Response:
        who: G.Identity = req.identity
        caller = self._caller(req)
        body = decode_json(req, PasswordBody)
        new_pw = VAL.password(body.new_password, "new_password")
        if not who.unrestricted and not G.is_admin(caller) and (
                caller is None or caller.username != req.params["username"]):
            # before the lookup: a 404 here would tell anyone which user names exist
            raise Forbidden("only admins may change another user's password")
        target = self._target(req.params["username"])
        verified = False
        if not who.unrestricted:
            is_admin = G.is_admin(caller)
            self_change = caller is not None and caller.username == target.username
            if not is_admin and not self_change:
                raise Forbidden("only admins may change another user's password")
            if target.root and not (caller is not None and caller.root):
                raise Forbidden("only the root admin may change the root admin's password")
            if self_change and not is_admin:
                if body.current_password is None or not await check_password(
                    body.current_password.encode(), target.password_hash
                ):
                    raise Forbidden("current_password is wrong or missing")
                verified = True
        hashed = await hash_password(new_pw)
        await self.ctx.call(Q.SetPasswordReq(who, target.username, hashed, verified), Q.Empty)
        return empty(204)
