"""The Ray Serve application of ``selfspec serve --replicas N``: N engine replicas behind one
OpenAI-compatible ingress, requests for an adapter routed to a replica that already holds it.

Three deployments (Ray Serve runs, places, health-checks and restarts them; nothing here is a
runtime of our own):

- ``EngineReplica`` (N replicas): builds the single-process server's state (model, heads,
  adapter store, engine) and serves the single-process app on a loopback port of its own; its
  ``forward`` relays one HTTP request there and streams the answer back (``serve.ray_forward``).
  Adapters are Ray Serve *multiplexed models*: before a request on adapter A runs, the replica
  calls its ``@serve.multiplexed`` loader with A (Ray Serve's per-replica LRU cache of "models";
  a miss loads A into the replica's adapter store and counts it in
  ``selfspec_adapter_loads_total``), and Ray Serve tells every router which replica holds what.
- ``Ingress`` (one replica, FastAPI through ``@serve.ingress``): reads ``model`` from the request
  body and calls ``EngineReplica.forward`` with ``multiplexed_model_id=model`` (what the
  ``serve_multiplexed_model_id`` header sets at Ray Serve's own HTTP proxy), so Ray Serve's
  router prefers a replica that holds that adapter, then the one holding fewest. Base-model
  requests carry no id: every replica holds the base, Ray Serve balances them on load alone.
  ``/metrics`` and ``/health`` are the fleet's (below); every other route is the replicas'.
  A replica that fails before answering is retried on another; one that fails mid-stream ends
  the stream with an error event (``serve.ray_forward``); both are counted in
  ``selfspec_ingress_replica_failures_total``.
- ``MetricsBoard`` (one replica, no CPU): each engine replica reports its own ``/metrics`` text
  and engine counts every ``report_interval_s``; the ingress merges the recent reports
  (``serve.ray_metrics``). A replica that stops reporting drops out of both after a few
  intervals.

Imported only when asked for (``selfspec serve --replicas``, or ``build_app`` from Python): the
rest of selfspec never needs Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter
from ray import serve
from ray.serve.handle import DeploymentHandle

from selfspec.adapters.errors import AdapterError
from selfspec.adapters.store import AdapterStore, StoreConfig
from selfspec.serve.cli import ServeArgs, access_policy
from selfspec.serve.errors import APIError
from selfspec.serve.guard import Guard
from selfspec.serve.ray_forward import (
    NOT_RELAYED,
    REPLICA_HEADER,
    ForwardedRequest,
    ResponseStart,
    adapter_of,
    end_to_end,
    first_answer,
    relay_body,
)
from selfspec.serve.ray_metrics import ReplicaReport, fleet_exposition

logger = logging.getLogger(__name__)

APP_NAME = "selfspec"
ADAPTERS_PER_REPLICA = StoreConfig.max_resident
"""Ray Serve's multiplexing LRU per replica: as many adapters as a replica's store keeps
resident (Ray Serve evicting one unloads it from the store, so the two agree)."""


@dataclass(frozen=True)
class RayServeConfig:
    """How the application is laid out on Ray; what each replica serves is ``ServeArgs``."""

    replicas: int = 2
    """Engine replicas (each a full copy of the model)."""
    replica_cpus: float = 1.0
    """Ray CPUs each engine replica reserves (also its torch threads when --threads is unset)."""
    report_interval_s: float = 2.0
    """How often each replica reports its metrics and counts to the board."""
    retries: int = 1
    """Further attempts for a request whose replica failed before answering anything."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not self.replica_cpus > 0:
            raise ValueError(f"replica_cpus must be > 0, got {self.replica_cpus}")
        if not self.report_interval_s > 0:
            raise ValueError(f"report_interval_s must be > 0, got {self.report_interval_s}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")

    @property
    def stale_after_s(self) -> float:
        """A replica whose last report is older is left out of /metrics and /health."""
        return 3 * self.report_interval_s + 1.0


@dataclass(frozen=True)
class ServedModels:
    """What ``model`` may name: the base (every replica holds it) and the adapters."""

    base: str
    adapters: frozenset[str]


# -- the metrics board ------------------------------------------------------------------------


# No access log: every replica reports every few seconds, which would fill the console.
@serve.deployment(
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    logging_config={"enable_access_log": False},
)
class MetricsBoard:
    """The latest report of every engine replica, by replica tag."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[ReplicaReport, float]] = {}

    def report(self, report: ReplicaReport) -> None:
        # The board's own clock judges freshness: replicas on other nodes may disagree on time.
        self._reports[report.replica] = (report, time.monotonic())

    def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def recent(self, max_age_s: float) -> list[ReplicaReport]:
        now = time.monotonic()
        return [
            report
            for report, received in sorted(self._reports.values(), key=lambda r: r[0].replica)
            if now - received <= max_age_s
        ]


# -- one engine replica -----------------------------------------------------------------------


class _HeldAdapter:
    """What Ray Serve's multiplexing cache holds for an adapter; evicting it (Ray Serve calls
    ``__del__``) unloads the adapter from the store, unless a running request pins it (the
    store's own LRU then drops it later)."""

    def __init__(self, store: AdapterStore, name: str, unloads: Counter) -> None:
        self.store = store
        self.name = name
        self.unloads = unloads
        self._released = False

    def __del__(self) -> None:
        if self._released:  # Ray Serve calls it on eviction, the garbage collector again later
            return
        self._released = True
        try:
            if self.store.unload(self.name):
                self.unloads.labels(self.name).inc()
        except AdapterError as error:
            logger.info("adapter %r stays resident for now: %s", self.name, error)


@serve.deployment
class EngineReplica:
    """The single-process server, in a Ray Serve replica, reached through ``forward``."""

    async def __init__(
        self, args: ServeArgs, board: DeploymentHandle, config: RayServeConfig
    ) -> None:
        from selfspec.serve.background import running_server
        from selfspec.serve.cli import build_state

        self.tag = serve.get_replica_context().replica_tag
        self.board = board
        self.config = config
        self.state = await asyncio.to_thread(build_state, args)
        registry = self.state.metrics.registry
        self.loads = Counter(
            "selfspec_adapter_loads",
            "Adapters loaded into this replica (Ray Serve multiplexing cache misses)",
            ["adapter"],
            registry=registry,
        )
        self.unloads = Counter(
            "selfspec_adapter_unloads",
            "Adapters unloaded from this replica (Ray Serve multiplexing LRU evictions)",
            ["adapter"],
            registry=registry,
        )
        self._exit = contextlib.ExitStack()
        # Shutdown drains first (see __del__); uvicorn's own grace then only covers the relay.
        self.url, self.server = self._exit.enter_context(running_server(self.state, 5))
        self._client = httpx.AsyncClient(base_url=self.url, timeout=None)
        self._reporter = asyncio.create_task(self._report_forever())

    def served_models(self) -> ServedModels:
        with self.state.lock:
            return ServedModels(self.state.model_name, frozenset(self.state.served))

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[object]:
        """One HTTP request through this replica's app: a `ResponseStart`, then body bytes."""
        adapter = serve.get_multiplexed_model_id()
        if adapter and adapter in self.state.served:  # anything else: the app answers 404
            try:
                await self._hold(adapter)
            except AdapterError as error:  # the app tries again and answers with the reason
                logger.warning("replica %s could not hold adapter %r: %s", self.tag, adapter, error)
        async with self._client.stream(
            request.method, request.target, headers=list(request.headers), content=request.body
        ) as response:
            headers = end_to_end(response.headers.multi_items(), NOT_RELAYED)
            yield ResponseStart(
                response.status_code, (*headers, (REPLICA_HEADER, self.tag)), self.tag
            )
            async for chunk in response.aiter_raw():
                yield chunk

    @serve.multiplexed(max_num_models_per_replica=ADAPTERS_PER_REPLICA)
    async def _hold(self, adapter: str) -> _HeldAdapter:
        await asyncio.to_thread(self.state.store.load, adapter)  # reads the weights off the loop
        self.loads.labels(adapter).inc()
        return _HeldAdapter(self.state.store, adapter, self.unloads)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine or server stopped is replaced."""
        if not self.state.engine.serving:
            raise RuntimeError(f"replica {self.tag}: the engine is not serving")
        if self.server.should_exit:
            raise RuntimeError(f"replica {self.tag}: its HTTP server stopped")

    async def _report_forever(self) -> None:
        while True:
            counts = self.state.engine.counts()
            report = ReplicaReport(
                replica=self.tag,
                exposition=self.state.metrics.render().decode(),
                serving=self.state.engine.serving,
                running=counts["running"],
                waiting=counts["waiting"],
            )
            try:
                await self.board.report.remote(report)
            except Exception as error:  # the board restarting: the next report goes through
                logger.warning("replica %s could not report its metrics: %s", self.tag, error)
            await asyncio.sleep(self.config.report_interval_s)

    def __del__(self) -> None:
        """Ray Serve's graceful shutdown: stop reporting, drain the engine (in-flight requests
        get --drain-timeout), stop the server."""
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        server = getattr(self, "server", None)
        if server is not None and not server.should_exit:
            server.drain().join(self.state.drain_timeout + 5)
        exit_stack = getattr(self, "_exit", None)
        if exit_stack is not None:
            exit_stack.close()
        with contextlib.suppress(Exception):  # the board may be gone already
            self.board.forget.remote(self.tag)


# -- the ingress ------------------------------------------------------------------------------

MANAGEMENT_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """The HTTP face: forwards to the engine replicas by adapter; answers /metrics and /health
    for the whole fleet."""

    def __init__(
        self,
        engine: DeploymentHandle,
        board: DeploymentHandle,
        args: ServeArgs,
        config: RayServeConfig,
    ) -> None:
        self.engine = engine
        self.board = board
        self.config = config
        self.policy = access_policy(args)
        self._served: ServedModels | None = None
        self.registry = CollectorRegistry()
        self.failures = Counter(
            "selfspec_ingress_replica_failures",
            "Attempts whose engine replica failed, before answering (then retried on another) "
            "or mid-response (the client's stream ends with an error)",
            ["when"],
            registry=self.registry,
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return _ingress_app(self)

    async def forward_request(self, request: Request) -> Response:
        body = await request.body()
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        forwarded = ForwardedRequest(
            request.method, target, end_to_end(request.headers.items()), body
        )
        handle = self.engine.options(stream=True)
        if request.method == "POST":
            served = await self._served_models()
            adapter = adapter_of(body, served.base if served else None)
            if served is not None and adapter in served.adapters:
                handle = handle.options(multiplexed_model_id=adapter)
        count = self._count_failure
        start, stream = await first_answer(
            lambda: handle.forward.remote(forwarded), self.config.retries, count
        )
        return StreamingResponse(
            relay_body(start, stream, count),
            status_code=start.status,
            headers=dict(start.headers),
        )

    def _count_failure(self, when: str) -> None:
        self.failures.labels(when).inc()

    async def _served_models(self) -> ServedModels | None:
        """The base and adapters every replica serves (fixed at start: no runtime loading);
        None while no replica can say (requests then go without affinity, and a replica
        answers them or `first_answer` answers 503)."""
        if self._served is None:
            try:
                self._served = await self.engine.served_models.remote()
            except Exception as error:  # any of Ray's errors: asked again on the next request
                logger.warning("no engine replica listed the served models: %s", error)
        return self._served


def _ingress_app(ingress: Ingress) -> FastAPI:
    """The ingress' routes. A module-level function, not a method: Ray Serve ships the
    deployment class by value, and FastAPI must resolve these handlers' annotations in this
    module's namespace."""
    app = FastAPI(title="selfspec (Ray Serve)")
    app.add_middleware(Guard, policy=ingress.policy)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/health")
    async def health() -> JSONResponse:
        reports = await ingress.board.recent.remote(ingress.config.stale_after_s)
        serving = [r for r in reports if r.serving]
        counts = {
            "replicas": len(serving),
            "running": sum(r.running for r in serving),
            "waiting": sum(r.waiting for r in serving),
        }
        if not serving:
            error = APIError(503, "no engine replica is serving", "service_unavailable")
            return JSONResponse({**error.body(), **counts}, status_code=503)
        return JSONResponse({"status": "ok", **counts})

    @app.get("/metrics")
    async def metrics() -> Response:
        reports = await ingress.board.recent.remote(ingress.config.stale_after_s)
        exposition = fleet_exposition(reports, ingress.registry.collect())
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    @app.post(MANAGEMENT_ROUTES[0])
    @app.post(MANAGEMENT_ROUTES[1])
    async def management() -> JSONResponse:
        raise APIError(
            501,
            "runtime adapter loading is not available with --replicas (each replica has its "
            "own store); put the adapter under --adapters-root and restart",
            "not_implemented",
        )

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(request: Request) -> Response:
        return await ingress.forward_request(request)

    return app


def build_app(args: ServeArgs, config: RayServeConfig):  # -> ray.serve.Application
    """The application ``serve.run`` deploys: ingress -> N engine replicas, and the board."""
    if args.enable_lora_management:
        raise ValueError(
            "--enable-lora-management is not available with --replicas: each replica has its "
            "own adapter store"
        )
    if args.threads is None:
        args = replace(args, threads=max(1, int(config.replica_cpus)))
    board = MetricsBoard.bind()
    engine = EngineReplica.options(
        num_replicas=config.replicas,
        ray_actor_options={"num_cpus": config.replica_cpus},
        # The engine admits (and answers 429 beyond) max_running + max_queue itself.
        max_ongoing_requests=args.max_running + args.max_queue,
        graceful_shutdown_timeout_s=args.drain_timeout + 10,
    ).bind(args, board, config)
    ingress = Ingress.options(
        max_ongoing_requests=config.replicas * (args.max_running + args.max_queue)
    )
    return ingress.bind(engine, board, args, config)


__all__ = [
    "ADAPTERS_PER_REPLICA",
    "APP_NAME",
    "EngineReplica",
    "Ingress",
    "MetricsBoard",
    "RayServeConfig",
    "ServedModels",
    "build_app",
]
