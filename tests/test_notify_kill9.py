"""kill -9 of ``pgw notifier`` mid-burst, then a restart (issue 17, docs/notifications.md "Guarantees").

A real ``pgw notifier`` child process sends a burst of moments to three real
receivers (push service with http_ece, SMTP with STARTTLS, signed webhook that
answers slowly so sends are in flight) and is SIGKILLed part-way.

What is guaranteed and checked, per moment and channel: delivered at least
once (nothing lost), one job each (no moment notified twice by the scheduler),
and a repeat only for a job that was ``sending`` when the process died; every
repeat carries the first one's id (push Topic, mail Message-ID, webhook
Pgw-Notification-Id, which the receiver answers 409), so what a person sees is
once per moment per channel.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from consumers.notify.store import JOBS_BUCKET, Job, job_dec
from gateway.app import Gateway
from pgwcore.connect import connect
from subjects.client import Agent
from tests.chaos.harness import ServiceProc
from tests.moments import good_moment
from tests.notify_peers import smtp_server, webhook_receiver
from tests.polling import until
from tests.push_peer import push_service
from tests.test_notify_delivery import notifier_settings

pytestmark = [pytest.mark.slow, pytest.mark.chaos]
MOMENTS = 30
IN_FLIGHT = 4  # webhook sends held at the receiver when the notifier is killed (of its 8 at a time)


def toml(doc: dict[str, Any], path: tuple[str, ...] = ()) -> str:
    """Nested tables of strings, numbers, booleans and lists (JSON literals are TOML literals here)."""
    scalars = [f"{k} = {json.dumps(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    out = ([f"[{'.'.join(path)}]"] if path and scalars else []) + scalars
    for k, v in doc.items():
        if isinstance(v, dict):
            out.append(toml(v, (*path, k)))
    return "\n".join(out) + "\n"


async def jobs_now(js: Any) -> dict[str, Job]:
    kv = await js.key_value(JOBS_BUCKET)
    info = await js.stream_info(f"KV_{JOBS_BUCKET}", subjects_filter=f"$KV.{JOBS_BUCKET}.>")
    out: dict[str, Job] = {}
    for subject in info.state.subjects or {}:
        entry = await kv.get(subject.removeprefix(f"$KV.{JOBS_BUCKET}."))
        if entry.value:
            out[entry.key] = job_dec.decode(entry.value)
    return out


async def test_kill9_mid_burst_each_moment_once_per_channel(tmp_path: Path, make_config, nats_server, nc) -> None:
    js = nc.jetstream()
    with smtp_server(tmp_path) as relay:
        async with webhook_receiver(tmp_path) as hook, push_service() as ps:
            hook.hold_after = MOMENTS // 4  # later webhook sends stay in flight until the kill
            settings = {**notifier_settings(relay, hook), "concurrency": 8}
            cfg_file = tmp_path / "notifier.toml"
            cfg_file.write_text(toml({"notifier": settings}))
            config = make_config()
            proc = ServiceProc("notifier", nats_server.client_url, tmp_path / "notifier-data", cfg_file)
            gw_nc = await connect(nats_server.client_url, name="gateway")
            agent = Agent(nc, "planner")
            try:
                async with Gateway(config, gw_nc):
                    await proc.start()

                    async def subscribed() -> bool:
                        try:
                            r = await nc.request(config.subjects.push("alice", "subscribe"),
                                                 json.dumps({"subscription": sub}).encode(), timeout=1)
                        except Exception:  # noqa: BLE001 - the child is still starting
                            return False
                        return json.loads(r.data)["ok"]

                    _, sub = await ps.new_subscription()
                    await until(subscribed, timeout=30, interval=0.2, what=f"pgw notifier answers\n{proc.log_tail()}")
                    for _ in range(MOMENTS):
                        await agent.send_moment("alice", good_moment(), expires_in_s=3600)

                    async def some_sent() -> bool:  # a quarter answered, and the next IN_FLIGHT held
                        return len(hook.accepted) >= MOMENTS // 4 and len(hook.raw) >= MOMENTS // 4 + IN_FLIGHT

                    await until(some_sent, timeout=60, what="a quarter of the webhooks, and more in flight")
                    proc.kill9()
                    await proc.wait_dead()
                    hook.released.set()  # the held sends reach the receiver; their sender is gone
                    at_kill = await jobs_now(js)
                    in_flight = {k for k, j in at_kill.items() if j.status == "sending"}
                    sent_at_kill = sum(j.status == "sent" for j in at_kill.values())
                    assert sent_at_kill < 3 * MOMENTS, "the burst was over before the kill; nothing was tested"

                    await proc.start()

                    async def all_sent() -> dict[str, Job] | None:
                        jobs = await jobs_now(js)
                        done = len(jobs) == 3 * MOMENTS and all(j.status == "sent" for j in jobs.values())
                        return jobs if done else None

                    jobs = await until(all_sent, timeout=120, interval=0.2,
                                       what=f"every job sent after the restart\n{proc.log_tail()}")
            finally:
                await proc.stop()
                await agent.close()
                await gw_nc.drain()

            moments = {j.moment_id for j in jobs.values()}
            assert len(moments) == MOMENTS
            key_of = {j.notification_id: k for k, j in jobs.items()}

            # Webhook: every POST the receiver verified, by notification id.
            hook_posts = Counter(h["Pgw-Notification-Id"] for h, _ in hook.raw)
            push_posts = Counter(r["topic"] for r in await ps.received())
            mail_posts = Counter(m["Message-ID"].strip("<>").split("@")[0] for m in relay.box.messages)
            by_channel = {"webhook": hook_posts, "push": push_posts, "email": mail_posts}

            for channel, posts in by_channel.items():
                mine = [j for j in jobs.values() if j.channel.split("-")[0] == channel]
                ids = {j.moment_id[:32] if channel == "push" else j.notification_id for j in mine}
                assert set(posts) == ids, f"{channel}: every moment delivered (nothing lost, nothing foreign)"
                for pid, n in posts.items():
                    if n > 1:
                        job = next(j for j in mine if (j.moment_id[:32] if channel == "push" else j.notification_id) == pid)
                        assert job.key in in_flight, f"{channel}: repeat of {job.key}, which was not in flight at the kill"
                        assert n == 2, f"{channel}: {n} deliveries of one notification after one kill"
            # What the person sees: the webhook receiver took each notification once (a repeat got 409).
            assert sorted(h["id"] for h in hook.accepted) == sorted(j.notification_id for j in jobs.values()
                                                                   if j.channel == "webhook")
            assert set(hook.replays) <= {j.notification_id for k, j in jobs.items() if k in in_flight}
            assert all(key_of.get(i) for i in hook_posts)
            repeats = {c: sum(n - 1 for n in p.values()) for c, p in by_channel.items()}
            print(f"\nkill -9 after {sent_at_kill}/{3 * MOMENTS} jobs sent, {len(in_flight)} in flight; "
                  f"repeats after the restart: {repeats} (all of jobs in flight at the kill)")
