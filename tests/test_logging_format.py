"""Every line a service writes to its log has one format (pgwcore/logs.py), the standard library's
loggers included: asyncio's "Exception in callback" (how a raising done callback shows) and nats-py's
warnings were raw text lines in the middle of a JSON log, which a log pipeline cannot parse."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from pgwcore.logs import configure_logging


@pytest.fixture
def root_logging():
    """configure_logging adds a handler to the root logger: the tests after this one get it back as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _lines(err: str) -> list[dict]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_a_callback_that_raises_is_one_json_line_with_its_traceback(capsys, root_logging) -> None:
    configure_logging("json")

    def raises() -> None:
        raise TypeError("MomentDesk._forget() missing 2 required positional arguments")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(None)  # the loop's default handler, as in a service
        after = asyncio.Event()
        loop.call_soon(raises)
        loop.call_soon(after.set)  # callbacks run in order: set once the raising one has run
        await after.wait()

    asyncio.run(main())
    (line,) = _lines(capsys.readouterr().err)
    assert line["logger"] == "asyncio" and line["level"] == "error"
    assert line["event"].startswith("Exception in callback")
    assert "TypeError: MomentDesk._forget() missing" in line["exception"]


def test_library_warnings_are_json_and_debug_stays_out(capsys, root_logging) -> None:
    configure_logging("json")
    configure_logging("json")  # a second configuration (two commands in one process) adds no second line
    logging.getLogger("nats").info("below the threshold")
    logging.getLogger("nats").warning("a library warning")
    (line,) = _lines(capsys.readouterr().err)
    assert line == {"event": "a library warning", "logger": "nats", "level": "warning",
                    "timestamp": line["timestamp"]}
