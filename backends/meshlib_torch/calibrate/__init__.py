"""`meshlib calibrate`: the measured device profile of this machine's gloo CPU ranks.

A time model (`meshlib.predict`) reads a `DeviceProfile`: the GPU ones are cited constants, the CPU one is
measured here, by micro-benchmarks that run inside real gloo rank processes with one torch thread each,
as meshlib's ranks run. One set of constants per kind of device, never fitted to a training configuration.
The order, written once:

1. `measure.measure`: raw measurements, on rank 0 alone and then on each world size asked for
   (`compute`: matrix products, elementwise ops, host time per op, ranks sharing the cores;
   `collectives`: gloo's all-reduce, all-gather, reduce-scatter, all-to-all, send/recv, 1 KiB-64 MiB);
2. `fit.fit_profile`: the profile's figures, each read off its own benchmark (see `fit`'s docstring);
3. `write`: the profile as JSON (`DeviceProfile.to_json`) where `meshlib.device_profile("cpu")` finds it,
   and beside it the raw measurements with each one's fitted value (`*.measurements.json`);
4. `report.tables`: what `meshlib calibrate` prints.

Example (a minute on 2 ranks):

    cal = calibrate((2,), quick=True)
    write(cal, "cpu.json")   # and cpu.measurements.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from meshlib.devices import DeviceProfile, profile_dir

from .fit import fit_profile
from .measure import measure

__all__ = ["Calibration", "calibrate", "calibrate_main", "measurements_path", "write"]

_QUIET = 0.2  # above this share of the busy CPU taken by other processes, the command says the figures suffer


@dataclass(frozen=True)
class Calibration:
    """A calibration's result: the `profile`, the raw `measurements` it was fitted to (`measure.measure`),
    and the `fits` (each fit's constants and, per measured point, its fitted value)."""

    profile: DeviceProfile
    measurements: dict
    fits: dict


def calibrate(ranks: tuple[int, ...] = (2, 4, 8), /, *, quick: bool = False, progress=None) -> Calibration:
    """Measure this machine's gloo ranks on the world sizes `ranks` (each at least 2) and fit the profile.
    `quick`: fewer sizes and repetitions (under a minute on 2 ranks); `progress(text)` hears each phase."""
    ranks = tuple(sorted(set(ranks)))
    if not ranks or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in ranks):
        raise ValueError(f"calibrate ranks={ranks!r}: give world sizes of 2 or more (a collective needs two)")
    m = measure(ranks, quick=quick, progress=progress)
    profile, fits = fit_profile(m)
    return Calibration(profile, m, fits)


def measurements_path(path: str | Path) -> Path:
    """Where the raw measurements of the profile at `path` go: `cpu.json` -> `cpu.measurements.json`."""
    path = Path(path)
    return path.with_name(f"{path.stem}.measurements.json")


def write(cal: Calibration, path: str | Path) -> Path:
    """Write the profile to `path` and the raw measurements with their fitted values beside it."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cal.profile.to_json(indent=1) + "\n")
    measurements_path(path).write_text(json.dumps({"measurements": cal.measurements, "fits": cal.fits}, indent=1))
    return path


def calibrate_main(args) -> Calibration:
    """`meshlib calibrate [--out PATH] [--ranks 2,4,8] [--quick]`: measure, write, print the figures."""
    from meshlib._table import show

    from .report import tables

    path = Path(args.out).expanduser() if args.out else profile_dir() / "cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)  # an unwritable place fails now, not after the measuring
    say = lambda text: print(f"meshlib calibrate: {text}", file=sys.stderr, flush=True)  # noqa: E731
    cal = calibrate(tuple(args.ranks), quick=args.quick, progress=say)
    write(cal, path)
    show(*tables(cal))
    print(f"\nwrote {path} (raw measurements: {measurements_path(path)})")
    others = cal.measurements["machine"].get("other_cpu", -1.0)
    if others > _QUIET:
        say(f"other processes took {others:.0%} of the busy CPU while calibrating, so these figures are slower "
            "than this machine's own; run it again when the machine is quiet")  # fmt: skip
    return cal
