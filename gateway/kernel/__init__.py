"""The IDP kernel (spec 003, DESIGN §5).

Modules, in the order a transition request meets them:

* ``validate``  - spec 003 §5.2 (a)-(g), one check per rule, in order
* ``mandate``   - mandate JWT verification (EdDSA / ES256, trusted issuers, revocation)
* ``state``     - idp_id index and per-session state in KV, rebuilt from the log (§8.4)
* ``eventlog``  - the signed, hash-chained event log on ``PGW_EVENTLOG`` (§5.3, §8.2)
* ``policy``    - Cedar evaluation with ``context.idp.*`` (§5.4) and Enriched DENY (§6)
* ``hem``       - the human-escalation binding moment the gateway builds itself
* ``received``  - ``IDP_RECEIVED``: a valid IDP its session does not admit, still committed (§5.3)
* ``overdue``   - a PERMIT whose transition report never comes is closed by a ``timeout`` verdict
* ``checkpoint``- the log's head anchored outside the log; ``pgw log verify`` against it
* ``revocation``- live mandate revocation through the bus (``pgw mandate revoke``)
* ``audit``     - Audit Principal queries: the Session Audit Record (§4.2, §9)
* ``service``   - ``KernelService``, the gateway part that wires them on the bus
"""
