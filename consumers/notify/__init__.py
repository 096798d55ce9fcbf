"""The notifier (issue 17, docs/notifications.md): tells a principal a moment waits.

``pgw notifier`` (and ``pgw up``) runs :class:`consumers.notify.service.Notifier`:
it answers the surfaces' push and presence subjects (``responders``), follows
``PGW_SURFACE`` with a durable consumer, and sends each waiting moment once per
channel the principal configured: Web Push (``webpush``: RFC 8030/8291/8292),
e-mail (``email``: SMTP with STARTTLS) and a signed webhook (``webhook``).
"""
