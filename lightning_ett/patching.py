"""The one way to patch something we do not own — Lightning, torch, a user's object — and take it back.

For hooks Lightning does not offer (timing ``save_checkpoint``, choosing a resume path in
``resume_start``), process-wide switches a callback needs only while it runs (inductor's
cache directory, torch's zip CRC in writer threads) and a user's Metric whose
``compute`` we listen to. Every patch is recorded and undone in reverse order by
:meth:`Patches.undo`, which callbacks call from ``teardown`` *and* ``on_exception``.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from typing_extensions import Self

_MISSING = object()


class Patches:
    """A stack of patches, undone together (last first); undo is idempotent."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Any, Any, Any]] = []

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name``. On an instance whose class defines ``name``, undo deletes the
        instance attribute so the class's own shows through again (other instances never change)."""
        own = name in getattr(owner, "__dict__", {})
        shadows_class = not own and not isinstance(owner, type) and hasattr(type(owner), name)
        old = _MISSING if shadows_class else getattr(owner, name, _MISSING)
        setattr(owner, name, value)
        self._undo.append(("attr", owner, name, old))

    def setitem(self, mapping: MutableMapping[str, Any], key: str, value: Any) -> None:
        """Set ``mapping[key]`` (e.g. ``os.environ``); undo restores or removes it."""
        self._undo.append(("item", mapping, key, mapping.get(key, _MISSING)))
        mapping[key] = value

    def undo(self) -> None:
        while self._undo:
            kind, owner, name, old = self._undo.pop()
            if kind == "item":
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
