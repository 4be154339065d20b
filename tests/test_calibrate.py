"""`meshlib calibrate`: the measured device profile of this machine's gloo CPU ranks.

Method: one quick calibration on 2 real gloo ranks, through the command line in this process
(`meshlib_torch.cli.main`), writes the profile and its raw measurements to a temporary directory.
The tests check structure and self-consistency, never speed (timings vary with the machine and its
load): the profile round-trips through JSON; every measured collective is reproduced by the planner's
own formula (`meshlib.predict.comm_time` with the alpha and bandwidth measured at that many ranks on the
host, `Link.by_ranks`), the measured points (each the median of its batches) being the independent reference, within the stated
tolerances (`RATIO`, `BANDWIDTH_RATIO`); the fitted alphas and bandwidths are the least-squares
optimum of that formula (moving any of them fits worse); the matrix-product curve reproduces the float32
products; the shared cores' speeds and the model's memory efficiency are the measured ones. `device_profile("cpu")` is checked to read $MESHLIB_PROFILE_DIR first, then the packaged
profile, then to fail naming `meshlib calibrate`; bad `--ranks` values are refused before any rank starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import numpy as np
import pytest

from meshlib import Mesh
from meshlib import devices as devices_module
from meshlib.cli import parser
from meshlib.devices import COLLECTIVE_ALGORITHMS, DeviceProfile, Link, device_profile
from meshlib.predict import collective_terms, comm_time, compute_time
from meshlib.workload import Comm, Compute

# a least-squares fit on relative error: the median point within RATIO of its measured time, and every point
# whose time is mostly bandwidth (LARGE bytes and more) within BANDWIDTH_RATIO. No bound on every point: the
# latency of a small message on a loaded machine is bimodal (~0.1 ms, or ~2 ms when a rank waits for another
# process's time slice), no alpha fits both, and a bound would be a timing threshold; the fit itself is
# checked exactly by `test_alpha_beta_is_the_least_squares_fit`. (Simulated lost time slices on 30% of the
# points of this machine's measurements never broke these two bounds in 2,000 draws.)
RATIO, BANDWIDTH_RATIO, LARGE = 2.0, 2.0, 1 << 20


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """(profile, sidecar data, path) of `meshlib calibrate --quick --ranks 2 --out <tmp>/cpu.json`."""
    pytest.importorskip("torch")
    from meshlib_torch.cli import main

    path = tmp_path_factory.mktemp("profiles") / "cpu.json"
    main(["calibrate", "--quick", "--ranks", "2", "--out", str(path)])
    sidecar = json.loads(path.with_name("cpu.measurements.json").read_text())
    return DeviceProfile.from_json(path.read_text()), sidecar, path


def _log_ratios(pairs) -> list[float]:
    return [abs(math.log(fitted / measured)) for measured, fitted in pairs]


def _within(pairs, what: str, bound: float, *, every: bool = False) -> None:
    """The median (or, `every`, each) of `(measured, fitted)` pairs within `bound` times of each other."""
    errors = _log_ratios(pairs)
    worst = max(range(len(errors)), key=errors.__getitem__)
    if every:
        assert errors[worst] <= math.log(bound), f"{what}: point {worst} of {pairs} off by more than {bound}x"
    else:
        assert statistics.median(errors) <= math.log(bound), f"{what}: median off by more than {bound}x: {pairs}"


def _predicted(points, profile: DeviceProfile) -> list[tuple[float, float]]:
    """(measured, the planner's time) of each `[kind, n, bytes, fastest, median]` point, its median batch (what
    the link is fitted to): `comm_time` on a mesh of its ranks, which reads the link's alpha and bandwidth
    measured with that many ranks on the host (`Link.by_ranks`)."""
    return [(t, comm_time(Comm(kind, ("x",), b), Mesh(x=n), profile)) for kind, n, b, _, t in points]


def _objective(pairs) -> float:
    return sum((fitted / measured - 1) ** 2 for measured, fitted in pairs)


@pytest.mark.ranks
def test_profile_is_valid_and_round_trips(calibrated):
    profile, sidecar, path = calibrated
    assert DeviceProfile.from_json(profile.to_json()) == profile
    assert profile.to_json(indent=1) + "\n" == path.read_text()
    assert profile.name == "cpu" and not profile.host_overlaps and profile.cores >= 1
    assert {d for d, _ in profile.flops} == {"float32", "float64", "bfloat16"}
    assert 0 < profile.matmul_efficiency <= 1 and 0 < profile.memory_efficiency <= 1
    assert profile.host_per_op > 0 and profile.comm_oversubscription >= 0
    runtime = sidecar["measurements"]["runtime"]  # a compiled model's step, per op its dry run counts
    assert (profile.host_per_op, profile.update_host) == (runtime["graph_op"][0], runtime["update_op"][0])
    assert runtime["ops.graph"][0] > 100 and runtime["ops.update"][0] > 100  # 2 layers, 8-wide: a few hundred
    (link,) = profile.links
    kinds = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
    assert link.name == "loopback" and {k for k, _ in link.efficiency} == {k for k, _ in link.alphas} == kinds
    assert kinds <= set(COLLECTIVE_ALGORITHMS) and max(v for _, v in link.efficiency) == 1.0
    assert link.alpha == link.alpha_for("all_reduce") and 0 < profile.fused_efficiency <= 1
    assert "meshlib calibrate --quick --ranks 2" in profile.source
    assert sidecar["measurements"]["ranks"] == [2]


@pytest.mark.ranks
def test_shared_cores_and_model_memory_efficiency_are_read_off_their_measurements(calibrated):
    """Each kind of work's speed with 2 ranks at once is the measured one (alone over the slowest rank's, at
    most 1), and `share` gives it back; so is the drift apart between collectives; memory_efficiency is what the 192-wide Llama's forward and backward
    leave after its products, fused attention and host time, over the bytes of its other ops."""
    profile, sidecar, _ = calibrated
    busy = sidecar["measurements"]["busy"]
    for work in ("matmul", "memory", "host"):
        measured = min(1.0, busy["1"][work][0] / busy["2"][work][0])
        assert (work, 2, pytest.approx(measured)) in profile.sharing
        assert profile.share(2, work) == pytest.approx(measured)
    # products alternating with all-reduces: the wait beyond both apart, w = sqrt(drift * segment), least squares
    lock = sidecar["measurements"]["lockstep"]["2"].values()
    seg = np.array([t["busy"][0] for t in lock])
    wait = np.array([max(0.0, t["both"][0] - t["busy"][0] - t["collective"][0]) for t in lock])
    root = np.linalg.lstsq(np.sqrt(seg)[:, None], wait, rcond=None)[0][0]
    assert len(seg) >= 2 and profile.drift == ((2, pytest.approx(root**2)),)
    model = sidecar["measurements"]["runtime"]["model"]
    before = profile.replace(memory_efficiency=sidecar["fits"]["memory_efficiency"]["fresh ops"])
    peak = before.flops_per_s("float32")
    products = sum(n * max(f / (peak * before.matmul_fraction(f)), b / (before.memory_bandwidth *
                   before.memory_efficiency)) for f, b, n in model["matmuls"])  # fmt: skip
    ops = model["ops"] + sum(n for *_, n in model["matmuls"])
    attention = sum(n * f / (peak * before.attention_fraction(q, d, back)) for f, q, d, back, n in model["attention"])
    rest = model["seconds"][0] - products - attention - model["flops"] / (peak * before.fused_efficiency)
    rest -= ops * before.host_per_op
    if rest > 0:
        assert profile.memory_efficiency == pytest.approx(min(1.0, model["bytes"] / rest / before.memory_bandwidth))
    else:  # the products alone took the time: the fresh ops' figure stays
        assert profile.memory_efficiency == before.memory_efficiency
    assert model["bytes"] > 1e7 and len(model["attention"]) == 2 and len(model["matmuls"]) >= 3


@pytest.mark.ranks
def test_the_cache_is_the_oss_per_core_and_its_rate_the_streaming_ops_on_tensors_that_fit(calibrated):
    """`cache`: the last-level cache the machine reports over the cores sharing it; `cache_bandwidth`: the
    best of copy and add-into-a-kept-tensor on the largest measured tensors of which three fit in it."""
    profile, sidecar, _ = calibrated
    m = sidecar["measurements"]
    cache = m["machine"]["cache"]
    fits = [n for _, n, *_ in m["memory"] if 3 * 4 * n <= cache]
    if not fits:
        assert (profile.cache, profile.cache_bandwidth) == (0, 0.0)
        return
    rates = [b / t for op, n, t, _, b in m["memory"] if n == max(fits) and op in ("copy", "add_out")]
    assert profile.cache == cache and profile.cache_bandwidth == pytest.approx(max(rates))
    assert profile.cache_bandwidth > profile.memory_bandwidth * profile.memory_efficiency


def test_the_cache_per_core_is_read_off_sysfs(tmp_path):
    """The highest data or unified level, over the CPUs its `shared_cpu_list` names; none: 0."""
    from meshlib_torch.calibrate.measure import cache_per_core

    for index, (level, kind, size, cpus) in enumerate([(1, "Data", "48K", "0"), (1, "Instruction", "32K", "0"),
                                                       (2, "Unified", "1024K", "0"), (3, "Unified", "32768K", "0-1,4-5")]):
        d = tmp_path / f"index{index}"
        d.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", cpus)):
            (d / name).write_text(f"{value}\n")
    assert cache_per_core(str(tmp_path)) == (32 << 20) // 4
    assert cache_per_core(str(tmp_path / "missing")) == 0


@pytest.mark.ranks
def test_alpha_beta_reproduces_the_measured_collectives(calibrated):
    """Each measured collective against the planner's formula on a mesh of its ranks."""
    profile, sidecar, _ = calibrated
    points = sidecar["measurements"]["collectives"]
    assert {kind for kind, *_ in points} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
    assert all(median >= fastest for *_, fastest, median in points)  # the reference is the median batch
    pairs = _predicted(points, profile)
    _within(pairs, "collectives", RATIO)
    large = [pair for pair, p in zip(pairs, points) if p[2] >= LARGE]
    _within(large, "large collectives", BANDWIDTH_RATIO, every=True)
    fitted = [p[4] for p in sidecar["fits"]["link"]["points"]]
    assert fitted == pytest.approx([f for _, f in pairs], rel=1e-9)  # the fit's own numbers are the formula's


@pytest.mark.ranks
def test_alpha_beta_is_the_least_squares_fit(calibrated):
    """Moving any kind's alpha or bandwidth at any number of ranks by 10% either way fits the measured points
    no better; every kind has its row at every number of ranks measured."""
    profile, sidecar, _ = calibrated
    points = sidecar["measurements"]["collectives"]
    best = _objective(_predicted(points, profile))
    link, moved = profile.intra, []
    assert {(n, k) for n, k, *_ in link.by_ranks} == {(n, k) for k, n, *_ in points}
    for i in range(len(link.by_ranks)):
        for f in (0.9, 1.1):
            for term in (2, 3):  # alpha, bandwidth
                rows = [list(r) for r in link.by_ranks]
                rows[i][term] *= f
                moved.append(dataclasses.replace(link, by_ranks=tuple(map(tuple, rows))))
    for other in moved:
        assert _objective(_predicted(points, profile.replace(links=(other,)))) >= best * (1 - 1e-9), other


@pytest.mark.ranks
def test_matmul_curve_reproduces_the_measured_products(calibrated):
    """float32 products, the dtype `matmul_efficiency` and `matmul_half` are read off."""
    profile, sidecar, _ = calibrated
    host = sidecar["measurements"]["host"]["matmul"][0]
    rate = profile.flops_per_s("float32")
    pairs = []
    for dtype, _, _, m, k, n, measured, _ in sidecar["measurements"]["matmul"]:
        if dtype == "float32":
            f = 2.0 * m * k * n
            pairs.append((measured, host + f / (rate * profile.matmul_fraction(f))))
    _within(pairs, "float32 matrix products", RATIO)


@pytest.mark.ranks
def test_fused_attention_is_priced_by_its_measured_shape(calibrated):
    """Each measured attention call (forward and backward, by query length and head dim) is a row of the
    profile, FLOPs / fastest over float32's peak, and the time model prices a call of that shape at exactly
    its measured time; `fused_efficiency` is the median forward row."""
    profile, sidecar, _ = calibrated
    rows = sidecar["measurements"]["attention"]
    assert {(p, s, d) for p, s, d, *_ in rows} == {(p, s, d) for p in ("forward", "backward")
                                                   for s in (128, 512) for d in (32, 128)}  # fmt: skip
    peak = profile.flops_per_s("float32")
    for which, seq, dim, _, flops, fastest, _ in rows:
        back = which == "backward"
        assert profile.attention_fraction(seq, dim, back) == pytest.approx(flops / fastest / peak)
        call = Compute(attention=((flops, seq, dim, back, 1),))
        assert compute_time(call, profile.replace(host_per_op=0.0), "float32") == pytest.approx(fastest)
    forward = [f / t / peak for p, _, _, _, f, t, _ in rows if p == "forward"]
    assert profile.fused_efficiency == pytest.approx(statistics.median(forward))


def test_attention_fraction_interpolates_the_grid_in_log_shape_and_holds_its_edges():
    """Between measured query lengths and head dims, linear in log of each (at the log-midpoint of four
    measured shapes, their mean); outside the grid, its edge; a pass without rows, `fused_efficiency`; rows
    that do not fill a grid are refused."""
    rows = (("forward", 128, 16, 0.2), ("forward", 128, 64, 0.4), ("forward", 512, 16, 0.3), ("forward", 512, 64, 0.6))
    profile = device_profile("a100").replace(attention=rows, fused_efficiency=0.5)
    assert profile.attention_fraction(256, 32) == pytest.approx((0.2 + 0.4 + 0.3 + 0.6) / 4)
    assert profile.attention_fraction(128, 32) == pytest.approx(0.3)
    assert profile.attention_fraction(64, 8) == 0.2 and profile.attention_fraction(4096, 256) == 0.6
    assert profile.attention_fraction(4096, 32) == pytest.approx(0.45)
    assert profile.attention_fraction(256, 32, backward=True) == 0.5
    assert DeviceProfile.from_json(profile.to_json()) == profile
    with pytest.raises(ValueError, match="full grid"):
        profile.replace(attention=rows[:3])


def test_a_profile_an_older_calibrate_wrote_is_refused_naming_the_fix():
    """A calibrated profile without the attention rows (or with the `lockstep` factors of before `drift`)
    would price this machine with figures meshlib no longer reads: loading it says so and names the fix. A
    profile written by hand (GPUs', without rows) loads, its attention at `fused_efficiency`."""
    data = json.loads(device_profile("cpu").to_json())
    assert data["source"].startswith("meshlib calibrate") and data["attention"]
    with pytest.raises(ValueError, match=r"did not time fused attention by shape.*run `meshlib calibrate` again"):
        DeviceProfile.from_json(json.dumps({**data, "attention": []}))
    with pytest.raises(ValueError, match=r"`lockstep` factors.*run `meshlib calibrate` again"):
        DeviceProfile.from_json(json.dumps({**data, "lockstep": [[4, 1.1]]}))
    by_hand = DeviceProfile.from_json(json.dumps({**data, "attention": [], "source": "written by hand"}))
    assert by_hand.attention_fraction(128, 16) == by_hand.fused_efficiency


def test_collectives_are_priced_by_the_ranks_sharing_the_host():
    """`Link.by_ranks`: at a measured N its row; between two, alpha linear and bandwidth geometric in log N;
    past the last, the last row slowed by (N / N_last) ** comm_oversubscription; a group of fewer ranks takes
    its own steps and bytes at the row of the ranks on the host; a kind without rows, the link's alpha and
    bandwidth slowed by (N / cores) ** comm_oversubscription."""
    rows = ((2, "all_reduce", 1e-4, 4e9), (8, "all_reduce", 4e-4, 1e9))
    link = Link("loopback", alpha=1e-3, bandwidth=1e9, tree=False, by_ranks=rows)
    profile = device_profile("a100").replace(name="cpu", links=(link,), devices_per_node=64, cores=2,
                                              comm_oversubscription=1.5, host_overlaps=False)  # fmt: skip
    nbytes = 2**20

    def want(kind, n, alpha, bandwidth, slow=1.0):
        steps, bus = collective_terms(kind, n, nbytes, tree=False)
        return (steps * alpha + bus / bandwidth) * slow

    def got(kind, **mesh):
        return comm_time(Comm(kind, ("x",), nbytes), Mesh(**mesh), profile)

    assert got("all_reduce", x=2) == pytest.approx(want("all_reduce", 2, 1e-4, 4e9))
    assert got("all_reduce", x=4) == pytest.approx(want("all_reduce", 4, 2.5e-4, 2e9))
    assert got("all_reduce", x=16) == pytest.approx(want("all_reduce", 16, 4e-4, 1e9, 2**1.5))
    assert got("all_reduce", x=2, y=4) == pytest.approx(want("all_reduce", 2, 4e-4, 1e9))
    assert got("all_gather", x=4) == pytest.approx(want("all_gather", 4, 1e-3, 1e9, 2**1.5))
    assert DeviceProfile.from_json(profile.to_json()) == profile


def test_device_profile_reads_the_calibrated_then_the_packaged_file(tmp_path, monkeypatch):
    mine = device_profile("a100").replace(name="cpu", cores=2, host_overlaps=False, source="test")
    (tmp_path / "cpu.json").write_text(mine.to_json())
    monkeypatch.setenv("MESHLIB_PROFILE_DIR", str(tmp_path))
    found = device_profile("cpu")
    assert found.replace(source="test") == mine
    assert found.source.startswith("test; read from") and "(calibrated" in found.source
    monkeypatch.setenv("MESHLIB_PROFILE_DIR", str(tmp_path / "empty"))
    packaged = device_profile("cpu")
    assert packaged.name == "cpu" and "(packaged" in packaged.source
    assert devices_module.find_profile("cpu") == (devices_module._PACKAGED / "cpu.json", "packaged")


def test_device_profile_without_any_cpu_profile_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLIB_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(devices_module, "_PACKAGED", tmp_path / "none")
    with pytest.raises(ValueError, match=r"no CPU profile.*Fix: run `meshlib calibrate`"):
        device_profile("cpu")


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("1", "'1' is not a world size"),
        ("2,x", "'x' is not a world size"),
        ("", "no world size given"),
        ("0,-2", "'0', '-2' are not world sizes"),
    ],  # fmt: skip
)
def test_bad_ranks_is_a_clear_error(value, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["calibrate", f"--ranks={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "give numbers of ranks of 2 or more" in err


def test_ranks_are_parsed_sorted_and_distinct():
    assert parser().parse_args(["calibrate", "--ranks", "8,2,4,2"]).ranks == (2, 4, 8)
    assert parser().parse_args(["calibrate"]).ranks == (2, 4, 8)


def test_calibrate_refuses_a_world_of_one_before_starting_ranks():
    pytest.importorskip("torch")
    from meshlib_torch.calibrate import calibrate

    with pytest.raises(ValueError, match="world sizes of 2 or more"):
        calibrate((1, 2))
