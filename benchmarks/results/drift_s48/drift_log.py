"""steps_probe.py with StaleRefresh.stale logging each layer's ratio over its reference
(to KAISA_DRIFT_LOG, one JSON line per measured step); thresholds from the environment.

An experiment of session 48, run from the repository root:
``KAISA_DRIFT_LOG=F PYTHONPATH=. python benchmarks/results/drift_s48/drift_log.py
--workload small_cnn --arm kaisa-adamw --seeds 1 --threads 1``."""

import json
import math
import os
import sys

import kaisa.cadence as cadence

cadence.DRIFT_FACTOR = float(os.environ.get("KAISA_DRIFT_FACTOR", cadence.DRIFT_FACTOR))
cadence.DRIFT_SHARE = float(os.environ.get("KAISA_DRIFT_SHARE", cadence.DRIFT_SHARE))
log = open(os.environ["KAISA_DRIFT_LOG"], "a")  # noqa: SIM115 (open for the whole run)
original = cadence.StaleRefresh.stale
count = [0]


def stale(self, ratios):
    result = original(self, ratios)
    count[0] += 1
    moves = {
        name: round(math.log(r / self.reference[name]) / math.log(2), 2)
        for name, r in ratios.items()
        if name in self.reference and r > 0 and self.reference[name] > 0
    }
    log.write(
        json.dumps({"call": count[0], "stale": result, "cap": self.cap, "log2": moves}) + "\n"
    )
    log.flush()
    return result


cadence.StaleRefresh.stale = stale
sys.path.insert(0, "benchmarks")
import steps_probe  # noqa: E402

variant = f"drift factor {cadence.DRIFT_FACTOR:g}, share {cadence.DRIFT_SHARE:g}"
sys.exit(steps_probe.main(sys.argv[1:], variant=variant))
