"""algorithm.reward_aggregation: weighted_sum (the total's group-relative advantage) against
normalize_each (GDPO: each reward's own, weighted, summed, divided by the sum's iteration std),
by hand, through the update of every algorithm, and over a two-iteration loop."""

import json
import math
import textwrap

import pyarrow as pa
import pytest
import torch
from helpers import do_iteration

from flowgrpo_cli.algorithm.advantages import compute_advantages, data_metrics, normalize_each
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.config import load_config
from flowgrpo_cli.store.rundir import UPDATE
from flowgrpo_cli.store.trajectory import read_table
from flowgrpo_cli.training.algorithms import ALGORITHMS, algorithm_for

EPS = 1e-4
# Two rewards a hundred times apart in scale, two groups of four images.
OCR = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # group 1 is constant in it
SIZE = [100.0, 300.0, 100.0, 300.0, 0.0, 0.0, 200.0, 200.0]
GROUPS = [3, 3, 3, 3, 8, 8, 8, 8]
WEIGHTS = {"ocr": 1.0, "size": 0.5}


def _columns() -> dict[str, torch.Tensor]:
    return {"ocr": torch.tensor(OCR, dtype=torch.float64),
            "size": torch.tensor(SIZE, dtype=torch.float64)}  # fmt: skip


def _group_std_by_hand() -> list[float]:
    """normalize_each with per-group population stds, worked out by hand.

    ocr, group 0: [0, 0, 1, 1], mean 0.5, deviations +-0.5, std 0.5 -> A = -+u,
    u = 0.5 / (0.5 + 1e-4); group 1: [1, 1, 1, 1], constant -> A = 0 (0 / (0 + 1e-4)).
    size, group 0: [100, 300, 100, 300], mean 200, std 100; group 1: [0, 0, 200, 200], mean 100,
    std 100 -> A = -+v, v = 100 / (100 + 1e-4).
    S = 1.0 A_ocr + 0.5 A_size = [-u - v/2, -u + v/2, u - v/2, u + v/2, -v/2, -v/2, v/2, v/2]:
    its mean is 0 and its squares sum to 4 u^2 + v^2 (group 0, cross terms cancel) + v^2
    (group 1), so its population std over the 8 images is sqrt((4 u^2 + 2 v^2) / 8), about
    sqrt(6 / 8) = 0.866; A = S / (that + 1e-4).
    """
    u, v = 0.5 / (0.5 + EPS), 100 / (100 + EPS)
    s = [-u - v / 2, -u + v / 2, u - v / 2, u + v / 2, -v / 2, -v / 2, v / 2, v / 2]
    std = math.sqrt((4 * u**2 + 2 * v**2) / 8)
    return [x / (std + EPS) for x in s]


def test_weighted_sum_normalises_the_total_whose_large_reward_drowns_the_small_one():
    # total = ocr + 0.5 size = [50, 150, 51, 151, 1, 1, 101, 101]
    # group 0: mean 100.5, deviations [-50.5, 49.5, -49.5, 50.5],
    #   variance (2 * 50.5^2 + 2 * 49.5^2) / 4 = (5100.5 + 4900.5) / 4 = 2500.25
    # group 1: mean 51, deviations +-50, std 50
    total = torch.tensor(OCR) + 0.5 * torch.tensor(SIZE)
    a = compute_advantages(total, torch.tensor(GROUPS), std_mode="group")
    d0 = math.sqrt(2500.25) + EPS
    expected = (
        [-50.5 / d0, 49.5 / d0, -49.5 / d0, 50.5 / d0] + [-50 / 50.0001] * 2 + [50 / 50.0001] * 2
    )
    assert a.tolist() == pytest.approx(expected, rel=1e-6)
    # the image that reads its text (2) beats the one that does not (0) by 1 / 50.0025 only
    assert a[2] - a[0] == pytest.approx(1 / d0, rel=1e-5)


def test_normalize_each_group_std_by_hand():
    out = normalize_each(_columns(), WEIGHTS, torch.tensor(GROUPS), std_mode="group")
    assert out.advantages.dtype == torch.float32
    assert out.advantages.tolist() == pytest.approx(_group_std_by_hand(), rel=1e-6)
    u, v = 0.5 / (0.5 + EPS), 100 / (100 + EPS)
    assert out.per_reward["ocr"].tolist() == pytest.approx([-u, -u, u, u, 0, 0, 0, 0], rel=1e-6)
    assert out.per_reward["size"].tolist() == pytest.approx([-v, v, -v, v, -v, -v, v, v], rel=1e-6)
    # reading the text (image 2 against 0) is now worth 2u / 0.866, about 2.3
    assert out.advantages[2] - out.advantages[0] == pytest.approx(2.3092, abs=1e-3)


def test_normalize_each_global_std_with_bessel_by_hand():
    # ocr over all 8: mean 0.75, squared deviations 2 * 0.5625 + 6 * 0.0625 = 1.5, / 7
    # size over all 8: mean 150, deviations [-50, 150, -50, 150, -150, -150, 50, 50],
    #   squares 4 * 2500 + 4 * 22500 = 100000, / 7
    # A_ocr: group 0's deviations from its own mean (+-0.5) / (sqrt(1.5 / 7) + 1e-4); group 1: 0
    # A_size: +-100 / (sqrt(100000 / 7) + 1e-4)
    a = 0.5 / (math.sqrt(1.5 / 7) + EPS)
    b = 100 / (math.sqrt(100000 / 7) + EPS)
    s = [-a - b / 2, -a + b / 2, a - b / 2, a + b / 2, -b / 2, -b / 2, b / 2, b / 2]
    std = math.sqrt((4 * a**2 + 2 * b**2) / 7)  # mean 0; ddof 1 divides by 8 - 1
    expected = [x / (std + EPS) for x in s]
    out = normalize_each(
        _columns(), WEIGHTS, torch.tensor(GROUPS), std_mode="global", ddof=1, clip=None
    )
    assert out.advantages.tolist() == pytest.approx(expected, rel=1e-6)


def test_a_group_flat_in_every_reward_gets_exactly_zero():
    # group 0 varies in ocr; group 1 is flat in both rewards; group 2's total is flat
    # (0 + 0.5 * 2 = 1 + 0.5 * 0) though each reward varies.
    ocr = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    size = torch.tensor([0.0, 0.0, 2.0, 2.0, 2.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    total = ocr + 0.5 * size
    summed = compute_advantages(total, groups, std_mode="group")
    assert summed[2:].tolist() == [0.0] * 4  # groups 1 and 2 flat in the total
    out = normalize_each({"ocr": ocr, "size": size}, WEIGHTS, groups, std_mode="group")
    assert out.advantages[2:4].tolist() == [0.0, 0.0]  # exactly, not a rounding residue
    # group 0: A_ocr = -+u, A_size = 0 -> S = -+u; group 2: A_ocr = -+u, A_size = +-v ->
    # S = -+(u - v/2); u = 0.5 / 0.5001, v = 1 / 1.0001.
    u, v = 0.5 / (0.5 + EPS), 1 / (1 + EPS)
    std = math.sqrt((2 * u**2 + 2 * (u - v / 2) ** 2) / 6)
    expected = [-u, u, 0, 0, -(u - v / 2), u - v / 2]
    assert out.advantages.tolist() == pytest.approx([x / (std + EPS) for x in expected], rel=1e-6)

    m = data_metrics({"ocr": ocr, "size": size}, total, groups, summed, clip=5.0)
    assert m["reward/zero_std_group_ratio"] == pytest.approx(2 / 3)
    assert m["advantage/zero_frac"] == pytest.approx(4 / 6)
    m = data_metrics(
        {"ocr": ocr, "size": size}, total, groups, out.advantages, clip=5.0,
        per_reward_advantages=out.per_reward,
    )  # fmt: skip
    assert m["reward/zero_std_group_ratio"] == pytest.approx(1 / 3)  # group 1 alone
    assert m["advantage/zero_frac"] == pytest.approx(2 / 6)


def test_per_reward_advantage_metrics():
    out = normalize_each(_columns(), WEIGHTS, torch.tensor(GROUPS), std_mode="group")
    total = torch.tensor(OCR) + 0.5 * torch.tensor(SIZE)
    m = data_metrics(
        _columns(), total, torch.tensor(GROUPS), out.advantages, clip=5.0,
        per_reward_advantages=out.per_reward,
    )  # fmt: skip
    u = 0.5 / (0.5 + EPS)
    # A_ocr = [-u, -u, u, u, 0, 0, 0, 0]: mean 0, population std sqrt(4 u^2 / 8) = u / sqrt(2)
    assert m["advantage/ocr_mean"] == pytest.approx(0.0, abs=1e-7)
    assert m["advantage/ocr_std"] == pytest.approx(u / math.sqrt(2), rel=1e-6)
    assert (m["advantage/ocr_min"], m["advantage/ocr_max"]) == pytest.approx((-u, u), rel=1e-6)
    # size: 300 - 150 = 150 is the largest deviation of [100, 300, 100, 300, 0, 0, 200, 200]
    assert m["reward/size_mean"] == 150.0 and m["reward/size_std"] == pytest.approx(
        math.sqrt(100000 / 8)
    )
    assert m["reward/zero_std_group_ratio"] == 0.0  # group 1 is flat in ocr only


def test_normalize_each_refuses_what_it_cannot_do():
    columns, groups = _columns(), torch.tensor(GROUPS)
    with pytest.raises(FlowGrpoError, match="std_mode='none'"):
        normalize_each(columns, WEIGHTS, groups, std_mode="none")
    with pytest.raises(FlowGrpoError, match=r"\['size'\] have scores but no weight"):
        normalize_each(columns, {"ocr": 1.0}, groups)
    with pytest.raises(FlowGrpoError, match="overflows"):  # 1e308 (+-1.0) + 1e308 (+-1.0)
        normalize_each(columns, {"ocr": 1e308, "size": 1e308}, groups, std_mode="group")
    with pytest.raises(FlowGrpoError, match="at least one reward"):
        normalize_each({}, WEIGHTS, groups)
    columns["size"][0] = float("nan")  # a failed image left in
    with pytest.raises(FlowGrpoError, match="not finite"):
        normalize_each(columns, WEIGHTS, groups)


def test_config_names_the_key_and_its_choices():
    with pytest.raises(FlowGrpoError) as error:
        load_config(None, ["algorithm.reward_aggregation=gdpo"])
    message = str(error.value)
    assert "algorithm.reward_aggregation" in message
    assert "'weighted_sum'" in message and "'normalize_each'" in message
    config = load_config(
        None, ["algorithm.reward_aggregation=normalize_each", "algorithm.advantage_std=none"]
    )
    with pytest.raises(FlowGrpoError, match='advantage_std = "none" turns off'):
        algorithm_for(config).check()


# -- through the stages ------------------------------------------------------------------------


@pytest.fixture
def two_rewards(tmp_path, monkeypatch) -> None:
    """A plugin module `two_rewards` on sys.path whose `ocr` and `size` give image k of group g
    of iteration 0 the values of OCR and SIZE above; `size_fails` fails on g0's image 3."""
    (tmp_path / "two_rewards.py").write_text(
        textwrap.dedent(f"""
        OCR, SIZE = {OCR!r}, {SIZE!r}

        def _index(meta):
            _, group, k = meta["sample_id"].split("-")  # i000000-g0001-k002
            return 4 * int(group[1:]) + int(k[1:])

        def ocr(images, prompts, metadata):
            return [OCR[_index(m)] for m in metadata]

        def size(images, prompts, metadata):
            return [SIZE[_index(m)] for m in metadata]

        def size_fails(images, prompts, metadata):
            return [float("nan") if _index(m) == 3 else SIZE[_index(m)] for m in metadata]
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def _two_reward_run(make_run, *overrides, size="two_rewards:size", name="run"):
    return make_run(
        f'reward.weights={{"two_rewards:ocr" = 1.0, "{size}" = 0.5}}',
        "algorithm.group_size=4", "algorithm.prompts_per_iteration=2",
        "algorithm.advantage_std=group", "sampler.window_size=1", *overrides, name=name,
    )  # fmt: skip


def _advantages_file(run) -> dict[str, float]:
    table = read_table([run.stage_dir(0, UPDATE) / "advantages.arrow"])
    return dict(zip(table.column("sample_id").to_pylist(), table.column("advantage").to_pylist(),
                    strict=True))  # fmt: skip


SAMPLE_IDS = [f"i000000-g{g:04d}-k{k:03d}" for g in range(2) for k in range(4)]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_trains_on_the_normalize_each_advantages(
    make_run, two_rewards, monkeypatch, name
):
    """The advantages each algorithm's backward receives are the hand values (nft and awm then
    map them their own way, as any advantage: docs/algorithms.md)."""
    seen: dict[str, float] = {}
    algorithm = ALGORITHMS[name]
    backward = algorithm.backward

    def recording(self, context, batch, losses):
        if batch.real:
            seen.update(zip(batch.rows.sample_ids, batch.advantages.tolist(), strict=True))
        return backward(self, context, batch, losses)

    monkeypatch.setattr(algorithm, "backward", recording)
    config, run = _two_reward_run(
        make_run, f"algorithm.name={name}", "algorithm.reward_aggregation=normalize_each"
    )
    metrics = do_iteration(config, run)[0].metrics
    expected = dict(zip(SAMPLE_IDS, _group_std_by_hand(), strict=True))
    assert _advantages_file(run) == pytest.approx(expected, rel=1e-6)
    assert seen == pytest.approx(expected, rel=1e-6)
    assert metrics["update/optimizer_steps"] >= 1.0
    assert metrics["advantage/two_rewards:ocr_std"] > 0.0
    assert all(math.isfinite(v) for v in metrics.values())


def test_a_failed_reward_drops_the_image_under_both_aggregations(make_run, two_rewards):
    """on_error = drop_sample: the image size failed on (group 0, image 3) leaves both paths,
    and group 0's statistics come from its other three."""
    results = {}
    for aggregation in ("weighted_sum", "normalize_each"):
        config, run = _two_reward_run(
            make_run, f"algorithm.reward_aggregation={aggregation}",
            size="two_rewards:size_fails", name=aggregation,
        )  # fmt: skip
        metrics = do_iteration(config, run)[0].metrics
        assert metrics["reward/dropped_samples"] == 1.0
        results[aggregation] = _advantages_file(run)
    kept = SAMPLE_IDS[:3] + SAMPLE_IDS[4:]
    assert list(results["weighted_sum"]) == list(results["normalize_each"]) == kept
    # weighted_sum, group 0: totals [50, 150, 51], mean 251/3, deviations
    # [-101/3, 199/3, -98/3], variance (101^2 + 199^2 + 98^2) / 27 = 59406 / 27
    d0 = math.sqrt(59406 / 27) + EPS
    assert [results["weighted_sum"][s] for s in kept[:3]] == pytest.approx(
        [-101 / 3 / d0, 199 / 3 / d0, -98 / 3 / d0], rel=1e-6
    )
    # normalize_each, group 0: ocr [0, 0, 1], mean 1/3, deviations [-1/3, -1/3, 2/3],
    # variance (1 + 1 + 4) / 27 = 2/9; size [100, 300, 100], mean 500/3, deviations
    # [-200/3, 400/3, -200/3], variance (4 + 16 + 4) * 10^4 / 27 = 80000/9.
    # Group 1 as before: A_ocr = 0, A_size = -+v.
    a_ocr = [x / (math.sqrt(2 / 9) + EPS) for x in (-1 / 3, -1 / 3, 2 / 3)]
    a_size = [x / (math.sqrt(80000 / 9) + EPS) for x in (-200 / 3, 400 / 3, -200 / 3)]
    v = 100 / (100 + EPS)
    s = [o + 0.5 * z for o, z in zip(a_ocr, a_size, strict=True)] + [-v / 2, -v / 2, v / 2, v / 2]
    std = math.sqrt(sum(x * x for x in s) / 7)  # S sums to 0 in each group
    assert [results["normalize_each"][k] for k in kept] == pytest.approx(
        [x / (std + EPS) for x in s], rel=1e-6
    )


def test_two_iterations_of_two_rewards_under_normalize_each(make_run, tmp_path, monkeypatch):
    """jpeg_compressibility beside a brightness plugin, a scale apart, for two iterations of
    the loop: per-reward reward and advantage stats reach metrics.jsonl and the report."""
    from flowgrpo_cli.loop import run_loop
    from flowgrpo_cli.reporting.report import write_report
    from flowgrpo_cli.store.metrics_log import read_log

    (tmp_path / "bright.py").write_text(
        textwrap.dedent("""
        from PIL import ImageStat

        def brightness(images, prompts, metadata):
            return [ImageStat.Stat(image.convert("L")).mean[0] for image in images]
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config, run = make_run(
        'reward.weights={jpeg_compressibility = 1.0, "bright:brightness" = 0.5}',
        "algorithm.reward_aggregation=normalize_each",
    )
    assert [s.iteration for s in run_loop(config, run, 2)] == [0, 1]
    log = read_log(run)
    assert [line["iteration"] for line in log] == [0, 1]
    for line in log:
        for reward in ("jpeg_compressibility", "bright:brightness"):
            for stat in ("mean", "std"):
                assert math.isfinite(line[f"reward/{reward}_{stat}"])
                assert math.isfinite(line[f"advantage/{reward}_{stat}"])
        # each group's A_k has mean 0, so the weighted sum has too
        assert line["advantage/mean"] == pytest.approx(0.0, abs=1e-6)
    metrics = json.loads((run.stage_dir(1, UPDATE) / "metrics.json").read_text())
    assert metrics["advantage/bright:brightness_std"] == log[1]["advantage/bright:brightness_std"]
    write_report(run)
    assert (run.root / "report" / "reward_std.png").is_file()
    assert (run.root / "report" / "advantages.png").is_file()
    table = read_table([run.stage_dir(1, UPDATE) / "advantages.arrow"])
    assert table.schema.field("advantage").type == pa.float32()
