"""``python -m cluster.bench offline|serve [options]`` (``--help`` for options)."""

from cluster.bench.cli import main

main()
