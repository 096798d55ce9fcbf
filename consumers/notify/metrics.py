"""The notifier's Prometheus metrics (on the shared registry, like the registrar's)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from pgwcore.metrics import REGISTRY

NOTIFICATIONS = Counter(
    "pgw_notifier_notifications_total",
    "Notification jobs finished or retried, by channel (email, webhook, push) and result: sent, retry, "
    "suppressed (a surface was open), skipped (the moment no longer waited), dropped (push 404/410), dead",
    ["channel", "result"],
    registry=REGISTRY,
)
SCHEDULED = Gauge("pgw_notifier_scheduled", "Notification jobs waiting for their time (incl. quiet hours, "
                  "reminders, retries)", registry=REGISTRY)
PRESENT = Gauge("pgw_notifier_present_principals", "Principals with a surface open (presence)", registry=REGISTRY)
