"""The chaos harness's log excerpt: a failing test shows a service's last errors whole, not cut by the tail."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.chaos.harness import ERROR_CHARS, log_excerpt

# A service's log as `pgw --log-format json` writes it: the project's own logging set-up, one
# error whose traceback is deep, then enough ordinary lines to push it out of a 3,000-character tail.
_SERVICE = """
import sys
from pgwcore.logs import configure_logging, get_logger
configure_logging("json", "INFO")
log = get_logger("pgw.kernel")
def deep(n):
    if n == 0:
        raise TimeoutError("the event log write timed out")
    deep(n - 1)
try:
    deep(30)
except TimeoutError:
    log.exception("declaration failed closed", code="KERNEL_UNAVAILABLE")
for i in range(200):
    log.info("still running", i=i)
"""


def _service_log() -> str:
    done = subprocess.run([sys.executable, "-c", _SERVICE], capture_output=True, text=True, timeout=60, check=True)
    return done.stderr + done.stdout


def test_an_error_before_the_tail_is_shown_whole() -> None:
    text = _service_log()
    error = next(line for line in text.splitlines() if '"exception"' in line)
    assert len(error) < ERROR_CHARS
    assert error not in text[-3000:]  # the plain tail had cut it: the case this is for
    excerpt = log_excerpt(text, 3000)
    assert error in excerpt
    record = json.loads(error)
    assert "the event log write timed out" in record["exception"]
    assert record["code"] == "KERNEL_UNAVAILABLE"
    assert excerpt.endswith(text[-3000:])  # and the tail as before


def test_a_log_without_errors_is_its_tail() -> None:
    text = "\n".join(json.dumps({"event": "still running", "i": i}) for i in range(500))
    assert log_excerpt(text, 3000) == text[-3000:]


def test_an_error_inside_the_tail_is_not_repeated() -> None:
    lines = _service_log().splitlines()
    at = next(i for i, line in enumerate(lines) if '"exception"' in line)
    short = "\n".join(lines[at:at + 5])  # the error and a few lines after it: all inside the tail
    assert len(short) < 3000
    assert log_excerpt(short, 3000) == short
