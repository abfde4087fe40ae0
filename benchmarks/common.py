"""Helpers shared by the benchmark scripts.

Everything here is independent of kaisa: machine and load recording, thread
pinning, timing statistics, peak memory, ``key=value`` option parsing, running
one measurement in a fresh child process, plain-text tables and JSON output,
and the per-arm summary of lockstep runs at several learning rates.

Benchmarks print a table, can write JSON, and never decide pass/fail on wall
clock time (shared machines are noisy); they record the load average next to
every number instead.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "LoadRecord",
    "environment_for_threads",
    "format_bytes",
    "format_table",
    "library_commit",
    "load_average",
    "machine_info",
    "parse_key_values",
    "peak_rss_bytes",
    "run_child",
    "set_threads",
    "summarize",
    "time_repeated",
    "write_json",
]

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


# --------------------------------------------------------------------------- machine


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (NaN where the OS has none)."""
    try:
        return os.getloadavg()
    except (OSError, AttributeError):
        return (math.nan, math.nan, math.nan)


@dataclasses.dataclass
class LoadRecord:
    """Load averages before and after a measurement.

    Use as a context manager::

        with LoadRecord() as load:
            ...
        load.as_dict()  # {"before": [1m, 5m, 15m], "after": [...], "cpus": n}
    """

    before: tuple[float, float, float] = (math.nan, math.nan, math.nan)
    after: tuple[float, float, float] = (math.nan, math.nan, math.nan)

    def __enter__(self) -> LoadRecord:
        self.before = load_average()
        return self

    def __exit__(self, *exc: object) -> None:
        self.after = load_average()

    def as_dict(self) -> dict[str, Any]:
        return {"before": list(self.before), "after": list(self.after), "cpus": usable_cpus()}

    def describe(self) -> str:
        """One line such as ``load 1m 0.41 -> 2.03 (5m 0.30 -> 0.85) on 2 CPUs``."""
        return (
            f"load 1m {self.before[0]:.2f} -> {self.after[0]:.2f} "
            f"(5m {self.before[1]:.2f} -> {self.after[1]:.2f}) on {usable_cpus()} CPUs"
        )


def usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask where available)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    """Facts that make a timing interpretable: platform, CPU, library versions."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": usable_cpus(),
        "cpu_model": _cpu_model(),
        "thread_env": {k: os.environ[k] for k in _THREAD_VARIABLES if k in os.environ},
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        from kaisa.demo.compare import cpu_features

        info.update(cpu_features())
    return info


def library_commit(package: str | os.PathLike[str] | None = None) -> str | None:
    """The commit of the repository holding ``package`` (default: the imported ``kaisa``).

    Short hash, with ``-dirty`` when the package's files differ from it (a
    probe of an uncommitted change); ``None`` outside a git checkout or
    without git. Benchmark rows record it, so that a result names the code
    it measured.
    """
    if package is None:
        import kaisa

        package = Path(kaisa.__file__).parent
    where = Path(package)
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
        changed = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--", "."],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if changed else head


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment_for_threads(threads: int) -> dict[str, str]:
    """A copy of ``os.environ`` that limits OpenMP/BLAS pools to ``threads``."""
    env = dict(os.environ)
    for key in _THREAD_VARIABLES:
        env[key] = str(threads)
    return env


def set_threads(threads: int) -> None:
    """Fix torch's intra-op pool to ``threads`` and its inter-op pool to 1.

    Call it before any parallel torch work (the inter-op size can only be set
    once, early); later calls still set the intra-op size.
    """
    import torch

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    # Fails when already set or parallel work has started; the intra-op size is what counts.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak if sys.platform == "darwin" else peak * 1024)


# --------------------------------------------------------------------------- timing


def time_repeated(
    fn: Callable[[], object],
    repeat: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeat`` times; seconds per call."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def summarize(times: Sequence[float]) -> dict[str, float]:
    """Median, mean, min, max, 10th/90th percentile and count of ``times``.

    Empty input gives NaN statistics and ``n = 0``.
    """
    if not times:
        nan = math.nan
        return {"n": 0, "median": nan, "mean": nan, "min": nan, "max": nan, "p10": nan, "p90": nan}
    ordered = sorted(times)
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "mean": statistics.fmean(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "p10": _percentile(ordered, 0.10),
        "p90": _percentile(ordered, 0.90),
    }


def best_rate(rows: Sequence[Mapping[str, Any]], by: str = "steps") -> Mapping[str, Any] | None:
    """Of one arm's runs of one seed (one per learning rate), the best that reached the target.

    Each row has ``steps`` and ``time`` to target (``None``: not reached). ``by``
    ``'steps'``: the fewest steps, ties to less time; ``'time'``: the least
    time, ties to fewer steps. ``None`` when no row reached the target.
    """
    if by not in ("steps", "time"):
        raise ValueError(f"by must be 'steps' or 'time', got {by!r}")
    other = "time" if by == "steps" else "steps"
    reached = [r for r in rows if r[by] is not None]
    return min(reached, key=lambda r: (r[by], r[other])) if reached else None


def arm_summaries(
    names: Sequence[str], rows: Sequence[Mapping[str, Any]], seeds: Sequence[int], by: str = "steps"
) -> dict[str, dict[str, Any]]:
    """Per arm: its best rate per seed (:func:`best_rate`), and the medians over the seeds that
    reached the target of that rate's steps, ms per step and time (rows carry ``arm``, ``seed``,
    ``lr``, ``steps``, ``ms_per_step`` and ``time``)."""
    summary = {}
    for name in names:
        bests = [
            best_rate([r for r in rows if r["arm"] == name and r["seed"] == s], by) for s in seeds
        ]
        got = [b for b in bests if b is not None]
        summary[name] = {
            "reached": f"{len(got)}/{len(seeds)}",
            "best_lrs": [None if b is None else b["lr"] for b in bests],
            "steps": [None if b is None else b["steps"] for b in bests],
            "median_steps": statistics.median(b["steps"] for b in got) if got else None,
            "median_ms_per_step": statistics.median(b["ms_per_step"] for b in got) if got else None,
            "median_time": statistics.median(b["time"] for b in got) if got else None,
        }
    return summary


#: The columns of :func:`arm_summary_table`.
ARM_SUMMARY_HEADERS = [
    "arm", "reached", "best lr per seed", "steps per seed", "median steps", "ms/step",
    "median time",
]  # fmt: skip


def arm_summary_table(summary: Mapping[str, Mapping[str, Any]], decimals: int) -> list[list[str]]:
    """The rows of :data:`ARM_SUMMARY_HEADERS` for :func:`arm_summaries`' result."""
    table = []
    for name, s in summary.items():
        ms, time_ = s["median_ms_per_step"], s["median_time"]
        table.append(
            [
                name,
                s["reached"],
                "/".join("-" if v is None else f"{v:g}" for v in s["best_lrs"]),
                "/".join("-" if v is None else str(v) for v in s["steps"]),
                "-" if s["median_steps"] is None else f"{s['median_steps']:g}",
                "-" if ms is None else f"{ms:.{decimals}f}",
                "-" if time_ is None else f"{time_:.{decimals}f} s",
            ]
        )
    return table


def floats(text: str) -> list[float]:
    """``'0.1,3'`` as ``[0.1, 3.0]`` (empty items skipped)."""
    return [float(v) for v in text.split(",") if v]


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile of already sorted values."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# --------------------------------------------------------------------------- options


def parse_key_values(items: Iterable[str], option: str = "--extra") -> dict[str, Any]:
    """Parse ``key=value`` strings; values are Python literals, else plain strings.

    ``["damping=1e-3", "compute_method=eigen", "skip_layers=['fc']"]`` gives
    ``{"damping": 0.001, "compute_method": "eigen", "skip_layers": ["fc"]}``;
    ``torch.NAME`` values become that torch attribute (``torch.bfloat16``).
    Raises ``ValueError`` naming ``option`` for an item without ``=`` or key.
    """
    result: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(
                f"{option} expects key=value with a Python identifier key, got {item!r}"
            )
        raw = raw.strip()
        if raw.startswith("torch.") and raw[6:].isidentifier():
            import torch

            result[key] = getattr(torch, raw[6:])
            continue
        try:
            result[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            result[key] = raw
    return result


def kfac_json(text: str) -> Any:
    """``KFACPreconditioner`` keyword arguments from JSON; a ``"torch.NAME"`` string
    value becomes that torch attribute (``{"factor_product_dtype": "torch.bfloat16"}``)."""
    value = json.loads(text)
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, str) and item.startswith("torch.") and item[6:].isidentifier():
                import torch

                value[key] = getattr(torch, item[6:])
    return value


# --------------------------------------------------------------------------- children


def run_child(
    argv: Sequence[str], threads: int, timeout: float | None = None
) -> tuple[dict[str, Any] | None, str]:
    """Run ``python argv... --result-file FILE`` in a fresh process.

    The child must write its JSON result to ``FILE``. Its stdout and stderr go
    to this process's stderr (progress stays visible). The thread variables
    are set to ``threads``. Returns ``(result, error)``: the parsed result and
    an empty string, or ``None`` and a description of the failure.
    """
    fd, path = tempfile.mkstemp(prefix="kaisa-bench-", suffix=".json")
    os.close(fd)
    try:
        try:
            proc = subprocess.run(
                [sys.executable, *argv, "--result-file", path],
                env=environment_for_threads(threads),
                stdout=sys.stderr,
                stderr=sys.stderr,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout} s"
        if proc.returncode != 0:
            return None, f"exited with status {proc.returncode}"
        try:
            with open(path) as f:
                return json.load(f), ""
        except (OSError, json.JSONDecodeError) as exc:
            return None, f"wrote no readable result ({exc})"
    finally:
        Path(path).unlink(missing_ok=True)


# --------------------------------------------------------------------------- output


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; signed; NaN -> ``'n/a'``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    sign = "-" if n < 0 else ""
    value = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [
            row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]) for i in range(len(row))
        ]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out.append(line(cells[0]))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(r) for r in cells[1:])
    return "\n".join(out)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.3g}"
    return str(value)


def write_json(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented JSON, atomically (temporary file then rename).

    NaN and infinities become ``null``; unknown objects their ``str``.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_jsonable(data), indent=2, sort_keys=False, default=str)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(target)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    return value


def add_json_option(parser: argparse.ArgumentParser, default_path: Path | str) -> None:
    """``--json [PATH]``: also write the results as JSON (to ``default_path`` without PATH)."""
    parser.add_argument(
        "--json",
        nargs="?",
        const=str(default_path),
        default=None,
        metavar="PATH",
        help=f"also write JSON (default path: {default_path})",
    )
