"""``python -m cluster.bench offline [options]`` (``--help`` for options)."""

from cluster.bench.cli import main

main()
