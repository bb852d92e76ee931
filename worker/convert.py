"""Between protobuf messages and engine types; validation errors name the field."""

from __future__ import annotations

from common.errors import RequestError
from common.sampling_params import SamplingParams
from engine.batch.sequence import TokenLogprob
from engine.llm_engine import RequestOutput
from protos import splitfire_pb2 as pb


def sampling_from_proto(m: pb.SamplingParams) -> SamplingParams:
    sp = SamplingParams(
        max_tokens=m.max_tokens or 16,
        temperature=m.temperature if m.HasField("temperature") else 1.0,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        top_k=m.top_k,
        min_p=m.min_p,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        frequency_penalty=m.frequency_penalty,
        presence_penalty=m.presence_penalty,
        seed=m.seed if m.HasField("seed") else None,
        stop=list(m.stop),
        stop_token_ids=list(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        grammar=m.grammar or None,
        resumed_tokens=m.resumed_tokens,
        logit_bias=dict(m.logit_bias),
        min_tokens=m.min_tokens,
    )
    return sp.validate()


def sampling_to_proto(sp: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(
        max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty, frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty, stop=sp.stop, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
        grammar=sp.grammar or "", resumed_tokens=sp.resumed_tokens, logit_bias=sp.logit_bias,
        min_tokens=sp.min_tokens,
    )
    if sp.seed is not None:
        m.seed = sp.seed
    if sp.logprobs is not None:
        m.logprobs = sp.logprobs
    return m


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
        ev.usage.CopyFrom(pb.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                                   cached_tokens=out.num_cached_tokens))
    return ev
