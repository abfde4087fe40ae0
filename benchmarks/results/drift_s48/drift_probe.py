"""steps_probe.py with kaisa.cadence's drift thresholds set from the environment
(KAISA_DRIFT_FACTOR, KAISA_DRIFT_SHARE): an experiment, not a library option."""

import os
import sys

import kaisa.cadence as cadence

cadence.DRIFT_FACTOR = float(os.environ.get("KAISA_DRIFT_FACTOR", cadence.DRIFT_FACTOR))
cadence.DRIFT_SHARE = float(os.environ.get("KAISA_DRIFT_SHARE", cadence.DRIFT_SHARE))
sys.path.insert(0, "benchmarks")
import steps_probe  # noqa: E402

variant = f"drift factor {cadence.DRIFT_FACTOR:g}, share {cadence.DRIFT_SHARE:g}"
print(variant, file=sys.stderr)
sys.exit(steps_probe.main(sys.argv[1:], variant=variant))
