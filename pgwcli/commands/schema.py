"""``pgw schema [NAME]``: the JSON Schema of any wire type."""

from __future__ import annotations

import argparse
import json
import sys

from pgwcore.config import Config
from subjects.schemas import all_types, json_schema


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("schema", help="print the JSON Schema of a wire type (no NAME: list them)")
    p.add_argument("name", nargs="?", help="wire type, e.g. BindingMomentItem")
    p.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, config: Config) -> int:
    if not args.name:
        for name in sorted(all_types()):
            print(name)
        return 0
    try:
        schema = json_schema(args.name)
    except KeyError:
        print(f"pgw: unknown wire type {args.name!r}; `pgw schema` lists them", file=sys.stderr)
        return 2
    print(json.dumps(schema, indent=2, sort_keys=True))
    return 0
