"""``python -m llmu.bench [NAME...] [--out FILE] [--list] [--sizes cpu|gpu]``."""

from llmu.bench.cli import cli_main

raise SystemExit(cli_main())
