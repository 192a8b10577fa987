"""The bytes of ``engine/tp_messages.py``'s plans and replies: msgpack through msgspec, a plan as
``[kind, fields]`` (``kind`` names its class) so that one decoder reads any of them.

Imported by ``TpGroup`` when it sends or receives, so an engine of one rank never imports msgspec."""

from __future__ import annotations

import msgspec

from engine.tp_messages import Call, CallReply, KeepAlive, Plan, StepPlan, Stop

_KINDS: dict[str, type] = {"step": StepPlan, "keepalive": KeepAlive, "stop": Stop, "call": Call}
_NAMES = {cls: kind for kind, cls in _KINDS.items()}
_ENCODER = msgspec.msgpack.Encoder()
_HEAD = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_PLANS: dict[str, msgspec.msgpack.Decoder[Plan]] = {
    kind: msgspec.msgpack.Decoder(cls) for kind, cls in _KINDS.items()}
_REPLY = msgspec.msgpack.Decoder(CallReply)


def encode_plan(plan: Plan) -> bytes:
    return _ENCODER.encode((_NAMES[type(plan)], plan))


def decode_plan(data: bytes) -> Plan:
    kind, fields = _HEAD.decode(data)
    plan: Plan = _PLANS[kind].decode(fields)
    return plan


def encode_reply(reply: CallReply) -> bytes:
    return _ENCODER.encode(reply)


def decode_reply(data: bytes) -> CallReply:
    return _REPLY.decode(data)
