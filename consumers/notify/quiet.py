"""Quiet hours per principal, in the principal's own time zone (docs/notifications.md)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pgwcore.notifier_config import PrincipalNotify


def quiet_until(pc: PrincipalNotify, now: float) -> float | None:
    """When the principal's quiet hours end, if ``now`` falls in them; else None.

    ``"22:00-07:00"`` wraps midnight. Wall-clock times are read in
    ``pc.timezone`` (zoneinfo), so a daylight-saving change moves the window
    with the principal's clock.
    """
    window = pc.quiet
    if window is None:
        return None
    start, end = window
    local = datetime.fromtimestamp(now, pc.zone)
    t = local.time().replace(tzinfo=None)
    inside = (start <= t < end) if start < end else (t >= start or t < end)
    if not inside:
        return None
    day = local.date() if t < end else local.date() + timedelta(days=1)
    wake = datetime.combine(day, end, tzinfo=pc.zone)
    return wake.timestamp()
