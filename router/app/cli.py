"""`splitfire router`."""

from __future__ import annotations

import argparse
import asyncio
import logging

from aiohttp import web

from common import gc_heap
from router.core.config import RouterConfig, add_router_args, router_config_from

log = logging.getLogger("splitfire.router")


async def run(cfg: RouterConfig) -> None:
    from router.app.server import Router, load_extra_models, load_model_info

    tokenizer, name, max_len = load_model_info(cfg)
    extra = load_extra_models(cfg)
    router = Router(cfg, tokenizer, name, max_len, extra)
    if extra:
        name = ", ".join([name, *(e[0] for e in extra)])
    try:
        import uvloop  # noqa: F401  (installed: the loop policy is set by main())
    except ImportError:
        pass
    # keepalive_timeout also bounds how long a new connection may take to send its first request's
    # head (aiohttp closes a connection still waiting for one): slow-header clients are dropped.
    runner = web.AppRunner(router.app(), access_log=None, handler_cancellation=True,
                           keepalive_timeout=cfg.keepalive_timeout_s)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port, backlog=1024, reuse_port=cfg.reuse_port or None).start()
    log.info("event=router_ready port=%d model=%s policy=%s endpoints=%d redis=%s", cfg.port, name, cfg.policy,
             len(router.registry.all()), bool(cfg.redis_url))
    print(f"splitfire router ready on http://{cfg.host}:{cfg.port} (model {name})", flush=True)
    gc_heap.release("router")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Keys and their settings are read again on SIGHUP; admitted streams keep going.
    loop.add_signal_handler(signal.SIGHUP, router.tenants.reload)
    await stop.wait()
    await runner.cleanup()


def _router(args: argparse.Namespace) -> int:
    cfg = router_config_from(args)
    try:
        import uvloop

        uvloop.run(run(cfg))
    except ImportError:
        asyncio.run(run(cfg))
    return 0


def add_subcommands(sub) -> None:
    p = sub.add_parser("router", help="run the OpenAI-compatible router")
    add_router_args(p)
    p.set_defaults(func=_router)
