"""Between protobuf messages and engine types; validation errors name the field."""

from __future__ import annotations

from common.errors import RequestError
from common.sampling_params import SamplingParams
from engine.batch.sequence import TokenLogprob
from engine.outputs import RequestOutput
from protos import sampling
from protos import splitfire_pb2 as pb


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    return sampling.from_proto(m).validate()


def token_ids_from_proto(ids) -> list[int]:
    out = list(ids)
    if not out:
        raise RequestError("token_ids is empty")
    return out


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top]
    )


def logprob_from_proto(m: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob, list(zip(m.top_ids, m.top_logprobs, strict=True)))


def event_from_output(out: RequestOutput) -> pb.GenerateEvent:
    ev = pb.GenerateEvent(token_ids=out.token_ids, text=out.text)
    if out.logprobs:
        ev.logprobs.extend(logprob_to_proto(lp) for lp in out.logprobs)
    if out.finished:
        ev.finish_reason = out.finish_reason or ""
        if isinstance(out.stop_reason, str):
            ev.stop_string = out.stop_reason
        elif out.stop_reason is not None:
            ev.stop_token_id = out.stop_reason
        ev.usage.CopyFrom(pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                                   cached_tokens=out.num_cached_tokens))
    return ev


def kv_dtype_name(dtype: object) -> str:
    """A KV cache element type as the transfer handshake names it (torch's name without the prefix)."""
    return str(dtype).removeprefix("torch.")
