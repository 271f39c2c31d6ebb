"""Lightning strategies of lightning-ett."""

from lightning_ett.strategies.ett import OVERLAP_HOOK, ETTStrategy

__all__ = ["ETTStrategy", "OVERLAP_HOOK"]
