"""The ``pgw`` command line: the top of the house.

``cli.main`` builds the parser and runs a subcommand; each subcommand lives in
a module of ``cli.commands``. The command line wires the services together
(``pgw up`` lists them in ``cli.commands.up.UP_SERVICES``); it imports any
layer below it and no service imports it (tests/test_architecture.py).
"""
