"""The scaling planner (train/plan): all-reduce costs and the compute fit against hand-computed
numbers, and its command line, good and bad input. Expected values are worked out by hand in the
comments, never by the code under test."""
import json
import math
import subprocess
import sys

import pytest

from helpers import REPO, child_env, resnet50_kept_values
from models import memory
from train.plan import comm, compute, model
from train.plan.cli import main
from train.plan.hardware import Link

# Small hand-checkable links: inside a node 1 s per hop + 100 B/s; the network 10 s + 10 B/s per node.
IN_NODE, NETWORK = Link(1.0, 100.0), Link(10.0, 10.0)
MESSAGE = 1200.0  # bytes per rank


def cluster(gpus, per_node=4):
    return comm.Cluster(gpus, per_node, IN_NODE, NETWORK)


def test_flat_ring_in_one_node_and_across_nodes():
    # 4 ranks, one node: 2(4-1) = 6 rounds of 1 + (1200/4)/100 = 4 s
    assert comm.allreduce_time(cluster(4), MESSAGE, "flat") == pytest.approx(24.0)
    # 8 ranks over 2 nodes: 14 rounds limited by the network hop, 10 + (1200/8)/10 = 25 s
    assert comm.allreduce_time(cluster(8), MESSAGE, "flat") == pytest.approx(350.0)


def test_hierarchical_on_two_and_four_nodes():
    # reduce-scatter in the node: 3 x (1 + 300/100) = 12; all-gather the same 12.
    # 2 nodes: all-reduce of the 300-byte shard over 2 ranks; 4 columns leave the node at once, so
    # 10/4 = 2.5 B/s each: 2 x (10 + 150/2.5) = 140. Total 164.
    assert comm.allreduce_time(cluster(8), MESSAGE, "hierarchical") == pytest.approx(164.0)
    # 4 nodes: 6 rounds of 10 + 75/2.5 = 40 -> 240. Total 264.
    assert comm.allreduce_time(cluster(16), MESSAGE, "hierarchical") == pytest.approx(264.0)


def test_tree_has_logarithmic_latency():
    # 4 nodes: 2 log2(4) x 10 = 40 latency + 2 x 3/4 x 300 / 2.5 = 180 -> 220; plus 12 + 12 in the node.
    assert comm.allreduce_time(cluster(16), MESSAGE, "tree") == pytest.approx(244.0)


def test_torus_sends_half_each_way_at_once():
    # 2 x 4 grid, lines = nodes. Each half is 600 bytes.
    # step 1: half A reduce-scattered in the node, 3 x (1 + 150/100) = 7.5; half B across (2 ranks,
    #   4 columns share the network: 2.5 B/s): 1 x (10 + 300/2.5) = 130 -> 130
    # step 2: half A's 150-byte shard across: 2 x (10 + 75/2.5) = 80; half B's 300-byte shard in the
    #   node: 6 x (1 + 75/100) = 10.5 -> 80
    # step 3 = step 1 -> 130. Total 340.
    assert comm.allreduce_time(cluster(8), MESSAGE, "torus") == pytest.approx(340.0)
    # lines of 8 ranks = the whole job (rows 8 on 8 GPUs): half A is a plain reduce-scatter over 8
    # ranks spanning 2 nodes, one ring leaving each node: 7 x (10 + 75/10) = 122.5; half B has one-rank
    # columns first (nothing), then the same all-reduce over 8: 14 x (10 + 75/10) = 245 -> steps:
    # max(122.5, 0) + max(0, 245) + max(122.5, 0) = 490
    assert comm.allreduce_time(cluster(8), MESSAGE, "torus", rows=8) == pytest.approx(490.0)


def test_flat_on_gpus_is_nccls_cheaper_of_ring_and_tree():
    # 16 ranks = 4 nodes of 4. NCCL's ring pays each hop's own latency: 2(4-1) = 6 network hops x 10
    # + the other 30 - 6 = 24 in-node hops x 1 = 84, and 2 x 15/16 x 1200 / 10 = 225 bytes' time -> 309.
    # Its tree: 2 x (3 in-node hops x 1 + log2(4) = 2 network hops x 10) = 46, and 2 x 1200 / 10 = 240 -> 286.
    assert comm.nccl_choice(cluster(16), MESSAGE) == ("tree", pytest.approx(286.0))
    assert comm.allreduce_time(cluster(16), MESSAGE, "flat", nccl=True) == pytest.approx(286.0)
    # 10x the message: ring 84 + 2,250 = 2,334 against tree 46 + 2,400 = 2,446: the ring wins
    assert comm.nccl_choice(cluster(16), 10 * MESSAGE) == ("ring", pytest.approx(2334.0))
    # gloo (CPUs) keeps its one ring of synchronous rounds: 30 x (10 + 75/10) = 525
    assert comm.allreduce_time(cluster(16), MESSAGE, "flat") == pytest.approx(525.0)
    # one node of 4: the ring, 6 x 1 + 2 x 3/4 x 1200 / 100 = 24 (as gloo's), against the chain's 6 + 24 = 30
    assert comm.nccl_choice(cluster(4), MESSAGE) == ("ring", pytest.approx(24.0))


def test_default_plan_at_2528_h100_is_near_the_published_run(capsys):
    # NVIDIA's MLPerf v4.0 run on 316 DGX H100 (16 per GPU) logged about 6.88 M img/s: 2,720 per GPU.
    # The old model (one ring over 2,528 GPUs) predicted 580. Run as a user runs it: python -m train.plan
    result = subprocess.run([sys.executable, "-m", "train.plan", "--preset", "nvidia-mlperf40-2528gpu", "--gpu", "h100",
                             "--gpus", "2528", "--gpus-per-node", "8", "--network", "ib-ndr", "--links-per-node", "8",
                             "--json"], capture_output=True, text=True, timeout=300, env=child_env())
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert rows[0]["allreduce"] == "flat" and rows[0]["nccl_algorithm"] == "tree"
    assert abs(rows[0]["img_per_s_per_gpu"] - 2720) <= 0.25 * 2720
    code, out, _ = run_cli(capsys, "--published")
    row = next(line for line in out.splitlines() if "2,528 H100" in line)
    assert "2,720 img/s/GPU" in row and "316 DGX H100" in row and "16 per GPU" in row
    assert abs(float(row.split(" | ")[4].rstrip("%"))) <= 25


def test_every_published_row_says_how_it_was_run(capsys):
    code, out, _ = run_cli(capsys, "--published")
    assert code == 0
    header, _, *rows = out.splitlines()
    assert header.split(" | ")[1] == "how it was run"
    for row in rows:  # the hardware and the batch (or that it is unknown) in every row's second column
        run = row.split(" | ")[1]
        assert any(word in run for word in ("V100", "H100", "H200", "A100", "P100", "P40", "TPU")), row
        assert any(word in run for word in ("per GPU", "global", "batch not in our sources")), row


def test_one_gpu_has_no_communication():
    assert comm.allreduce_time(cluster(1, 1), MESSAGE, "hierarchical") == 0.0


def test_exposed_communication():
    # 4 s of all-reduce, 3/4 of it hidden, backward long enough: 1 s shows
    assert comm.exposed(4.0, 30.0, 0.75, 2 / 3) == pytest.approx(1.0)
    # backward of 2/3 x 3 = 2 s hides only 2 of the 4
    assert comm.exposed(4.0, 3.0, 0.75, 2 / 3) == pytest.approx(2.0)


def test_affine_fit_reproduces_its_points():
    # through (16, 5 ms) and (400, 53 ms): slope 48/384 = 0.125 ms, fixed 5 - 2 = 3 ms
    fixed, per_image = compute.affine([(16, 5e-3), (400, 53e-3)])
    assert (fixed, per_image) == (pytest.approx(3e-3), pytest.approx(0.125e-3))
    # one point at batch 256 taking 0.2 s with a knee of 24 images: per image 0.2 / 280
    fixed, per_image = compute.one_point(256, 0.2, 24.0)
    assert per_image == pytest.approx(0.2 / 280) and fixed == pytest.approx(24 * 0.2 / 280)
    with pytest.raises(ValueError):
        compute.affine([(256, 0.2), (256, 0.3)])


def test_compute_is_the_step_less_exposed_comm_and_optimizer():
    # step 10, comm 4 (3 hidden), optimizer 1 -> compute 8 (its backward, 5.3, hides 3)
    assert compute.compute_from_step(10.0, 4.0, 1.0, 0.75, 2 / 3) == pytest.approx(8.0)
    # step 12, comm 9 all overlappable, no optimizer: backward hides only 2/3 c: 12 = c + 9 - 2c/3 -> c = 9
    assert compute.compute_from_step(12.0, 9.0, 0.0, 1.0, 2 / 3) == pytest.approx(9.0)


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *args):
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out), err


def test_calibration_points_are_reproduced_end_to_end(capsys):
    # calibration.yaml: H100 7,160 img/s per GPU at 400 on 8 GPUs; 2,820 at 16 on 3,584 with trees
    rows, _ = plan_json(capsys, "--preset", "mlperf-bs3264", "--gpu", "h100", "--gpus", "8", "--per-gpu-batch", "400")
    assert rows[0]["img_per_s_per_gpu"] == pytest.approx(7160, rel=1e-9)
    rows, _ = plan_json(capsys, "--preset", "mlperf-bs3264", "--gpu", "h100", "--gpus", "3584", "--per-gpu-batch", "16",
                        "--allreduce", "tree")
    assert rows[0]["img_per_s_per_gpu"] == pytest.approx(2820, rel=1e-9)
    # one-point GPUs: V100 1,200 and H200 7,950
    rows, _ = plan_json(capsys, "--preset", "mlperf-bs3264", "--gpu", "v100", "--gpus", "1", "--per-gpu-batch", "256")
    assert rows[0]["img_per_s_per_gpu"] == pytest.approx(1200, rel=1e-9)
    rows, _ = plan_json(capsys, "--preset", "nvidia-mlperf40-8gpu", "--gpu", "h200", "--gpus", "8")
    assert rows[0]["img_per_s_per_gpu"] == pytest.approx(7950, rel=1e-9)


def test_one_point_gpus_borrow_the_reference_knee():
    params = model.parameter_count("resnet50")
    assert params == 25_557_032  # ResNet-50 v1.5
    calibration = model.load_calibration()
    h100 = model.fit_gpu("h100", calibration, params)
    v100 = model.fit_gpu("v100", calibration, params)
    doubled = model.fit_gpu("v100", calibration, params, fixed_cost_scale=2.0)
    assert v100.knee == pytest.approx(h100.knee)
    assert doubled.knee == pytest.approx(2 * h100.knee)
    # both pass through the V100's one point (no comm on one GPU): 256 / 1200 s less the optimizer
    for fit in (v100, doubled):
        assert fit.seconds(256) == pytest.approx(256 / 1200 - model.optimizer_seconds(model.GPUS["v100"], params))


def test_gpu_check_figures_replace_the_assumption(tmp_path):
    calibration = model.load_calibration()
    # this trainer measured one A100 at 128 (0.08 s a step) and 256 (0.15 s): slope 0.07/128, fixed 0.01
    opt = model.optimizer_seconds(model.GPUS["a100"], 25_557_032)
    calibration["measured"] = [{"gpu": "a100", "per_gpu_batch": 128, "img_per_s": 128 / (0.08 + opt)},
                               {"gpu": "a100", "per_gpu_batch": 256, "img_per_s": 256 / (0.15 + opt)}]
    fit = model.fit_gpu("a100", calibration, 25_557_032)
    assert fit.fixed_s == pytest.approx(0.01) and fit.per_image_s == pytest.approx(0.07 / 128)
    assert "measured" in fit.how


def test_one_count_prints_a_row(capsys):
    code, out, _ = run_cli(capsys, "--preset", "yamazaki2019", "--gpus", "2048", "--gpu", "v100", "--gpus-per-node", "4",
                           "--network", "ib-edr", "--links-per-node", "2", "--allreduce", "hierarchical")
    assert code == 0
    row = next(line for line in out.splitlines() if line.split()[:3] == ["2048", "512", "42"])  # 86,016 / 2,048
    assert "86,016" in row


def test_json_list_keys_and_arithmetic(capsys):
    rows, err = plan_json(capsys, "--preset", "nvidia-mlperf40-8gpu", "--gpu", "h100", "--gpus", "8,64,512,2528")
    assert [r["gpus"] for r in rows] == [8, 64]  # 3,200 = 8 x 400 = 64 x 50; not 512 or 2,528
    assert "512 GPUs" in err and "2528 GPUs" in err
    for r in rows:
        assert {"gpus", "per_gpu_batch", "step_s", "compute_s", "comm_s", "img_per_s", "epochs", "time_to_train_s",
                "valid_flops"} <= set(r)
        assert r["per_gpu_batch"] == 3200 // r["gpus"] and r["epochs"] == 37  # the preset's epochs
        assert r["step_s"] == pytest.approx(r["compute_s"] + r["comm_s"] + r["optimizer_s"] + r["agreement_s"])
        assert r["img_per_s"] == pytest.approx(3200 / r["step_s"])
        steps = math.ceil(37 * 1_281_167 / 3200)
        assert r["time_to_train_s"] == pytest.approx(5.0 + steps * r["step_s"] + r["eval_s"])
        # Valid FLOPS: 37 epochs of 24.3 GFLOP images over the time, x (0.759 / 0.763) ** 5
        flops = 37 * 1_281_167 * 24.3e9 / r["time_to_train_s"]
        assert r["valid_flops"] == pytest.approx(flops * (0.759 / 0.763) ** 5, rel=0.02)


def test_power_of_two_range_and_skipped_counts(capsys):
    code, out, _ = run_cli(capsys, "--preset", "mlperf-bs3264", "--gpu", "a100", "--gpus", "8:4096")
    assert code == 0
    first_cells = [line.split()[0] for line in out.splitlines()]
    assert [c for c in first_cells if c.isdigit()] == ["8", "16", "32", "64"]  # 3,264 = 64 x 51
    skipped = [line for line in out.splitlines() if line.startswith("skipped:")]
    assert [s.split()[1] for s in skipped] == ["128", "256", "512", "1024", "2048", "4096"]
    assert "35.2" in out  # mlperf-* preset: the reference's mean epochs at 3,264


def test_per_gpu_batch_takes_epochs_from_the_mlperf_table(capsys):
    rows, _ = plan_json(capsys, "--preset", "goyal2017-8k", "--gpu", "h100", "--gpus", "2048,3072,4096",
                        "--per-gpu-batch", "16")
    assert [r["global_batch"] for r in rows] == [32768, 49152, 65536]
    assert [r["epochs"] for r in rows] == [56.0, 68.0, 84.5]  # the table's own points
    assert all("MLPerf table" in r["epochs_source"] for r in rows)
    rows, _ = plan_json(capsys, "--preset", "goyal2017-8k", "--gpu", "h100", "--gpus", "2560", "--per-gpu-batch", "16")
    # 40,960 between 32,768 (56) and 49,152 (68): log2 share = log2(1.25) / log2(1.5) = 0.5503 -> 62.6
    assert rows[0]["epochs"] == pytest.approx(56 + 12 * math.log2(1.25) / math.log2(1.5))


def test_batch_schedule_runs_in_phases(capsys):
    rows, _ = plan_json(capsys, "--preset", "mikami2018", "--gpu", "v100", "--gpus", "2176", "--gpus-per-node", "4",
                        "--network", "ib-edr", "--links-per-node", "2")
    phases = rows[0]["phases"]
    assert [(p["epochs"], p["per_gpu_batch"]) for p in phases] == [(30, 16), (58, 32)]  # 34,816 then 69,632; 88 epochs


@pytest.mark.parametrize("args, words", [
    (["--gpu", "p100"], ["p100", "v100, a100, h100, h200"]),
    (["--gpu", "tpu"], ["tpu", "v100, a100, h100, h200"]),
    (["--network", "myrinet"], ["myrinet", "ib-edr"]),
    (["--gpus", "12", "--gpus-per-node", "8"], ["12 GPUs", "nodes of 8"]),
    (["--gpus", "128,256"], ["no GPU count fits", "3,264", "128"]),
    (["--gpus", "8:x"], ["--gpus"]),
    (["--allreduce", "ring2"], ["ring2"]),
    (["--preset", "nope"], ["nope"]),
    (["--per-gpu-batch", "0"], ["--per-gpu-batch", "at least 1", "got 0"]),
    (["--gpus-per-node", "0"], ["--gpus-per-node", "got 0"]),
    (["--links-per-node", "0"], ["--links-per-node", "got 0"]),
    (["--per-gpu-batch", "3264"], ["3,264", "80 GB"]),  # an A100 holds about 1,724 (test below)
    (["--network", "custom"], ["--network custom needs --link-gbps and --latency-us"]),
    (["--network", "custom", "--link-gbps", "1"], ["needs --latency-us:"]),
    (["--link-gbps", "1", "--latency-us", "5"], ["--network custom only", "leave them out"]),
    (["--network", "ib-edr", "--latency-us", "5"], ["--latency-us describes --network custom only"]),
    (["--network", "custom", "--link-gbps", "0", "--latency-us", "5"], ["--link-gbps", "positive finite", "got 0"]),
    (["--network", "custom", "--link-gbps", "1", "--latency-us", "-5"], ["--latency-us", "got -5"]),
    (["--network", "custom", "--link-gbps", "inf", "--latency-us", "5"], ["--link-gbps", "got inf"]),
    (["--network", "custom", "--link-gbps", "1", "--latency-us", "nan"], ["--latency-us", "got nan"]),
])
def test_bad_input_exits_2_with_one_line(capsys, args, words):
    base = {"--preset": "mlperf-bs3264", "--gpu": "a100", "--gpus": "8"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    code, out, err = run_cli(capsys, *[x for pair in base.items() for x in pair])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    for word in words:
        assert word in err


def test_report_writes_a_png(capsys, tmp_path):
    path = tmp_path / "plan.png"
    code, out, _ = run_cli(capsys, "--preset", "mlperf-bs3264", "--gpu", "a100", "--gpus", "8:64", "--report", str(path))
    assert code == 0 and str(path) in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_throughput_is_held_to_the_fastest_measured_point(capsys):
    # A100's one point: 2,470 img/s at 256 on one GPU; H100's fastest: 7,160 at 400. The fitted lines
    # would give 2,647 at 1,024 and 7,511 at 1,600 images.
    for gpu, batch, fastest in (("a100", "1024", 2470), ("h100", "1600", 7160)):
        rows, _ = plan_json(capsys, "--preset", "mlperf-bs3264", "--gpu", gpu, "--gpus", "1", "--per-gpu-batch", batch)
        assert rows[0]["img_per_s_per_gpu"] == pytest.approx(fastest) and rows[0]["peak_bound"]
    code, out, _ = run_cli(capsys, "--preset", "mlperf-bs3264", "--gpu", "a100", "--gpus", "1",
                           "--per-gpu-batch", "1024")
    assert "^" in out and "2,470 img/s per GPU" in out


def test_a_per_gpu_batch_must_fit_in_gpu_memory(capsys):
    # A100-80GB: (80e9 - 2e9 reserve - 16 x 25,557,032 of model state) / 45e6 per image = 1,724.2
    rows, _ = plan_json(capsys, "--preset", "mlperf-bs3264", "--gpu", "a100", "--gpus", "1", "--per-gpu-batch", "1724")
    assert rows[0]["per_gpu_batch"] == 1724
    code, _, err = run_cli(capsys, "--preset", "mlperf-bs3264", "--gpu", "a100", "--gpus", "1", "--per-gpu-batch", "1725")
    assert code == 2 and "1,725" in err and "at most 1,724" in err
    # the preset's global batch of 3,264 on 1 GPU does not fit at once: two batches of 1,632 a step do;
    # on 64 (51 each) it fits
    rows, err = plan_json(capsys, "--preset", "mlperf-bs3264", "--gpu", "a100", "--gpus", "1,64")
    assert [(r["gpus"], r["per_gpu_batch"], r["accumulation_steps"]) for r in rows] == [(1, 1632, 2), (64, 51, 1)]
    assert err == ""
    # every calibration point fits: V100-16GB at 256 ((16e9 - 2e9 - 0.41e9) / 45e6 = 302)
    rows, _ = plan_json(capsys, "--preset", "mlperf-bs3264", "--gpu", "v100", "--gpus", "1", "--per-gpu-batch", "256")
    assert rows[0]["img_per_s_per_gpu"] == pytest.approx(1200)


def test_activation_estimate_counts_the_models_kept_tensors():
    # The tensors backward keeps, per 224 px image, in fp16 (tests/helpers: resnet50_kept_values)
    assert memory.ACTIVATION_BYTES_PER_IMAGE == pytest.approx(2 * resnet50_kept_values(), rel=0.02)


def test_epochs_held_at_the_table_ends_are_said_and_listed_in_order(capsys):
    # global batch 8 (below the table's 1,632), 16,384 (between 13,056 and 32,768), 1,048,576 (above 67,840)
    code, out, _ = run_cli(capsys, "--preset", "goyal2017-8k", "--gpu", "h100", "--gpus", "131072,1,2048",
                           "--per-gpu-batch", "8")
    assert code == 0
    footer = next(line for line in out.splitlines() if line.startswith("epochs: "))
    parts = footer.removeprefix("epochs: MLPerf table at global batch ").split("; ")
    assert [p.split(" (")[0] for p in parts] == ["8", "16,384", "1,048,576"]
    assert "held at its smallest, 1,632: 35 epochs" in parts[0] and "interpolated" in parts[1]
    assert "held at its largest, 67,840: 85.9 epochs" in parts[2]
    assert "interpolated" not in parts[0] + parts[2]
    rows, _ = plan_json(capsys, "--preset", "goyal2017-8k", "--gpu", "h100", "--gpus", "1", "--per-gpu-batch", "8")
    assert "held at its smallest" in rows[0]["epochs_source"] and rows[0]["epochs"] == 35.0


def test_report_refuses_unknown_extensions_and_unwritable_paths(capsys, tmp_path):
    base = ["--preset", "mlperf-bs3264", "--gpu", "a100", "--gpus", "8"]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for report, words in ((tmp_path / "plan.txt", ["'.txt'", ".png"]), (blocker / "plan.png", ["cannot write"]),
                          (tmp_path, ["is a folder"])):
        code, out, err = run_cli(capsys, *base, "--report", str(report))
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
        assert all(word in err for word in words), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing half-written


def test_report_prints_the_path_it_wrote_and_the_folder_it_made(capsys, tmp_path):
    base = ["--preset", "mlperf-bs3264", "--gpu", "a100", "--gpus", "8"]
    code, out, _ = run_cli(capsys, *base, "--report", str(tmp_path / "plan"))  # no suffix: a PNG
    assert code == 0 and f"report: {tmp_path / 'plan.png'}\n" in out
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, _ = run_cli(capsys, *base, "--report", str(tmp_path / "new" / "deeper" / "plan.svg"))
    assert code == 0 and f"(made the folder {tmp_path / 'new' / 'deeper'})" in out
    assert (tmp_path / "new" / "deeper" / "plan.svg").read_text().lstrip().startswith("<?xml")
    code, out, err = run_cli(capsys, *base, "--json", "--report", str(tmp_path / "j.png"))
    assert json.loads(out) and f"report: {tmp_path / 'j.png'}" in err


def test_report_lines_are_told_apart_and_the_gpu_axis_reads_plain_counts():
    from train.plan import cli, report
    args = cli.parser().parse_args(["--preset", "mlperf-bs3264", "--gpu", "a100", "--gpus", "8:64"])
    lines = {name: cli.plans(cli.system_of(args, name), [8, 16, 32, 64])[0] for name in comm.ALGORITHMS}
    fig = report.figure(lines, "test")
    fig.canvas.draw()
    for axis in fig.axes:
        assert [t.get_text() for t in axis.get_xticklabels()] == ["8", "16", "32", "64"]
        assert all("^" not in t.get_text() for t in axis.get_yticklabels())  # no 10^k labels
        drawn = {line.get_label(): line for line in axis.get_lines()}
        algorithms = [label for label in drawn if label.split()[0] in comm.ALGORITHMS]
        assert len(algorithms) == 4
        styles = {(drawn[a].get_linestyle(), drawn[a].get_marker()) for a in algorithms}
        assert len(styles) == 4  # each algorithm its own line style and marker
    # on one A100 node the all-reduce hardly matters: the legend names the lines that coincide
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("same as" in label for label in labels)


# --network custom: a link by the rate it delivers and its one-way latency, the flags with which
# scripts/bench/allreduce.py --cluster compares the planner with a shaped cluster. No --preset: the
# trainer's defaults, 256 images per GPU, which every count divides into.
CUSTOM = ["--gpu", "v100", "--gpus-per-node", "1", "--links-per-node", "1", "--allreduce", "flat", "--wire", "fp32",
          "--network", "custom", "--link-gbps", "0.15", "--latency-us", "50"]
FP32_GRADIENT_BYTES = 4 * 25_557_032  # ResNet-50 v1.5's gradients in fp32


def ring_allreduce_s(nodes, links=1):
    """docs/planner.md's ring all-reduce, one GPU per node so every hop crosses the network: 2(n-1)/n
    of the message at 0.15 Gbit/s x links (no efficiency factor), and 2(n-1) latencies of 50 us."""
    rate = 0.15e9 / 8 * links
    return 2 * (nodes - 1) / nodes * FP32_GRADIENT_BYTES / rate + 2 * (nodes - 1) * 50e-6


def test_custom_network_all_reduce_is_the_ring_formula():
    # run as the bench runs it; flat is NCCL's cheaper of ring and tree: here the ring, as the tree
    # would move twice the bytes (seconds at 150 Mbit/s) to save microseconds of latency
    result = subprocess.run([sys.executable, "-m", "train.plan", "--gpus", "2,3,4,6", *CUSTOM, "--json"],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=child_env())
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["gpus"], r["nodes"], r["nccl_algorithm"]) for r in rows] == [(g, g, "ring") for g in (2, 3, 4, 6)]
    for r in rows:
        assert r["comm_total_s"] == pytest.approx(ring_allreduce_s(r["nodes"]), rel=1e-12)
    # 2 nodes: 102,228,128 B / 18.75 MB/s = 5.452167 s, + 2 x 50 us
    assert rows[0]["comm_total_s"] == pytest.approx(5.452267, abs=1e-6)


def test_custom_network_links_add_bandwidth_not_latency(capsys):
    (one,), _ = plan_json(capsys, "--gpus", "2", *CUSTOM)
    (two,), _ = plan_json(capsys, "--gpus", "2", *CUSTOM, "--links-per-node", "2")
    latency = 2 * 50e-6
    assert two["comm_total_s"] - latency == pytest.approx((one["comm_total_s"] - latency) / 2, rel=1e-12)
    assert two["comm_total_s"] == pytest.approx(ring_allreduce_s(2, links=2), rel=1e-12)


def test_custom_network_hierarchical_and_its_name_in_the_header(capsys):
    # 2 nodes x 2 V100: reduce-scatter in the node, 1 round over NVLink (150 GB/s x 0.8, 3 us) of
    # m/2; the node's 2 rings share its link across: 2 rounds of 50 us + (m/4) / (rate/2); all-gather
    # as the reduce-scatter
    m, rate, nvlink = FP32_GRADIENT_BYTES, 0.15e9 / 8, 150e9 * 0.8
    expected = 2 * (3e-6 + m / 2 / nvlink) + 2 * (50e-6 + m / 4 / (rate / 2))
    (row,), _ = plan_json(capsys, "--gpus", "4", *CUSTOM, "--gpus-per-node", "2", "--allreduce", "hierarchical")
    assert row["nodes"] == 2 and row["comm_total_s"] == pytest.approx(expected, rel=1e-12)
    code, out, _ = run_cli(capsys, "--gpus", "2", *CUSTOM)
    assert code == 0 and "1 x custom 0.15 Gbit/s, 50 us per node" in out.splitlines()[0]


def test_custom_network_refusal_exits_2_with_one_line():
    # the cases are in test_bad_input_exits_2_with_one_line; here one as a user meets it
    result = subprocess.run([sys.executable, "-m", "train.plan", "--gpus", "2", *CUSTOM[:-2]],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=child_env())
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: --network custom needs --latency-us:")
    assert len(result.stderr.strip().splitlines()) == 1


def ffcv_16_epochs(**changes) -> dict:
    """The plan of the ffcv-rn50-16ep preset on 8 A100s (ResNet-50 with BlurPool, 16 epochs of 160 px
    crops, evaluated every 4 epochs at 256 px with flips), its settings changed by `changes`."""
    import dataclasses
    from train.plan.cli import parser, system_of
    system = system_of(parser().parse_args(["--preset", "ffcv-rn50-16ep", "--gpu", "a100", "--gpus", "8"]))
    return model.plan(dataclasses.replace(system, cfg=dataclasses.replace(system.cfg, **changes)), 8)


def work(row: dict) -> float:
    """The FLOPs of a planned run: its FLOPS over its time to train."""
    return row["flops"] * row["time_to_train_s"]


def test_a_flipped_evaluation_is_planned_as_two_forward_passes():
    from models import eval_flops_per_image
    flipped, plain = ffcv_16_epochs(), ffcv_16_epochs(eval_flip=False)
    assert flipped["eval_s"] == pytest.approx(2 * plain["eval_s"])
    assert flipped["time_to_train_s"] - plain["time_to_train_s"] == pytest.approx(plain["eval_s"])
    # 4 evaluations of 50,000 images, each image one more forward pass at 256 px
    assert work(flipped) - work(plain) == pytest.approx(4 * 50_000 * eval_flops_per_image("resnet50", 256, blurpool=True))


def test_the_plans_work_is_its_training_and_evaluations_with_blurpools_blurs():
    from models import eval_flops_per_image, train_flops_per_image
    blurred, plain = ffcv_16_epochs(), ffcv_16_epochs(blurpool=False)
    for blurpool, row in ((True, blurred), (False, plain)):  # 16 epochs at 160 px; 4 flipped evaluations at 256
        assert work(row) == pytest.approx(16 * 1_281_167 * train_flops_per_image("resnet50", 160, blurpool=blurpool)
                                          + 4 * 50_000 * 2 * eval_flops_per_image("resnet50", 256, blurpool=blurpool))
    assert work(blurred) > work(plain)
    # the calibration points time the plain model: the blurs' time is not guessed
    assert blurred["time_to_train_s"] == plain["time_to_train_s"]


# Gradient accumulation: a global batch whose share of a GPU does not fit in its memory is planned as
# N batches a step, N the fewest that split the share into whole batches that fit (docs/planner.md).
V100_FITS = 302  # (16e9 - 2e9 reserve - 16 x 25,557,032 of model state) / 45e6 per 224 px image


def fewest_accumulation_steps(global_batch, gpus, fits):
    """The trainer's rule, written out: the smallest N that makes global / (gpus x N) a whole batch
    of at most `fits` images."""
    share = global_batch // gpus
    return next(n for n in range(1, share + 1) if share % n == 0 and share // n <= fits)


def test_akiba_32k_on_8_and_64_v100s_is_planned_with_accumulation(capsys):
    # A V100 holds 302 images (test_a_per_gpu_batch_must_fit_in_gpu_memory). 32,768 on 8 GPUs is
    # 4,096 a GPU = 2^12: 2,048, 1,024 and 512 are too many, 256 fits: N = 16. On 64: 512, N = 2.
    rows, err = plan_json(capsys, "--preset", "akiba2017-32k", "--gpu", "v100", "--gpus", "8,64")
    assert err == ""  # neither skipped
    planned = {r["gpus"]: r for r in rows}
    for gpus, steps in ((8, 16), (64, 2)):
        row = planned[gpus]
        assert fewest_accumulation_steps(32768, gpus, V100_FITS) == steps
        assert (row["per_gpu_batch"], row["accumulation_steps"]) == (256, steps)
        assert row["per_gpu_batch"] * row["accumulation_steps"] * gpus == row["global_batch"] == 32768
        keys = list(row)  # the batch of one pass, N beside it
        assert keys.index("accumulation_steps") == keys.index("per_gpu_batch") + 1
        # against the same GPUs at 256 a GPU and one batch a step: N batches' compute, the same exposed
        # all-reduce (behind the last backward) and one optimizer update
        (fitting,), _ = plan_json(capsys, "--preset", "akiba2017-32k", "--gpu", "v100", "--gpus", str(gpus),
                                  "--per-gpu-batch", "256")
        assert fitting["accumulation_steps"] == 1
        assert row["compute_s"] == pytest.approx(steps * fitting["compute_s"])
        assert row["comm_s"] == pytest.approx(fitting["comm_s"]) and row["comm_s"] > 0
        assert row["optimizer_s"] == pytest.approx(fitting["optimizer_s"])
        assert (row["step_s"] - row["agreement_s"]) - (fitting["step_s"] - fitting["agreement_s"]) == pytest.approx(
            (steps - 1) * fitting["compute_s"])
        assert row["step_s"] > fitting["step_s"] and not row["peak_bound"]
        assert row["img_per_s"] == pytest.approx(32768 / row["step_s"])
    code, out, _ = run_cli(capsys, "--preset", "akiba2017-32k", "--gpu", "v100", "--gpus", "8,64")
    header, *lines = [line.split() for line in out.splitlines()[3:6]]
    assert code == 0 and header[:5] == ["GPUs", "nodes", "batch/GPU", "accum", "global"]
    assert [line[:5] for line in lines] == [["8", "1", "256", "16", "32,768"], ["64", "8", "256", "2", "32,768"]]


def test_a_batch_schedule_keeps_n_where_the_batch_can_follow_and_grows_it_where_not(capsys):
    # mikami2018 on 8 V100s: 34,816 / 8 = 4,352 = 2^8 x 17 a GPU: N = 16 (272; 8 gives 544). After
    # epoch 30, 69,632 / 8 = 8,704 at N = 16 is 544, too many: N grows to 32 (17 leaves 512), 272.
    rows, _ = plan_json(capsys, "--preset", "mikami2018", "--gpu", "v100", "--gpus", "8,64")
    phases = {r["gpus"]: [(p["epochs"], p["per_gpu_batch"], p["accumulation_steps"], p["global_batch"])
                          for p in r["phases"]] for r in rows}
    assert phases[8] == [(30, 272, 16, 34816), (58, 272, 32, 69632)]
    assert phases[64] == [(30, 272, 2, 34816), (58, 272, 4, 69632)]  # 544 a GPU: N = 2; then 1,088: N = 4
    code, out, _ = run_cli(capsys, "--preset", "mikami2018", "--gpu", "v100", "--gpus", "8")
    assert "8 GPUs: then 58 epochs at 272/GPU x 32 accumulated (global 69,632)" in out
    # a phase whose batch would fit at fewer steps keeps N and lets the batch follow: on 8 A100s (1,724
    # fit) 34,816 is 4,352 a GPU, N = 4 (1,088; 2 leaves 2,176); then 8,192 is 1,024 a GPU: 256 x 4, not 1,024 x 1
    import dataclasses
    from train.plan.cli import parser, system_of
    system = system_of(parser().parse_args(["--preset", "mikami2018", "--gpu", "a100", "--gpus", "8"]))
    row = model.plan(dataclasses.replace(system, cfg=dataclasses.replace(system.cfg, batch_schedule="30:8192")), 8)
    assert [(p["per_gpu_batch"], p["accumulation_steps"]) for p in row["phases"]] == [(1088, 4), (256, 4)]


def test_a_count_no_accumulation_can_carry_is_still_skipped():
    # 4,096 px crops: 45.2e6 x (4096 / 224)^2 = 15.1e9 bytes an image, more than a V100's 13.6e9 free
    import dataclasses
    from train.plan.cli import parser, system_of
    system = system_of(parser().parse_args(["--preset", "akiba2017-32k", "--gpu", "v100", "--gpus", "8"]))
    with pytest.raises(model.Skip, match=r"per-GPU batch 1 does not fit in the v100's 16 GB \(at most 0 images of "
                                         r"4096 px; docs/planner.md\): no accumulation carries global batch 32,768"):
        model.plan(dataclasses.replace(system, cfg=dataclasses.replace(system.cfg, image_size=4096)), 8)


def test_only_the_last_batchs_backward_hides_the_all_reduce():
    # 2 V100s on a 150 Mbit/s link (CUSTOM above): the all-reduce takes seconds, a batch of 16 tens of
    # milliseconds, so what hides it is backward (2/3 of one batch's compute), not 0.75 of it; with 4
    # batches a step it is still one batch's backward, the first three having sent nothing
    from train.plan.cli import parser, system_of
    system = system_of(parser().parse_args(["--gpus", "2", *CUSTOM]))
    one, four = model.step_terms(system, 2, 16), model.step_terms(system, 2, 16, 224, 4)
    assert four["compute_s"] == pytest.approx(4 * one["compute_s"])
    assert four["comm_total_s"] == one["comm_total_s"] == pytest.approx(ring_allreduce_s(2), rel=1e-12)
    assert four["comm_s"] == pytest.approx(four["comm_total_s"] - 2 / 3 * four["compute_s"] / 4)
    assert four["global_batch"] == 2 * 16 * 4 and four["accumulation_steps"] == 4
