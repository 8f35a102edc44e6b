"""``selfspec serve --replicas N``: the Ray Serve application (``serve.ray_app``) from the CLI.

Starts a local Ray instance (or joins ``--ray-address``), starts Ray Serve's HTTP proxy on
``--host``/``--port``, deploys the application, prints how to call it and waits; Ctrl-C (or
SIGTERM) shuts Ray Serve down (each replica drains its engine) and leaves Ray.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading

from selfspec.serve.cli import API_KEY_ENV, PROG, ServeArgs, _is_loopback, how_to_call

RAY_MISSING = (
    "--replicas runs on Ray Serve, which is not installed: pip install 'selfspec[ray]' "
    "(or run without --replicas: one process, no Ray)"
)


def serve_on_ray(args: ServeArgs) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        print(f"{PROG}: error: {RAY_MISSING}", file=sys.stderr)
        return 2
    from selfspec.serve.ray_app import APP_NAME, RayServeConfig, build_app

    if not _is_loopback(args.host) and not (args.api_key or os.environ.get(API_KEY_ENV)):
        print(
            f"{PROG}: warning: listening on {args.host}, not only on this machine, without an "
            f"API key (--api-key or ${API_KEY_ENV})",
            file=sys.stderr,
        )
    config = RayServeConfig(replicas=args.replicas, replica_cpus=args.replica_cpus)
    if args.ray_address is None:
        # A local instance with room for every replica (Ray's CPUs are bookkeeping: more
        # replicas than cores run, they just share the cores).
        cpus = max(os.cpu_count() or 1, math.ceil(config.replicas * config.replica_cpus))
        ray.init(num_cpus=cpus, include_dashboard=False)
    else:
        ray.init(address=args.ray_address, include_dashboard=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(build_app(args, config), name=APP_NAME, route_prefix="/")
        except Exception as error:  # a replica's constructor failed: Ray Serve says why
            print(f"{PROG}: error: the replicas did not start: {error}", file=sys.stderr)
            return 2
        print(
            f"serving on Ray Serve: {config.replicas} engine replica(s), "
            f"{config.replica_cpus:g} CPU each; GET /metrics merges them (label 'replica')"
        )
        print("call it with:\n  " + how_to_call(args.host, args.port, "<model>"), flush=True)
        print('  (GET /v1/models lists the names "model" may take)', flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
        print("shutting down: replicas drain their in-flight requests", flush=True)
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


__all__ = ["RAY_MISSING", "serve_on_ray"]
