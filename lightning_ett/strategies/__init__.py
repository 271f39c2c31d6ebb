"""Lightning strategies of lightning-ett (``ETTStrategy`` is tracked in issue #3)."""

__all__: list[str] = []
