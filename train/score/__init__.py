"""`python -m train.score RUN_DIR [RUN_DIR ...]`: time to quality, throughput, FLOPs, Valid FLOPS
(HPC AI500: FLOPS x (top1 / target) ** n, image classification target 0.763, n 5) and the MLPerf
verdict of training runs; `--time-s T --top1 A [--epochs 90]` scores a published result the same way.

FLOPs are counted, not assumed, from what the run's records say (docs/valid_flops.md): training
FLOPs per image of the run's arch, class count and BlurPool (models.train_flops_per_image) x images
trained, each image at the crop size its epoch record in metrics.jsonl holds (the settings' size for
a record without one), plus forward FLOPs x images evaluated, at each evaluation's crop size and
twice with --eval-flip, as its eval record holds them (config.yaml's settings for a record without
them). The class count is the `num_classes` the run recorded in config.yaml; for a run made
before runs did, it is guessed from the data (`synthetic_classes`, 1000 with a data_dir, else the
embedded ten).

A resumed run (metrics.jsonl has a `resume` record at the start of each later segment, with the
downtime `gap_s`) is measured in training time, the downtime excluded: time to quality, time to
target, throughput and FLOPS; `training_time_s` and `wall_time_s` (first run_start to the end) are
both given (the table's `time s` and `wall s`), and the status gains `, resumed Nx`
(`complete, resumed 1x`); the report breaks the throughput line at each resume and marks it with
a dotted line. The run's end is the last segment's run_stop; a last segment without one is
`preempted` (the PREEMPTED marker beside checkpoint.pt: resumable) or else `crashed`. A run without
`resume` records has training time = wall time, as before.

The status (`complete`, `aborted`, `stopped at max-steps`, `preempted`, `crashed`) says how the run
ended. Only a run that ended by itself (complete or aborted) gets the checker's MLPerf verdict; a run
cut short gets none (`mlperf_compliant` null, `mlperf_verdict` saying why), whatever the checker would
say of its log (it passes a --max-steps run's, which ends with run_stop status success). A resumed
run (more than one start of the trainer in mllog.txt) is `not checkable`: the checker fails the setup
each segment logs again. Without metrics.jsonl, the images are counted from mllog.txt (train_samples,
the global batches, epoch_stop; eval_samples per eval); where that cannot be done (a run stopped
mid-epoch, a resumed one) the run is refused. Without mllog.txt, a run is scored from metrics.jsonl
to its last eval, status `unknown`, and gets no verdict. Runs are named by the shortest ending of
their path that tells them apart (a/run, b/run).

The modules: logs (reading a run directory), flops (FLOP counts, Valid FLOPS), mlperf (the
compliance checker, the olympic mean), level (the HPC AI500 level), runs (a run or a published
result -> Score), report (table and figure), cli (the command line, `python -m train.score`; it
reads this docstring, and this package does not import it).
"""
from train.score.flops import (HPC_AI500_POWER, HPC_AI500_TARGET, IMAGENET_TRAIN_IMAGES, num_classes, run_flop,
                               valid_flops)
from train.score.level import RECIPE_KEYS, hpc_ai500_level
from train.score.logs import read_config, read_metrics, read_mllog, training_seconds
from train.score.mlperf import MLPERF_TARGET, compliance, mlperf_score, run_checker
from train.score.report import draw_report, eval_points, report_figure, run_style, table, throughput_series
from train.score.runs import Score, ScoreError, score_published, score_run

__all__ = ["HPC_AI500_POWER", "HPC_AI500_TARGET", "IMAGENET_TRAIN_IMAGES", "MLPERF_TARGET", "RECIPE_KEYS", "Score",
           "ScoreError", "compliance", "draw_report", "eval_points", "hpc_ai500_level", "mlperf_score",
           "num_classes", "read_config", "read_metrics", "read_mllog", "report_figure", "run_checker", "run_flop",
           "run_style", "score_published", "score_run", "table", "throughput_series", "training_seconds", "valid_flops"]
