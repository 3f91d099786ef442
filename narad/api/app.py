"""Assembles the worker's API: the router with every route, the step that
runs before each request (authentication, the 415 guard) and the request
metrics observer. Transports serve the ``RoutedApp`` this returns.

Imports narad.api.* and narad.metrics.
"""

from __future__ import annotations

from narad import metrics
from narad.api.auth import csrf_ok, guard_415
from narad.api.context import ApiContext
from narad.api.messages import MessagesAPI
from narad.api.ops import OpsAPI
from narad.api.router import Request, RoutedApp, Router, first_segment
from narad.api.topics import TopicsAPI
from narad.api.users import UsersAPI
from narad.meta.grants import Identity

OPEN_PATHS = frozenset(("/healthz", "/readyz", "/v1/openapi.json"))
# The routes answered without credentials (the API description holds no data).
OPEN_ROUTES = frozenset(f"GET {p}" for p in OPEN_PATHS)
METRICS_ROUTE = "GET /metrics"


def build_app(ctx: ApiContext) -> RoutedApp:
    router = Router()
    TopicsAPI(ctx).register(router)
    UsersAPI(ctx).register(router)
    if ctx.broker is not None:
        MessagesAPI(ctx).register(router)
    OpsAPI(ctx).register(router)
    metrics_open = ctx.cfg.http.metrics_unauthenticated

    def open_request(req: Request) -> bool:
        # No credentials needed: the open routes, and a path outside /v1 that is not
        # /metrics (its 404 or 405 comes before any auth check, as Narad's).
        route = req.route
        if route:
            return route in OPEN_ROUTES or (route == METRICS_ROUTE and metrics_open)
        return first_segment(req) not in ("v1", "metrics")

    async def before(req: Request) -> None:
        if open_request(req):
            req.identity = Identity(None, security=False)
            return
        req.identity = await ctx.auth.identify(req)
        guard_415(req)

    def before_fast(req: Request) -> bool:
        # the hit of ``before``: credentials verified already and the 415 guard passed
        if req.path in OPEN_PATHS or req.path == "/metrics":
            return False
        ident = ctx.auth.identify_cached(req)
        if ident is None or not csrf_ok(req):
            return False
        req.identity = ident
        return True

    extra = None
    if ctx.cfg.http.debug_headers:
        extra = [("X-Narad-Node", ctx.node_id), ("X-Narad-Worker", str(ctx.worker_index))]
    return RoutedApp(router, before=before, before_fast=before_fast, observer=metrics.HttpObserver(),
                     extra_headers=extra)
