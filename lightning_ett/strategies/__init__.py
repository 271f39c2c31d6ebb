"""Lightning strategies of lightning-ett."""

from lightning_ett.instrument.environment import mark_imported
from lightning_ett.strategies.ett import OVERLAP_HOOK, ETTStrategy

__all__ = ["ETTStrategy", "OVERLAP_HOOK"]  # noqa: RUF022 - the strategy first

mark_imported()  # the ``import`` phase ends once Lightning and torch are in
