"""`splitfire decode` (remote prefill over Mooncake) and `splitfire serve` (colocated, role both)."""

from __future__ import annotations

import argparse

from aiohttp import web

from decode_worker.http_stream import add_routes
from decode_worker.mux_stream import add_mux_route
from decode_worker.service import DecodeService
from protos import splitfire_pb2_grpc as pb_grpc
from worker.config import WorkerConfig, worker_config_from
from worker.lifecycle import load_context, new_server, register_kv, serve
from worker.worker_service import WorkerService


async def run(cfg: WorkerConfig) -> None:
    ctx = load_context(cfg)
    mooncake = None
    if cfg.role == "decode":
        from kvtransfer.transport import MooncakeTransport

        mooncake = MooncakeTransport(cfg.transfer)
        region = register_kv(mooncake, ctx.engine.llm)
        decode = DecodeService(ctx, region, mooncake.segment)
    elif cfg.on_demand_models:  # several base models: each request's own, loaded on demand
        from decode_worker.hosted_service import HostedDecodeService
        from worker.lifecycle import host_models

        ctx.host = host_models(ctx, DecodeService)
        decode = HostedDecodeService(ctx, ctx.host)
    else:
        decode = DecodeService(ctx)
    server = new_server()
    pb_grpc.add_DecodeServicer_to_server(decode, server)
    pb_grpc.add_WorkerServicer_to_server(WorkerService(ctx, extra_abort=decode.cancel_remote), server)

    def routes(app: web.Application) -> None:  # the token streams on the HTTP port: plain and multiplexed
        add_routes(app, decode)
        add_mux_route(app, decode)

    try:
        await serve(ctx, server, routes)
    finally:
        if mooncake is not None:
            mooncake.close()


def config_from(args: argparse.Namespace, role: str) -> WorkerConfig:
    return worker_config_from(args, role)
