"""The hot path's counts (``pgwcore.metrics._TALLY``) reach their counters whenever they are read: none lost while
another thread scrapes at the same time, none counted twice, and a count taken off the main thread is still counted."""

from __future__ import annotations

import threading

from pgwcore import metrics

LABELS = {"outcome": "tally_test", "code": "none"}


def _read() -> float:
    return metrics.REGISTRY.get_sample_value("pgw_envelopes_total", LABELS) or 0.0


def test_counts_taken_while_another_thread_scrapes_are_all_counted_once():
    before = _read()
    stop = threading.Event()
    seen: list[list[float]] = [[], []]  # each scraper's reads, in its order

    def scrape(reads: list[float]) -> None:
        while not stop.is_set():
            reads.append(_read())
            metrics.render()

    scrapers = [threading.Thread(target=scrape, args=(reads,)) for reads in seen]
    for t in scrapers:
        t.start()
    try:
        for _ in range(20_000):
            metrics.count_envelope("tally_test", None)
    finally:
        stop.set()
        for t in scrapers:
            t.join()
    assert _read() - before == 20_000
    for reads in seen:  # each scraper saw the count grow, never go back, never run ahead
        assert reads and reads == sorted(reads) and reads[-1] - before <= 20_000, reads[:5]


def test_a_count_off_the_main_thread_and_a_direct_read_of_the_counter_see_every_count():
    before = _read()
    metrics.count_envelope("tally_test", None)
    t = threading.Thread(target=lambda: [metrics.count_envelope("tally_test", None) for _ in range(5)])
    t.start()
    t.join()
    direct = {tuple(s.labels.items()): s.value for s in next(iter(metrics.ENVELOPES.collect())).samples
              if s.name.endswith("_total")}
    assert direct[tuple(LABELS.items())] - before == 6
    assert _read() - before == 6
    verdicts = metrics.REGISTRY.get_sample_value("pgw_verdicts_total", {"verdict_class": "tally_test"}) or 0.0
    moments = metrics.REGISTRY.get_sample_value("pgw_binding_moments_total", {"agent": "tally_test"}) or 0.0
    metrics.count_verdict("tally_test")
    metrics.count_moment("tally_test", None)
    assert metrics.REGISTRY.get_sample_value("pgw_verdicts_total", {"verdict_class": "tally_test"}) == verdicts + 1
    assert metrics.REGISTRY.get_sample_value("pgw_binding_moments_total", {"agent": "tally_test"}) == moments + 1
