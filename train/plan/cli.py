"""The command line of `python -m train.plan` (see the package's docstring)."""
import argparse
import json
import sys

import train.plan as package
from train.cli import parse as parse_config
from train.command import CommandParser
from train.config import Config
from train.errors import UsageError
from train.plan import comm, model, report
from train.plan.hardware import CUSTOM, GPUS, IN_NODE_LATENCY_S, NETWORKS, CustomNetwork, gpu as gpu_spec
from train.plan.published import CHECKS, PUBLISHED_TOP1
from train.rules import DEFAULT_PER_RANK_BATCH

NO_PRESET = "none"  # how the output names a plan of the trainer's defaults (no --preset)


USAGE = ("python -m train.plan --gpus N[,M|A:B] --gpu NAME [--preset NAME] [OPTIONS]\n"
         "       python -m train.plan --published")


def parser() -> argparse.ArgumentParser:
    """The flags, one argument group per task, each with its help and its default said once."""
    p = CommandParser(prog="python -m train.plan", usage=USAGE, description=package.__doc__.splitlines()[0],
                      epilog="The model and where each of its figures comes from: docs/planner.md.")
    what = p.add_argument_group("what to plan")
    what.add_argument("--preset", metavar="NAME", help="a trainer preset (train/presets) or a .yaml path (default: none, "
                      f"the trainer's defaults: ResNet-50 at 224 px, {DEFAULT_PER_RANK_BATCH} images per GPU kept)")
    what.add_argument("--gpus", metavar="COUNTS", help="GPU counts: N, a list N,M,..., or A:B (A, 2A, 4A, ... up to "
                      "B); required unless --published")
    what.add_argument("--per-gpu-batch", type=int, metavar="N", help="keep this per-GPU batch: the global batch grows "
                      "with the GPUs, epochs from the MLPerf table (default: keep the preset's global batch, accumulating the gradients "
                      "of several batches a step where a GPU's share of it does not fit)")
    machine = p.add_argument_group("machine and network")
    machine.add_argument("--gpu", metavar="NAME", help=f"the GPU: one of {', '.join(GPUS)}; required unless --published")
    machine.add_argument("--gpus-per-node", type=int, metavar="N", help="GPUs in one node (default: the GPU's usual "
                         "server's, 8)")
    machine.add_argument("--network", metavar="NAME", help=f"the network between nodes: one of {', '.join(NETWORKS)}, "
                         f"or {CUSTOM} (with --link-gbps and --latency-us) (default: the GPU's usual server's)")
    machine.add_argument("--link-gbps", type=float, metavar="X", help=f"--network {CUSTOM}: Gbit/s one link delivers "
                         "per direction (0.15: 150 Mbit/s), taken as is: no efficiency factor")
    machine.add_argument("--latency-us", type=float, metavar="X", help=f"--network {CUSTOM}: one-way latency of a "
                         "hop, microseconds")
    machine.add_argument("--links-per-node", type=int, metavar="N", help="network adapters per node (default: the "
                         "GPU's usual server's)")
    machine.add_argument("--in-node", default="nvlink", metavar="NAME", help="the link between a node's GPUs: one of "
                         f"{', '.join(IN_NODE_LATENCY_S)} (default: nvlink)")
    allreduce = p.add_argument_group("all-reduce")
    allreduce.add_argument("--allreduce", metavar="NAME", help=f"how gradients are averaged: one of "
                           f"{', '.join(comm.ALGORITHMS)} (default: the preset's)")
    allreduce.add_argument("--torus-rows", type=int, metavar="N", help="--allreduce torus: ranks per line of the grid "
                           "(default: the preset's; 0: the GPUs per node)")
    allreduce.add_argument("--overlap", type=float, default=model.DEFAULT_OVERLAP, metavar="X",
                           help=f"share of the all-reduce hidden behind backward (default: {model.DEFAULT_OVERLAP:g})")
    allreduce.add_argument("--wire", choices=tuple(model.WIRE_BYTES), default="fp16", metavar="NAME",
                           help=f"the gradients' type on the wire: one of {', '.join(model.WIRE_BYTES)} (default: fp16)")
    start = p.add_argument_group("input and start-up")
    start.add_argument("--loader", choices=("dali-gpu", "cpu"), default="dali-gpu", metavar="NAME",
                       help="where images are decoded: dali-gpu or cpu (default: dali-gpu)")
    start.add_argument("--cpu-cores-per-gpu", type=int, default=8, metavar="N",
                       help="--loader cpu: decoding cores per GPU (default: 8)")
    start.add_argument("--startup-s", type=float, default=model.DEFAULT_STARTUP_S, metavar="X",
                       help=f"seconds from the run's start to its first step (default: {model.DEFAULT_STARTUP_S:g})")
    calibration = p.add_argument_group("calibration")
    calibration.add_argument("--calibration", metavar="PATH", help="the calibration YAML the compute model is fitted "
                             "to (default: the package's calibration.yaml)")
    calibration.add_argument("--fixed-cost-scale", type=float, default=1.0, metavar="X",
                             help="GPUs with one calibration point: scale their assumed fixed per-step cost, to see "
                                  "how much it matters (default: 1)")
    calibration.add_argument("--published", action="store_true", help="compare the planner with the published "
                             "results it was not fitted to (a markdown table), and stop")
    output = p.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print a JSON list, one object per GPU count, instead of "
                        "the table")
    output.add_argument("--report", metavar="PATH", help="also draw a .png, .svg or .pdf file (no suffix: .png): "
                        "images/s, images/s per GPU and time to train against GPU count, one line per all-reduce; "
                        "missing folders are made")
    return p


def gpu_counts(spec: str) -> list[int]:
    """'N', 'N,M,...' or 'A:B' (doubling from A up to B)."""
    try:
        if ":" in spec:
            low, high = (int(x) for x in spec.split(":"))
            if low < 1 or high < low:
                raise ValueError
            counts = []
            while low <= high:
                counts.append(low)
                low *= 2
            return counts
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise UsageError(f"--gpus {spec!r}: give N, N,M,... or A:B with 1 <= A <= B") from None
    if any(c < 1 for c in counts):
        raise UsageError(f"--gpus {spec!r}: counts must be positive")
    return counts


def network_of(args, usual: str) -> str | CustomNetwork:
    """--network (default: the usual server's `usual`); custom is built from --link-gbps and --latency-us,
    which describe nothing else and so are refused without it."""
    custom_flags = {"--link-gbps": args.link_gbps, "--latency-us": args.latency_us}
    if args.network != CUSTOM:
        given = [flag for flag, value in custom_flags.items() if value is not None]
        if given:
            both = len(given) > 1
            raise UsageError(f"{' and '.join(given)} {'describe' if both else 'describes'} --network {CUSTOM} only; "
                             f"add --network {CUSTOM} or leave {'them' if both else 'it'} out")
        return args.network or usual
    missing = [flag for flag, value in custom_flags.items() if value is None]
    if missing:
        raise UsageError(f"--network {CUSTOM} needs {' and '.join(missing)}: give --link-gbps G (Gbit/s one link "
                         "delivers) and --latency-us L (one-way, microseconds)")
    return CustomNetwork(args.link_gbps, args.latency_us)


def system_of(args, allreduce: str | None = None) -> model.PlannedSystem:
    """The planned system of the flags: the preset loaded as the trainer loads it, the GPU's fitted compute."""
    if args.preset:
        cfg, preset, per_gpu_batch = parse_config(["--preset", args.preset]), args.preset, args.per_gpu_batch or 0
    else:  # the trainer's defaults: its per-rank batch on every GPU count, so that any count divides
        cfg, preset, per_gpu_batch = Config(), NO_PRESET, args.per_gpu_batch or DEFAULT_PER_RANK_BATCH
    spec = gpu_spec(args.gpu)
    per_node, network, links = spec.node
    machine = model.Machine(spec, per_node if args.gpus_per_node is None else args.gpus_per_node,
                            network_of(args, network), links if args.links_per_node is None else args.links_per_node,
                            args.in_node)
    if machine.gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node must be at least 1, got {machine.gpus_per_node}")
    machine.cluster(2)  # a bad --network, --links-per-node or --in-node is refused now
    allreduce = allreduce or args.allreduce or cfg.allreduce
    if allreduce not in comm.ALGORITHMS:
        raise UsageError(f"unknown --allreduce {allreduce!r}; known: {', '.join(comm.ALGORITHMS)}")
    if not 0 <= args.overlap <= 1:
        raise UsageError(f"--overlap must be in [0, 1], got {args.overlap}")
    if args.per_gpu_batch is not None and args.per_gpu_batch < 1:
        raise UsageError(f"--per-gpu-batch must be at least 1, got {args.per_gpu_batch} (leave it out to keep the "
                         "preset's global batch)")
    if args.fixed_cost_scale <= 0 or args.cpu_cores_per_gpu < 1 or args.startup_s < 0:
        raise UsageError("--fixed-cost-scale and --cpu-cores-per-gpu must be positive, --startup-s not negative")
    calibration = model.load_calibration(args.calibration)
    params = model.parameter_count(cfg.arch)
    fit = model.fit_gpu(spec.name, calibration, params, args.fixed_cost_scale)
    top1 = PUBLISHED_TOP1.get(args.preset) or cfg.target_accuracy or model.MLPERF_TARGET
    cap = model.DALI_GPU_IMG_S if args.loader == "dali-gpu" else args.cpu_cores_per_gpu * model.CPU_DECODE_IMG_S_PER_CORE
    rows = cfg.torus_rows if args.torus_rows is None else args.torus_rows
    return model.PlannedSystem(preset, cfg, machine, fit, allreduce, rows, args.overlap, args.wire, cap, per_gpu_batch,
                       args.startup_s, top1)


def plans(system: model.PlannedSystem, counts: list[int]) -> tuple[list[dict], list[str]]:
    """(a row per count that can run, a reason per count that cannot)."""
    rows, skipped = [], []
    for count in counts:
        try:
            rows.append(model.plan(system, count))
        except model.Skip as why:
            skipped.append(f"{count} GPUs: {why}")
    return rows, skipped


def duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.2f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def header(system: model.PlannedSystem) -> list[str]:
    m, fit, params = system.machine, system.fit, model.parameter_count(system.cfg.arch)
    batch = (f"per-GPU batch {system.per_gpu_batch} kept" if system.per_gpu_batch
             else f"global batch {system.cfg.global_batch_size:,} kept" + (f", then {system.cfg.batch_schedule}"
                                                                           if system.cfg.batch_schedule else ""))
    return [f"plan: preset {system.preset} ({batch}); {m.gpu.name} ({m.gpu.precision}), {m.gpus_per_node} per node, "
            f"{m.links_per_node} x {m.network} per node, {m.in_node} in the node",
            f"all-reduce {system.allreduce}" + (f" (torus rows {system.torus_rows or m.gpus_per_node})"
                                                if system.allreduce == "torus" else
                                                " (NCCL's: the cheaper of its ring and tree)"
                                                if system.allreduce == "flat" else "")
            + f" of {params:,} {system.wire} gradients ({params * model.WIRE_BYTES[system.wire] / 1e6:.1f} MB), "
            f"{system.overlap:g} hidden behind backward; input cap {system.input_cap:,.0f} img/s per GPU; "
            f"start-up {system.startup_s:g} s; Valid FLOPS at top-1 {system.top1}",
            f"compute per step: {fit.fixed_s * 1e3:.2f} ms + {fit.per_image_s * 1e3:.4f} ms/image ({fit.how})"]


def table(rows: list[dict]) -> list[str]:
    lines = [("GPUs", "nodes", "batch/GPU", "accum", "global", "compute ms", "comm ms", "opt ms", "agree ms", "step ms",
              "img/s", "img/s/GPU", "epochs", "eval s", "time to train", "FLOPS", "Valid FLOPS")]
    for r in rows:
        phased = "+" if "phases" in r else ""  # the first phase's batch and N; the notes give the others
        lines.append((f"{r['gpus']}", f"{r['nodes']}", f"{r['per_gpu_batch']}{phased}",
                      f"{r['accumulation_steps']}{phased}", f"{r['global_batch']:,}", f"{r['compute_s'] * 1e3:.2f}",
                      f"{r['comm_s'] * 1e3:.2f}", f"{r['optimizer_s'] * 1e3:.2f}", f"{r['agreement_s'] * 1e3:.3f}",
                      f"{r['step_s'] * 1e3:.2f}" + ("*" if r["input_bound"] else "^" if r["peak_bound"] else ""),
                      f"{r['img_per_s']:,.0f}", f"{r['img_per_s_per_gpu']:,.0f}", f"{r['epochs']:.1f}",
                      f"{r['eval_s']:.1f}", duration(r["time_to_train_s"]), f"{r['flops']:.3e}",
                      f"{r['valid_flops']:.3e}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines]


def epochs_note(rows: list[dict], per_gpu_batch_kept: bool) -> str:
    """Where the epochs come from. With --per-gpu-batch: the MLPerf table at each global batch, in
    increasing order, batches that share a reason (held at an end, interpolated, the table's own) as one."""
    if not per_gpu_batch_kept:
        return "epochs: " + "; ".join(dict.fromkeys(r["epochs_source"] for r in rows))
    groups = []  # [reason, [global batches]]
    for batch in sorted({r["global_batch"] for r in rows}):
        reason = model.mlperf_epochs_reason(batch)
        if not groups or groups[-1][0] != reason:
            groups.append([reason, []])
        groups[-1][1].append(f"{batch:,}")
    return "epochs: MLPerf table at global batch " + "; ".join(f"{', '.join(batches)} ({reason})"
                                                               for reason, batches in groups)


def notes(rows: list[dict], system: model.PlannedSystem) -> list[str]:
    fit, out = system.fit, [epochs_note(rows, bool(system.per_gpu_batch))]
    chosen = {}
    for r in sorted(rows, key=lambda r: r["gpus"]):
        if r["nccl_algorithm"]:
            chosen.setdefault(r["nccl_algorithm"], []).append(f"{r['gpus']}")
    if chosen:
        out.append("flat: NCCL's " + "; ".join(f"{name} at {', '.join(counts)} GPUs" for name, counts in chosen.items()))
    for r in rows:
        for phase in r.get("phases", [])[1:]:
            accumulated = phase["accumulation_steps"]
            out.append(f"{r['gpus']} GPUs: then {phase['epochs']:g} epochs at {phase['per_gpu_batch']}/GPU"
                       + (f" x {accumulated} accumulated" if accumulated > 1 else "") + " "
                       f"(global {phase['global_batch']:,}) of {phase['image_size']} px: step {phase['step_s'] * 1e3:.2f} ms "
                       f"(compute {phase['compute_s'] * 1e3:.2f}, comm {phase['comm_s'] * 1e3:.2f})")
    if any(r["input_bound"] for r in rows):
        out.append("*: the input pipeline sets the step time")
    if any(r["peak_bound"] for r in rows):
        out.append(f"^: held at the {fit.gpu}'s fastest measured rate, {fit.peak_img_s:,.0f} img/s per GPU (the "
                   "compute fit is not extrapolated past its points)")
    return out


def published_table() -> list[str]:
    """Every published result not used for calibration beside the planner's prediction."""
    lines = ["| system | how it was run | published | planner | error | command | note |",
             "|---|---|---|---|---|---|---|"]
    for check in CHECKS:
        args = parser().parse_args(check["args"])
        command = "python -m train.plan " + " ".join(check["args"])
        first = f"| {check['system']} | {check['run']}"
        try:
            row = plans(system_of(args), gpu_counts(args.gpus))[0][0]
        except UsageError as err:
            lines.append(f"{first} | {_published(check)} | refused: {err} | - | `{command}` | {check['note']} |")
            continue
        for key, show in (("time_s", duration), ("img_per_s_per_gpu", lambda v: f"{v:,.0f} img/s/GPU")):
            if key in check:
                mine = row["time_to_train_s"] if key == "time_s" else row["img_per_s_per_gpu"]
                error = (mine - check[key]) / check[key]
                lines.append(f"{first} | {show(check[key])} | {show(mine)} | {error:+.1%} | `{command}` "
                             f"| {check['note']} |")
    return lines


def _published(check: dict) -> str:
    return duration(check["time_s"]) if "time_s" in check else f"{check['img_per_s_per_gpu']:,.0f} img/s/GPU"


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.published:
            print("\n".join(published_table()))
            return 0
        missing = [flag for flag in ("gpus", "gpu") if not getattr(args, flag)]
        if missing:
            raise UsageError(f"give {', '.join('--' + m for m in missing)}; see python -m train.plan --help")
        counts = gpu_counts(args.gpus)
        report_path = report.checked_path(args.report) if args.report else None  # refused before any work
        system = system_of(args)
        rows, skipped = plans(system, counts)
        if not rows:
            raise UsageError(f"no GPU count fits preset {system.preset}: " + "; ".join(skipped))
        if report_path:
            lines = {name: plans(system_of(args, name), counts)[0] for name in comm.ALGORITHMS}
            written = report.draw_report(lines, report_path, f"{system.preset} on {system.machine.gpu.name}")
        if args.json:
            print(json.dumps(rows))
            for reason in skipped:  # stdout stays one JSON list of runnable counts
                print(f"skipped: {reason}", file=sys.stderr)
        else:
            print("\n".join(header(system) + table(rows) + notes(rows, system) + [f"skipped: {s}" for s in skipped]))
        if report_path:  # with --json on stderr, so that stdout stays one JSON list
            print(f"report: {written}", file=sys.stderr if args.json else sys.stdout)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
