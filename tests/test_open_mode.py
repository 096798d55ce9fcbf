"""Open mode (no agent-principal bindings, spec 000 §8.4) is refused by `pgw up` unless the config asks for it."""

from __future__ import annotations

import argparse

from pgwcore.config import load_config, open_mode_message


def test_open_mode_is_refused_unless_open_is_set_and_said_loudly_either_way(tmp_path) -> None:
    """No [agents] and no `open = true`: refuse with a message naming OPEN MODE and `open = true`; `open = true`:
    start with a loud banner; any binding configured: nothing to say."""
    refuse, message = open_mode_message(load_config(None, data_dir=str(tmp_path)))  # type: ignore[misc]
    assert refuse and "OPEN MODE" in message and "open = true" in message and "§8.4" in message
    refuse, banner = open_mode_message(load_config(None, data_dir=str(tmp_path), open=True))  # type: ignore[misc]
    assert not refuse and "OPEN MODE" in banner
    assert open_mode_message(load_config(None, data_dir=str(tmp_path), agents={"a": {"principals": ["p"]}})) is None


async def test_pgw_up_handler_refuses_open_mode_before_starting_anything(tmp_path, capsys) -> None:
    """`pgw up`'s handler, in process, returns 2 with the refusal on stderr and creates no server folder."""
    from pgwcli.commands.up import handle

    config = load_config(None, data_dir=str(tmp_path / "data"))
    assert await handle(argparse.Namespace(only=None, open=False), config) == 2
    assert "OPEN MODE" in capsys.readouterr().err
    assert not (tmp_path / "data" / "nats").exists()
