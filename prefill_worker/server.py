"""`splitfire prefill`: a prefill worker process."""

from __future__ import annotations

import argparse

from kvtransfer.descriptors import KVRegion
from kvtransfer.mooncake_engine import MooncakeEngine
from kvtransfer.writer import KVWriter
from prefill_worker.kv_sender import LayerwiseKVSender
from prefill_worker.service import PrefillService
from protos import splitfire_pb2_grpc as pb_grpc
from worker.config import WorkerConfig, worker_config_from
from worker.lifecycle import load_context, new_server, serve
from worker.worker_service import WorkerService


def kv_region(engine) -> KVRegion:
    layout = engine.kv.layout
    return KVRegion(engine.kv.base_address, layout.num_layers, layout.num_blocks, layout.page_bytes)


def register_kv(mooncake: MooncakeEngine, engine) -> KVRegion:
    region = kv_region(engine)
    dev = engine.device
    location = f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu:0"
    mooncake.register(region.base_address, engine.kv.nbytes, location)
    return region


async def run(cfg: WorkerConfig) -> None:
    mooncake = MooncakeEngine(cfg.transfer)
    ctx = load_context(cfg)
    engine = ctx.engine.engine
    region = register_kv(mooncake, engine)
    sender = LayerwiseKVSender(KVWriter(mooncake, region, cfg.transfer.max_inflight_entries),
                               engine.config.block_size, engine.device)
    ctx.engine.observer = sender
    server = new_server()
    pb_grpc.add_PrefillServicer_to_server(PrefillService(ctx, sender, region), server)
    def settled(rid: str) -> bool:
        sender.remove_plan(rid)  # (engine thread, between steps) nothing more is sent for it
        return sender.settled(rid)

    pb_grpc.add_WorkerServicer_to_server(WorkerService(ctx, writes_settled=settled), server)
    try:
        await serve(ctx, server)
    finally:
        mooncake.close()


def config_from(args: argparse.Namespace) -> WorkerConfig:
    return worker_config_from(args, "prefill")
