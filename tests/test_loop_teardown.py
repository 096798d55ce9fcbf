"""pgwcore.loop.run's exception handler: a connection reset nobody awaited after a refused login is not
printed after the command's own line (test_cli_creds.py::test_a_refusal_names_the_file_that_would_serve
failed on it once under load); every other unretrieved error still is."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap


def _run(exc: str) -> str:
    """stderr of a process that leaves a future failed with ``exc`` unretrieved inside pgwcore.loop.run."""
    code = textwrap.dedent(f"""
        import asyncio, gc, logging, sys
        logging.basicConfig(stream=sys.stderr)
        from pgwcore import loop

        async def main():
            f = asyncio.get_running_loop().create_future()
            f.set_exception({exc}("from the socket"))
            del f
            gc.collect()  # the future's __del__ calls the loop's exception handler now
            return 0

        sys.exit(loop.run(main()))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_a_connection_reset_nobody_awaited_is_not_printed() -> None:
    for exc in ("ConnectionResetError", "BrokenPipeError", "ConnectionAbortedError"):
        assert _run(exc) == "", exc


def test_any_other_unretrieved_error_still_is() -> None:
    err = _run("ValueError")
    assert "never retrieved" in err and "ValueError" in err


def test_the_handler_passes_other_contexts_to_the_default() -> None:
    from pgwcore.loop import quiet_teardown

    seen: list[dict] = []

    class Loop(asyncio.AbstractEventLoop):
        def default_exception_handler(self, context: dict) -> None:
            seen.append(context)

    quiet_teardown(Loop(), {"message": "Task exception was never retrieved", "exception": KeyError("x")})
    quiet_teardown(Loop(), {"message": "Future exception was never retrieved", "exception": ConnectionResetError()})
    assert [c["exception"].__class__ for c in seen] == [KeyError]
