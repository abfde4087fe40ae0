"""``python -m kaisa.cli``: the ``kaisa`` command."""

from __future__ import annotations

import sys

from kaisa.cli import main

sys.exit(main())
