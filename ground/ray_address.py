"""The ``--address`` option of every CLI that starts or joins Ray (pipeline, train, serve, cluster.run), declared
once so that each reads ``RAY_ADDRESS`` the same way and says so in its ``--help``."""

from __future__ import annotations

import argparse
import os


def add_address_option(parser: argparse.ArgumentParser) -> None:
    """``--address``: the Ray cluster to join (``auto``: the one this node belongs to, as inside a ``ray job``);
    default ``$RAY_ADDRESS``, and without it a local Ray started for the command."""
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="Ray cluster address ('auto': the cluster this node belongs to, as in a ray job; default: "
        "$RAY_ADDRESS, else a local Ray)",
    )
