"""`splitfire prefill`: a prefill worker process."""

from __future__ import annotations

import argparse

from kvtransfer.transport import MooncakeTransport
from kvtransfer.writer import KVWriter
from prefill_worker.kv_sender import LayerwiseKVSender
from prefill_worker.service import PrefillService
from protos import splitfire_pb2_grpc as pb_grpc
from worker.config import WorkerConfig, worker_config_from
from worker.kv.routes import KVSplit
from worker.kv.staging import KVStaging
from worker.lifecycle import load_context, new_server, register_kv, serve
from worker.worker_service import WorkerService


async def run(cfg: WorkerConfig) -> None:
    mooncake = MooncakeTransport(cfg.transfer)
    ctx = load_context(cfg)
    llm = ctx.engine.llm
    region = register_kv(mooncake, llm)
    ranks = llm.ranks
    split = KVSplit(llm.model_config, ranks.tp if ranks is not None else 1, llm.config.block_size,
                    llm.kv.layout.element_size, tuple(ranks.stages) if ranks is not None and ranks.pp > 1 else ())
    sender = LayerwiseKVSender(KVWriter(mooncake, region, cfg.transfer.max_inflight_entries), split, llm.device,
                               llm.ranks, KVStaging(llm.kv, mooncake.register))
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
