"""The Ray Serve application: `build_application` from the serve command's options, `app_builder` for
``serve run``, and `run_on_ray` for ``hf-paged-cache serve MODEL --ray``.

The application is three deployments: `Ingress` (the HTTP app, one replica, no model), `EngineReplica`
(``--replicas`` of them, each a model, a batcher and a pool; routed by `PrefixAwareRouter` or Serve's own
power of two choices) and `PoolBoard` (one, where replicas post their pool stats). Ray restarts a replica
that dies (its health check fails), and its requests in flight end as `ReplicaClient` says.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import LoggingConfig

from ..launch import build_parser
from .ingress import Ingress
from .replica import EngineReplica, PoolBoard
from .router import PrefixAwareRouter

logger = logging.getLogger("hf_paged_cache.serve")

APP_NAME = "hf_paged_cache"
ROUTING_STATS_PERIOD_S = 0.5  # how often replicas publish their prefix summaries
INGRESS_MAX_ONGOING = 4096  # HTTP requests one ingress replica takes at once (the batchers queue and refuse)
HEALTH_CHECK_PERIOD_S = 2.0  # a dead replica is noticed, and replaced, within a few of these
DRAIN_POLL_S = 0.25  # how often a stopping replica checks whether its requests are done (Serve's default: 2 s)


def build_application(options: argparse.Namespace, chat_template: str | None = None) -> Any:
    """The Ray Serve application (an ``Application`` to `serve.run`) of the serve command's `options`."""
    gpus = options.replica_gpus
    if gpus is None:
        gpus = 1.0 if str(options.device).startswith("cuda") else 0.0
    router = RequestRouterConfig(
        request_router_class=PrefixAwareRouter if options.router == "prefix" else RequestRouterConfig().request_router_class,
        request_router_kwargs={"block_size": options.block_size} if options.router == "prefix" else {},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
    )
    logging_config = LoggingConfig(log_level=options.log_level.upper(), enable_access_log=options.log_level == "debug")
    every_deployment = {"logging_config": logging_config, "graceful_shutdown_wait_loop_s": DRAIN_POLL_S}
    board = PoolBoard.options(**every_deployment).bind()
    engine = EngineReplica.options(
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": gpus},
        max_ongoing_requests=(options.max_running or 64) + options.max_waiting,  # the batcher queues the rest
        request_router_config=router,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        **every_deployment,
    ).bind(options, board)
    return Ingress.options(max_ongoing_requests=INGRESS_MAX_ONGOING, ray_actor_options={"num_cpus": 0},
                           **every_deployment).bind(options, chat_template, engine, board)


def app_builder(args: dict[str, str]) -> Any:
    """For ``serve run hf_paged_cache.server.ray.app:app_builder model=default replicas=2 ...``: the serve
    command's options by name (``max_memory=64MiB``; flags as ``true`` / ``false``)."""
    options = build_parser().parse_args(builder_argv(args))
    chat_template = options.chat_template.read_text(encoding="utf-8") if options.chat_template else None
    return build_application(options, chat_template)


def builder_argv(args: dict[str, str]) -> list[str]:
    """``serve run``'s ``name=value`` arguments as the serve command's: ``["MODEL", "--ray", "--name", "value",
    ...]``; ``name=true`` is ``--name``, ``name=false`` is ``--no-name`` (or nothing, for a plain flag)."""
    negatable = {option for action in build_parser()._actions if isinstance(action, argparse.BooleanOptionalAction)
                 for option in action.option_strings}
    args = dict(args)
    argv = [str(args.pop("model", "default")), "--ray"]
    for name, value in args.items():
        flag, text = "--" + name.replace("_", "-"), str(value)
        if text.lower() == "true":
            argv.append(flag)
        elif text.lower() == "false":
            argv += ["--no-" + flag[2:]] if "--no-" + flag[2:] in negatable else []
        else:
            argv += [flag, text]
    return argv


def run_on_ray(options: argparse.Namespace, chat_template: str | None) -> int:
    """Start the application on Ray (a local cluster unless ``--ray-address``), serve until SIGINT / SIGTERM,
    then shut it down (the replicas close their batchers) and leave Ray."""
    local = options.ray_address is None
    if local:  # enough logical CPUs for the replicas whatever the machine: they share its cores
        cpus = max(os.cpu_count() or 1, int(options.replicas * options.replica_cpus) + 1)
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=options.ray_address, logging_level=logging.WARNING)
    stop = threading.Event()
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, lambda signum, frame: stop.set())
    try:
        serve.start(http_options={"host": options.host, "port": options.port})
        handle: DeploymentHandle = serve.run(build_application(options, chat_template), name=APP_NAME,
                                             route_prefix="/")
        del handle
        logger.info("serving %s on Ray Serve: %d engine replica(s), %s routing, on http://%s:%d", options.model,
                    options.replicas, options.router, options.host, options.port)
        stop.wait()
        logger.info("shutting down")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
