"""The one way to patch something we do not own — Lightning, torch, a user's object — and take it back.

For hooks Lightning does not offer (timing ``save_checkpoint``, choosing a resume path in
``resume_start``), process-wide switches a callback needs only while it runs (inductor's
cache directory, torch's zip CRC in writer threads) and a user's Metric whose
``compute`` we listen to. Every patch is recorded and undone in reverse order by
:meth:`Patches.undo`, which callbacks call from ``teardown`` *and* ``on_exception``.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from typing_extensions import Self

_MISSING = object()


def _plain_class_attribute(cls: type, name: str) -> bool:
    """``name`` is defined on ``cls`` (or a base) and is not a data descriptor such as a property."""
    for klass in cls.__mro__:
        if name in vars(klass):
            attribute = vars(klass)[name]
            return not (hasattr(attribute, "__set__") or hasattr(attribute, "__delete__"))
    return False


class Patches:
    """A stack of patches, undone together (last first); undo is idempotent."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Any, Any, Any]] = []

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name``; undo puts back exactly what was there.

        * ``owner`` holds ``name`` itself (an instance attribute, a module global, a class's own
          method, staticmethod wrapper included): the raw value is restored.
        * ``name`` comes from the class (a method shadowed on one instance, or a base class's
          attribute on a subclass): undo deletes ours, so the inherited one shows through again.
        * anything else (a property, a torch config module's entry): read, and set back.
        """
        own = getattr(owner, "__dict__", {})
        if name in own:
            old = own[name]
        elif isinstance(owner, type) or _plain_class_attribute(type(owner), name):
            old = _MISSING
        else:
            old = getattr(owner, name, _MISSING)
        setattr(owner, name, value)
        self._undo.append(("attr", owner, name, old))

    def setitem(self, mapping: MutableMapping[str, Any], key: str, value: Any) -> None:
        """Set ``mapping[key]`` (e.g. ``os.environ``); undo restores or removes it."""
        self._undo.append(("item", mapping, key, mapping.get(key, _MISSING)))
        mapping[key] = value

    def call_on_undo(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` when undoing, in its place in the stack (e.g. to drop a cache that saw the patched values)."""
        self._undo.append(("call", fn, None, None))

    def undo(self) -> None:
        while self._undo:
            kind, owner, name, old = self._undo.pop()
            if kind == "call":
                owner()
            elif kind == "item":
                if old is _MISSING:
                    owner.pop(name, None)
                else:
                    owner[name] = old
            elif old is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, old)

    def __len__(self) -> int:
        return len(self._undo)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()
