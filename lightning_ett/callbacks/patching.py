"""Shadow a method on one Lightning object for the length of a fit, and take it back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def shadow_method(owner: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Set ``owner.name`` on the instance only; the returned undo lets the class's method show through again.

    For hooks Lightning does not offer (timing ``save_checkpoint``, choosing a resume path in
    ``resume_start``); the class and other instances are untouched.
    """
    setattr(owner, name, replacement)
    return lambda: vars(owner).pop(name, None)
