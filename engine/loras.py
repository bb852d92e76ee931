"""The LoRA adapters resident in an engine: which slot each holds, loading and unloading them.

`--max-loras` slots are allocated once (`DecoderModel.enable_lora`); an adapter loaded takes a free
slot, its factors written into every projection's stack (a projection it does not adapt gets zeros).
Unloading while requests still run under the adapter lets them finish: the adapter takes no new
requests and its slot is freed once the last of them is gone (`LLMEngine` calls `sweep` each step).
Called on the engine thread only (the serving shell goes through `AsyncEngine.call`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.errors import ModelLoadError, RequestError
from engine.engine_config import EngineConfig
from engine.loading.lora_adapters import LoRAAdapter, LoRAError, read_adapter
from engine.model.decoder import DecoderModel
from engine.model.kv_cache import KVCache

log = logging.getLogger("splitfire.engine")


class LoRAManager:
    def __init__(self, model: DecoderModel, max_loras: int, max_rank: int, c_half: bool = False):
        model.enable_lora(max_loras, max_rank, c_half)
        self.model = model
        self.max_rank = max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: dict[str, int] = {}
        self.free = list(range(max_loras - 1, -1, -1))  # (slot 0 handed out first)
        self.unloading: set[str] = set()  # no new requests; freed when none runs under it
        # Tensor parallel: rank 0 tells the other ranks, which hold their own slices in the same slots.
        self.on_install: Callable[[LoRAAdapter, int], None] | None = None
        self.on_free: Callable[[str], None] | None = None

    def names(self) -> list[str]:
        return [n for n in self.adapters if n not in self.unloading]

    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read, check and place an adapter; LoRAError (a RequestError) names what is wrong, and nothing
        already loaded is touched."""
        self.check_name(name)
        t0 = time.perf_counter()
        return self.install(read_adapter(name, path, self.model, self.max_rank), t0)

    def check_name(self, name: str) -> None:
        if not name or "\x00" in name:
            raise LoRAError(f"adapter name {name!r} is empty or holds a NUL")
        if name in self.adapters:
            raise LoRAError(f"adapter {name!r} is already loaded" + (" (unloading)" if name in self.unloading else ""))

    def install(self, adapter: LoRAAdapter, t0: float | None = None, slot: int | None = None) -> LoRAAdapter:
        """Place an adapter read beforehand (`read_adapter`, off the engine thread) in a free slot (`slot`:
        that one — another rank mirroring rank 0)."""
        name = adapter.name
        self.check_name(name)
        t0 = time.perf_counter() if t0 is None else t0
        if not self.free:
            raise LoRAError(f"adapter {name!r}: all {len(self.slots)} adapter slots are taken (--max-loras); "
                            "unload one first")
        if slot is None:
            slot = self.free.pop()
        else:
            self.free.remove(slot)
        self._write(slot, adapter)
        self.adapters[name], self.slots[name] = adapter, slot
        if self.on_install is not None:
            try:
                self.on_install(adapter, slot)
            except LoRAError:  # another rank refused it (and those that took it have dropped it): undone here
                del self.adapters[name], self.slots[name]
                self._write(slot, None)
                self.free.append(slot)
                raise
        log.info("event=lora_loaded name=%s path=%s rank=%d slot=%d projections=%d mib=%.2f load_s=%.3f", name,
                 adapter.path,
                 adapter.rank, slot, len(adapter.factors), adapter.nbytes / 2**20, time.perf_counter() - t0)
        return adapter

    def _write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """`adapter`'s factors into `slot` (None: the slot cleared)."""
        for i, name, lin, _ in self.model.lora_targets():
            if lin.lora is None:
                continue
            ab = adapter.factors.get((i, name)) if adapter is not None else None
            if ab is None:
                lin.lora.clear(slot)
            else:
                lin.lora.set(slot, *ab)
        for i, layer in zip(self.model.layer_ids, self.model.layers, strict=True):
            ex = getattr(layer.mlp, "experts", None)
            if ex is None or ex.lora is None:
                continue
            factors = adapter.expert_factors.get(i) if adapter is not None else None
            if factors is None:
                ex.lora.clear(slot)
            else:
                ex.lora.set(slot, factors)

    def slot(self, name: str) -> int:
        """The slot of an adapter a new request runs under; RequestError when there is none."""
        if name not in self.slots or name in self.unloading:
            raise RequestError(f"LoRA adapter {name!r} is not loaded" + (
                f" (loaded: {', '.join(self.names())})" if self.adapters else ""))
        return self.slots[name]

    def unload(self, name: str, in_use: Callable[[str], bool]) -> bool:
        """Take an adapter out of service. True: freed now; False: requests still run under it (it is
        freed by `sweep` once they are gone)."""
        if name not in self.adapters or name in self.unloading:
            raise LoRAError(f"adapter {name!r} is not loaded")
        if in_use(name):
            self.unloading.add(name)
            log.info("event=lora_unloading name=%s (requests still run under it)", name)
            return False
        self._free(name)
        return True

    def sweep(self, in_use: Callable[[str], bool]) -> None:
        for name in [n for n in self.unloading if not in_use(n)]:
            self.unloading.discard(name)
            self._free(name)

    def _free(self, name: str) -> None:
        slot = self.slots.pop(name)
        del self.adapters[name]
        self.free.append(slot)
        log.info("event=lora_unloaded name=%s slot=%d", name, slot)
        if self.on_free is not None:
            self.on_free(name)

    def free_now(self, name: str) -> None:
        """Another rank: rank 0 has freed it (no request runs under it any more)."""
        self.unloading.discard(name)
        self._free(name)


def start_loras(config: EngineConfig, model: DecoderModel, kv: KVCache, ranks: Any) -> LoRAManager:
    """The resident adapters of an engine started with --lora-modules / --enable-lora: the start's adapters
    loaded (a bad one refused naming it), the other model-parallel ranks (`ranks`: an `engine.ranks.RankGroup`,
    or None) told of every later change."""
    if config.lora_dtype == "float16":  # (the setting exists for that loop: refused where it cannot run)
        why = model.cpu_layers_unavailable(kv)
        if why:
            raise ModelLoadError(f"--lora-dtype float16 sets the adapter factors the fused CPU decode loop reads, and "
                                 f"this model's decode steps do not run there ({why}): drop it")
    loras = LoRAManager(model, config.max_loras, config.max_lora_rank, config.lora_dtype == "float16")
    for name, path in config.lora_modules.items():
        try:
            loras.load(name, path)
        except LoRAError as e:
            raise ModelLoadError(f"--lora-modules {name}={path}: {e}") from e
    if ranks is not None:  # (the other ranks loaded --lora-modules themselves, in the same slots)
        loras.on_install = lambda a, slot: ranks.lora(("install", a.name, str(a.path), slot))
        loras.on_free = lambda name: ranks.lora(("free", name))
    return loras


def require_loras(loras: LoRAManager | None) -> LoRAManager:
    """An engine's adapters, or the RequestError of a worker started without room for any."""
    if loras is None:
        raise RequestError("this worker serves no LoRA adapters: start it with --enable-lora or --lora-modules")
    return loras

