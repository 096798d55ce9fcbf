"""The ``pgw`` command line: the top of the house.

``pgwcli.main`` builds the parser and runs a subcommand; each subcommand lives in
a module of ``pgwcli.commands``. The command line wires the services together
(``pgw up`` lists them in ``pgwcli.commands.up.UP_SERVICES``); it imports any
layer below it and no service imports it (tests/test_architecture.py).
"""
