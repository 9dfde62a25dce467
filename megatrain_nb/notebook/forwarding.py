"""A read-only (or settable) attribute of one object that is an attribute of one of its parts:
how a composed class shows its parts' state as its own without a method each."""
from __future__ import annotations

from operator import attrgetter
from typing import Any, Optional


class Forward:
    """``path`` (dotted, from the owner: ``"_status.state"``) read on access; ``call``: call what
    it names; ``settable``: setting it sets the part's attribute; ``docs``: the help of each
    attribute, by name; ``wrap``: what the value is handed to before it is returned (a type
    that prints it for a reader)."""

    def __init__(self, path: str, *, call: bool = False, settable: bool = False, docs: Optional[dict] = None,
                 wrap: Any = None):
        self.path, self.call, self.settable, self.docs, self.wrap = path, call, settable, docs or {}, wrap

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.owner, self.__doc__ = name, owner.__name__, self.docs.get(name)

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        value = attrgetter(self.path)(obj)
        value = value() if self.call else value
        return self.wrap(value) if self.wrap is not None else value

    def __set__(self, obj: Any, value: Any) -> None:
        if not self.settable:
            raise AttributeError(f"{self.owner}.{self.name} cannot be set")
        head, _, last = self.path.rpartition(".")
        setattr(attrgetter(head)(obj) if head else obj, last, value)
