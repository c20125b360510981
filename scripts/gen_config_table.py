#!/usr/bin/env python3
"""Print the README table of fault tolerance settings, generated from nvrx.monitors.ft_config.SCHEMA.

Usage: python scripts/gen_config_table.py > /tmp/table.md   (paste into README.md)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvrx.monitors.ft_config import config_table_markdown  # noqa: E402


def main() -> int:
    sys.stdout.write(config_table_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
