"""The one way a message crosses a process boundary we own: msgspec msgpack, decoded to a named type.

``pack`` encodes any msgspec Struct or dataclass (nested ones included, so a message
carries its parts typed, never bytes inside bytes); ``unpack`` decodes and validates
against the type the reader names (a dataclass's ``__post_init__`` runs, so a bad
``SamplingParams`` fails where it is read). Never pickle.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def pack(obj: object) -> bytes:
    return _encoder.encode(obj)


@overload
def unpack(data: bytes, type_: type[T]) -> T: ...


@overload
def unpack(data: bytes, type_: object) -> Any: ...  # a union of tagged Structs: annotate the result


def unpack(data: bytes, type_: object) -> Any:
    """Decode ``data`` as ``type_`` (a type, or a union of tagged Structs); raises msgspec.ValidationError."""
    return msgspec.msgpack.decode(data, type=type_)
