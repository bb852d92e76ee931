"""`SamplingParams` (common/sampling_params.py, the one declaration) to and from its proto message.

The conversion is derived from the two declarations, field by field, instead of written out per
field: a field added to one and not the other fails at import, so the router, the proto and the
engine cannot drift apart. Rules: a proto `optional` field left unset, or a plain field at its zero
value, is the dataclass default (`max_tokens` 0 -> 16, `grammar` "" -> None); repeated fields and
maps become lists and dicts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from common.sampling_params import SamplingParams
from protos import splitfire_pb2 as pb

_DEFAULTS: dict[str, Any] = {f.name: getattr(SamplingParams(), f.name) for f in dataclasses.fields(SamplingParams)}
_PROTO = {f.name: f for f in pb.SamplingParams.DESCRIPTOR.fields}
if set(_DEFAULTS) != set(_PROTO):
    raise ImportError(f"SamplingParams and the proto's SamplingParams differ: only in the dataclass "
                      f"{sorted(set(_DEFAULTS) - set(_PROTO))}, only in the proto {sorted(set(_PROTO) - set(_DEFAULTS))}")
_PRESENCE = frozenset(n for n, f in _PROTO.items() if f.has_presence and not f.message_type)
_REPEATED = frozenset(n for n, f in _PROTO.items() if f.is_repeated and not f.message_type)
_MAPS = frozenset(n for n, f in _PROTO.items() if f.message_type is not None and f.message_type.GetOptions().map_entry)


def to_proto(sp: SamplingParams) -> pb.SamplingParams:
    fields: dict[str, Any] = {}
    for name in _DEFAULTS:
        value = getattr(sp, name)
        if value is None:
            continue  # unset: an optional field keeps no presence; a plain one its zero value
        fields[name] = value
    return pb.SamplingParams(**fields)


def from_proto(m: pb.SamplingParams) -> SamplingParams:
    """The message as SamplingParams (not validated: the caller validates where the request enters)."""
    fields: dict[str, Any] = {}
    for name, default in _DEFAULTS.items():
        value = getattr(m, name)
        if name in _PRESENCE:
            fields[name] = value if m.HasField(name) else default
        elif name in _MAPS:
            fields[name] = dict(value)
        elif name in _REPEATED:
            fields[name] = list(value)
        else:
            fields[name] = value or default
    return SamplingParams(**fields)
