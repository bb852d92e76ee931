"""EAGLE-3 speculative decoding (`--speculative eagle3 --draft-model DIR`).

An EAGLE-3 head is one decoder layer trained to continue the target from the target's own
hidden states: the residual stream entering three of its layers (`eagle_aux_hidden_state_layer_ids`,
by default 2, n/2 and n-3 of n layers, as vLLM reads them) is concatenated and projected by `fc`
to the hidden size; the layer's attention reads `[input_layernorm(embedding of the next token),
hidden_norm(that projection)]` (2 x hidden wide), then the usual residual, post-attention norm and
MLP; the final norm feeds an LM head over a reduced draft vocabulary whose ids map back to the
target's through `d2t` (target id = draft id + d2t[draft id]). Each further draft step feeds the
head its own pre-norm output instead of the target's features ("training-time test").

The head has its own paged KV cache here (one layer). Its slots hold only positions whose target
features it has seen — a prompt served from the prefix cache, or prefilled on another worker,
has none, so the head's context starts where this engine's computation did (RoPE still uses the
absolute positions, so attention sees the true distances). Slots written from the head's own
outputs during a proposal are overwritten by the next proposal, which first feeds the target's
features of the tokens that verification accepted. Verification is the same as for every drafter
(`speculative.py`): output is exactly what the target alone produces, whatever the head proposes.

Checkpoints: the Hugging Face layout that EAGLE-3 heads are published in (`LlamaForCausalLMEagle3`:
`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, optionally `embed_tokens` — else the target's
embedding is used), as safetensors.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from common.errors import ModelLoadError
from engine.batch.model_runner import ModelRunner
from engine.batch.sequence import Sequence
from engine.loading.checkpoint import Checkpoint
from engine.model.attention import AttentionMetadata
from engine.model.decoder import Block, DecoderModel
from engine.model.kv_cache import KVCache, KVLayout
from engine.model.layers import Linear, RMSNorm
from engine.model.model_config import ModelConfig
from engine.model.rope import rope_cache
from engine.spec.speculative import PagedDrafter, SpecState, eligible

log = logging.getLogger("splitfire.engine")

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# config.json fields that describe the head, not its decoder layer (read here, not by ModelConfig).
HEAD_FIELDS = ("architectures", "model_type", "draft_vocab_size", "target_hidden_size", "eagle_config",
               "eagle_aux_hidden_state_layer_ids", "norm_before_residual")
# Features of positions not yet fed to the head, per sequence: bounds what a paused sequence holds
# (an 8B target's 3 x 4096 bf16 features are 24 KiB a position).
MAX_PENDING = 4096


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's decoder layer, read as a one-layer Llama
    aux_layers: tuple[int, ...]  # target layers whose entering residual stream the head reads, ascending
    draft_vocab: int
    norm_before_residual: bool  # hidden_norm's output (not its input) is the residual


def read_config(head_dir: Path, target: ModelConfig) -> Eagle3Config:
    path = head_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read the EAGLE-3 head's config: {e}") from e
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise ModelLoadError(f"{path}: architectures {archs} is not an EAGLE-3 head ({' or '.join(ARCHITECTURES)})")
    eagle = raw.get("eagle_config") or {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    n = target.num_layers
    aux = tuple(sorted(ids)) if ids else (2, n // 2, n - 3)
    if not aux or any(not isinstance(i, int) or not 0 <= i < n for i in aux) or len(set(aux)) != len(aux):
        raise ModelLoadError(f"{path}: auxiliary layers {list(aux)} are not distinct layers of the "
                             f"{n}-layer target")
    target_hidden = raw.get("target_hidden_size") or raw.get("hidden_size")
    layer_fields = {k: v for k, v in raw.items() if k not in HEAD_FIELDS}
    layer = ModelConfig.from_dict({**layer_fields, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                   "num_hidden_layers": 1}, source=f"{path} (the head's decoder layer)")
    if target_hidden != target.hidden_size or layer.hidden_size != target.hidden_size:
        raise ModelLoadError(f"{path}: a head for a target of hidden size {target_hidden} (its own {layer.hidden_size}); "
                             f"this target's is {target.hidden_size}")
    if layer.vocab_size != target.vocab_size:
        raise ModelLoadError(f"{path}: vocab_size {layer.vocab_size} is not the target's {target.vocab_size}")
    return Eagle3Config(layer, aux, int(raw.get("draft_vocab_size") or layer.vocab_size),
                        bool(raw.get("norm_before_residual", False)))


class Eagle3Head(nn.Module):
    def __init__(self, ec: Eagle3Config):
        super().__init__()
        cfg = ec.layer
        hidden = cfg.hidden_size
        self.cfg = cfg
        self.norm_before_residual = ec.norm_before_residual
        self.fc = Linear(len(ec.aux_layers) * hidden, hidden, bias=False)
        self.block = Block(cfg, cfg.layers[0])  # attn_norm = input_layernorm (of the embedding), mlp_norm = post-attention
        attn = self.block.attn
        attn.qkv = Linear(2 * hidden, attn.qkv.weight.shape[0], bias=cfg.qkv_bias)  # reads [embedding | hidden]
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.lm_head = Linear(hidden, ec.draft_vocab, bias=False)
        self.embed: nn.Embedding | None = None  # the head's own, when its checkpoint has one
        self.d2t: torch.Tensor | None = None  # [draft_vocab] int64 offsets to target ids
        self.rope = torch.empty(0)
        self.aux_layers = ec.aux_layers
        self.requires_grad_(False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output for the LM head, pre-norm output: the next draft step's `hidden`)."""
        b = self.block
        freqs = self.rope[positions].unsqueeze(1)
        e = b.attn_norm(embeds)
        if self.norm_before_residual:
            h = self.hidden_norm(hidden)
            residual = h.clone()
        else:
            residual, h = hidden, self.hidden_norm(hidden)
        a = b.attn(torch.cat([e, h], dim=-1), freqs, kv.layer(0), meta)
        x, residual = b.mlp_norm.add_forward(a, residual)
        return self.norm.add_forward(b.mlp(x), residual)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]


def load_head(head_dir: Path, target: ModelConfig, device: torch.device, dtype: torch.dtype) -> Eagle3Head:
    from engine.loading.weights import (  # the target's loader: same checks, same RoPE row order
        _load_block,
        _Loader,
    )

    ec = read_config(head_dir, target)
    if not any(head_dir.glob("*.safetensors")):
        bins = sorted(p.name for p in head_dir.glob("*.bin"))
        hint = (f" (it has {bins}: convert once with python -c \"import torch, safetensors.torch as s; "
                f"s.save_file(torch.load('{head_dir}/{bins[0]}', weights_only=True), '{head_dir}/model.safetensors')\")"
                if bins else "")
        raise ModelLoadError(f"{head_dir}: no *.safetensors weights for the EAGLE-3 head{hint}")
    ckpt = Checkpoint(head_dir)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(ec)
    finally:
        torch.set_default_dtype(default)
    load = _Loader(ckpt)
    root = "model." if ckpt.has("model.fc.weight") or ckpt.has("model.norm.weight") else ""
    layer = next((p for p in (f"{root}midlayer.", f"{root}layers.0.") if ckpt.has(p + "input_layernorm.weight")), None)
    if layer is None:
        raise ModelLoadError(f"{head_dir}: no decoder layer (midlayer.* or layers.0.*) in the EAGLE-3 head")
    with torch.no_grad():
        load.linear(head.fc, [f"{root}fc.weight"])
        _load_block(load, ec.layer, head.block, layer)
        load.norm(head.hidden_norm, layer + "hidden_norm.weight")
        load.norm(head.norm, f"{root}norm.weight")
        load.linear(head.lm_head, ["lm_head.weight" if ckpt.has("lm_head.weight") else f"{root}lm_head.weight"])
        embed = f"{root}embed_tokens.weight"
        if ckpt.has(embed):
            head.embed = nn.Embedding(target.vocab_size, target.hidden_size, _weight=torch.empty(
                target.vocab_size, target.hidden_size, dtype=dtype, device=device))
            head.embed.requires_grad_(False)
            load.copy(head.embed.weight, embed)
        if ckpt.has("d2t"):
            d2t = ckpt.get("d2t").long().to(device)
            if tuple(d2t.shape) != (ec.draft_vocab,):
                raise ModelLoadError(f"{head_dir}: d2t has shape {tuple(d2t.shape)}, draft_vocab_size is {ec.draft_vocab}")
            ids = torch.arange(ec.draft_vocab, device=device) + d2t
            if int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
                raise ModelLoadError(f"{head_dir}: d2t maps draft ids outside the target's vocabulary")
            head.d2t = d2t
        elif ec.draft_vocab != target.vocab_size:
            raise ModelLoadError(f"{head_dir}: draft_vocab_size {ec.draft_vocab} without a d2t mapping to the target's ids")
        ckpt.skip("t2d")
    unread = sorted(ckpt.unread)
    if unread:
        raise ModelLoadError(f"{head_dir}: {len(unread)} tensor(s) the EAGLE-3 head does not account for, e.g. {unread[:4]}")
    head.eval()
    return head


@dataclass
class HeadSeq:
    """A sequence as the head's runner sees it: local slots (the head's KV entries) in order, each
    with the token fed there (the token after that position) and its absolute position."""

    all_token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # slots whose K/V are in the head's cache
    valid: int = 0  # of those, slots fed from the target's features (kept across proposals)
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first position, features) not yet fed
    next_pos: int = 0  # the position after the last one with features (fed or pending)
    inputs: torch.Tensor | None = None  # the next forward's input hidden states, fc-projected (while drafting)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]


class Eagle3Drafter(PagedDrafter):
    def __init__(self, head_dir: Path, target: DecoderModel, k: int, max_batch: int, device: torch.device,
                 dtype: torch.dtype, block_size: int, num_blocks: int, max_positions: int):
        super().__init__(k, max_batch, num_blocks, block_size)
        self.head = load_head(head_dir, target.cfg, device, dtype)
        self.target = target
        cfg = self.head.cfg
        self.head.rope = rope_cache(cfg.layers[0].rope, cfg.head_dim, max_positions, device)
        planes, heads, dim = cfg.kv_entry
        self.kv = KVCache(KVLayout(1, num_blocks, block_size, heads, dim, dtype, planes), device)
        self.runner = ModelRunner(self.head, self.kv, device)  # type: ignore[arg-type]  # its prepare() only
        self.device = device
        self.aux_layers = self.head.aux_layers  # the target must capture these (DecoderModel.aux_layers)
        log.info("event=eagle3_head_loaded head=%s aux_layers=%s draft_vocab=%d kv_blocks=%d", head_dir,
                 list(self.aux_layers), self.head.lm_head.weight.shape[0], num_blocks)

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        """The target's features for positions start.. of `seq` (tokens it committed this step). Kept
        only for requests that can be drafted for, and at most the latest MAX_PENDING positions while
        drafting is paused (a batch above --speculative-max-batch): the head's context then has a gap,
        as after a prefix hit."""
        if features.shape[0] == 0 or not eligible(seq):
            return
        st: SpecState = seq.spec if seq.spec is not None else SpecState()
        seq.spec = st
        d: HeadSeq = st.draft_cache if st.draft_cache is not None else HeadSeq(next_pos=start)
        st.draft_cache = d
        if start + features.shape[0] <= d.next_pos:
            return  # positions recomputed after a preemption: the head has them already
        if start < d.next_pos:
            features = features[d.next_pos - start :]
            start = d.next_pos
        d.pending.append((start, features.detach().clone()))
        d.next_pos = start + features.shape[0]
        excess = sum(f.shape[0] for _, f in d.pending) - MAX_PENDING
        while excess > 0:
            first, f = d.pending[0]
            if f.shape[0] <= excess:
                d.pending.pop(0)
                excess -= f.shape[0]
            else:
                d.pending[0] = (first + excess, f[excess:])
                excess = 0

    def _forward(self, order: list[HeadSeq], ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, rows: list[int]) -> tuple[list[int], torch.Tensor]:
        """Next tokens, and each row's pre-norm output (the next draft step's input features)."""
        positions = torch.tensor([p for d in order for p in d.positions[d.num_computed_tokens:]],
                                 dtype=torch.long, device=self.device)
        hidden = torch.cat([d.inputs for d in order if d.inputs is not None])
        embeds = self.head.embed(ids) if self.head.embed is not None else self.target.embed_tokens(ids)
        normed, prenorm = self.head(embeds, hidden, positions, self.kv, meta)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        draft_ids = self.head.lm_head(normed.index_select(0, index)).argmax(-1)
        return self.head.to_target_ids(draft_ids).tolist(), prenorm.index_select(0, index)

    def _computed(self, d: HeadSeq, first: bool) -> None:
        if first:  # the catch-up chunk: its slots came from the target's features
            d.valid = d.num_tokens
        d.num_computed_tokens = d.num_tokens

    def _feed(self, d: HeadSeq, token: int, carry: torch.Tensor, row: int) -> None:
        d.all_token_ids.append(token)  # fed next round at the next position, with this row's output
        d.positions.append(d.positions[-1] + 1)
        d.inputs = carry[row : row + 1]

    def _done(self, d: HeadSeq, drafts: list[int]) -> None:
        # keep the slots fed from target features; drop those fed from the head's own outputs
        d.num_computed_tokens = d.valid
        del d.all_token_ids[d.valid:], d.positions[d.valid:]
        d.inputs = None

    def _catch_up(self, seq: Sequence, k: int) -> HeadSeq | None:
        """The head's state with this sequence's pending features laid out as new slots (None: nothing
        to feed — no features yet — or no room in the head's cache)."""
        st: SpecState | None = seq.spec
        d: HeadSeq | None = st.draft_cache if st is not None else None
        if d is None or not d.pending:
            return None
        tokens = seq.all_token_ids
        rows = sum(f.shape[0] for _, f in d.pending)
        if not self._cover(d, d.num_computed_tokens + rows + k - 1):
            return None
        for start, f in d.pending:
            for p in range(start, start + f.shape[0]):
                d.all_token_ids.append(tokens[p + 1])  # the token after position p: it exists once p's features do
                d.positions.append(p)
        d.inputs = self.head.fc(torch.cat([f for _, f in d.pending]))
        d.pending = []
        return d
