"""The model's tokenizer (HF `tokenizers`) and chat template, loaded from a model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder

from common.chat_template import render_chat
from common.errors import ModelLoadError, RequestError


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):  # AddedToken serialised as {"content": ...}
        return v.get("content")
    return v


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _byte_pieces(hf: HFTokenizer) -> list[bytes]:
    """What the ByteLevel decoder makes of each token: its characters mapped back to bytes (a
    character outside the alphabet, in an added token, stands for its own UTF-8), special tokens
    skipped as `decode(..., skip_special_tokens=True)` skips them."""
    chars = _byte_level_chars()
    special = {a.content for a in hf.get_added_tokens_decoder().values() if a.special}
    size = hf.get_vocab_size(with_added_tokens=True)
    pieces = [b""] * size
    for token, i in hf.get_vocab(with_added_tokens=True).items():
        if i >= size or token in special:
            continue
        pieces[i] = b"".join(bytes((chars[c],)) if c in chars else c.encode() for c in token)
    return pieces


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no tokenizer.json")
        try:
            self.hf = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot load tokenizer: {e}") from e
        cfg = self._read_json(model_dir / "tokenizer_config.json")
        gen = self._read_json(model_dir / "generation_config.json")
        model_cfg = self._read_json(model_dir / "config.json")
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()))
        self._pieces: list[bytes] | None = None
        self.special_tokens = {
            k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (s := _token_str(cfg.get(k)))
        }
        eos: set[int] = set()
        for src in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, list):
                eos.update(int(x) for x in src)
        if (eos_text := self.special_tokens.get("eos_token")) is not None and (
                tid := self.hf.token_to_id(eos_text)) is not None:
            eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any]:
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: corrupt JSON: {e}") from e

    def byte_pieces(self) -> list[bytes] | None:
        """Each token id's bytes as `decode` renders them (special tokens: none), for byte-level BPE
        tokenizers (a plain ByteLevel decoder); None for any other decoder. Made once, on first use."""
        if self._pieces is None:
            self._pieces = _byte_pieces(self.hf) if isinstance(self.hf.decoder, ByteLevelDecoder) else []
        return self._pieces or None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        if not self.chat_template:
            raise RequestError("this model has no chat template; use /v1/completions")
        return render_chat(self.chat_template, messages, self.special_tokens, add_generation_prompt, **kw)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> list[int]:
        # As transformers does: the template already places any BOS, so no special tokens are added.
        return self.encode(self.render_chat(messages, add_generation_prompt, **kw), add_special_tokens=False)
