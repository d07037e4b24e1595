"""Benchmark helpers: each case records the bytes it must move; the session ends with a table of
effective bandwidth next to the machine's streaming bandwidth measured in the same run."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

_ROWS = []
_NOT_RUN = []
_RATIOS = []


@pytest.fixture
def record():
    """record(benchmark, group, name, bytes_moved): remember a finished case for the summary."""

    def _record(benchmark, group, name, bytes_moved=None):
        _ROWS.append((group, name, benchmark, bytes_moved))

    return _record


@pytest.fixture
def record_not_run():
    """record_not_run(group, name, reason): a case that could not run here, printed with its reason
    under its group's table."""

    def _record(group, name, reason):
        _NOT_RUN.append((group, name, reason))

    return _record


@pytest.fixture
def record_ratios():
    """record_ratios(title, lines): a table a case formats itself (times measured inside one case,
    such as interleaved rounds), printed under its title."""

    def _record(title, lines):
        _RATIOS.append((title, lines))

    return _record


def pytest_terminal_summary(terminalreporter):
    if not _ROWS and not _NOT_RUN and not _RATIOS:
        return
    tr = terminalreporter
    for title, lines in _RATIOS:
        tr.write_sep("=", f"zerofast summary: {title}")
        for line in lines:
            tr.write_line(line)
    for group, name, reason in _NOT_RUN:
        tr.write_line(f"not run ({group}): {name}: {reason}")
    groups = {}
    for group, name, bench, nbytes in _ROWS:
        if bench.stats is None:
            continue
        groups.setdefault(group, []).append((name, bench.stats.stats.median, nbytes, bench.extra_info))
    for group, rows in groups.items():
        tr.write_sep("=", f"zerofast summary: {group}")
        stream = next((b / t for n, t, b, _ in rows if n == "stream a.add_(b)" and b), None)
        base = rows[0][1]
        tr.write_line(f"{'case':44s} {'median ms':>10s} {'GB/s':>8s} {'% stream':>9s} {'vs ' + rows[0][0][:12]:>9s}")
        for name, t, nbytes, extra in rows:
            gbs = f"{nbytes / t / 1e9:8.1f}" if nbytes else f"{'':8s}"
            pct = f"{100 * nbytes / t / stream:8.0f}%" if (nbytes and stream) else f"{'':9s}"
            mem = f"  {extra['rank_mib']:8.1f} MiB/rank" if "rank_mib" in extra else ""
            if "backward_ms" in extra:
                mem += f"  backward {extra['backward_ms']:7.2f} ms"
            if "stall_ms" in extra:
                mem += (
                    f"  stall {extra['stall_ms']:7.1f} ms  in save() {extra['call_ms']:7.1f} ms  "
                    f"written after {extra['written_ms']:7.1f} ms"
                )
            if "cross_mib" in extra:
                mem += (
                    f"  across machines {extra['cross_mib']:7.2f} MiB/step  within {extra['within_mib']:7.2f} MiB/step"
                )
            if "param_peak_mib" in extra:
                mem += f"  parameters at peak {extra['param_peak_mib']:6.2f} MiB (rank 0, inside blocks)"
            tr.write_line(f"{name:44s} {t * 1e3:10.2f} {gbs} {pct} {t / base:8.2f}x{mem}")
