"""--compile: the model compiled in place by torch.compile trains and evaluates as the eager one does
(same seed: the same losses and weights, to rounding), and its checkpoint is an eager model's
(the same state_dict keys: no `_orig_mod.`), loadable by build_model and by --test-only.

Compiling is slow on a CPU (Inductor runs a C++ compiler for its kernels), so the runs here are the
smallest the trainer takes: ResNet-18 at 16 px, a global batch of 8, 3 steps, 16 validation images."""
import pytest
import torch

from helpers import read_metrics, run_train
from models import build_model
from train.cli import COMPILE_MODES, parse
from train.errors import UsageError

RUN = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 32,
       "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 1,
       "--max-steps", 3, "--log-every", 1, "--workers", 0, "--seed", 3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An eager run and a compiled one of the same seed; Inductor's cache in the test's own folder
    (never the user's), where it also shows that the compiled run did compile."""
    root = tmp_path_factory.mktemp("compile")
    results = {}
    for name, flags in (("eager", []), ("compiled", ["--compile"])):
        results[name] = run_train("--out-dir", name, *RUN, *flags, cwd=root, env=inductor_cache(root))
        assert results[name].returncode == 0, results[name].stderr[-3000:]
        if name == "eager":
            assert not (root / "inductor").exists()  # (so what is there after the compiled run is its own)
    return root, results


def inductor_cache(root) -> dict:
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}


def header_of(output: str) -> str:
    """The line the run starts with, which says what it trains and how."""
    return next(line for line in output.splitlines() if line.startswith("training "))


def metrics_of(run_dir, kind: str) -> list[dict]:
    return [m for m in read_metrics(run_dir) if m["kind"] == kind]


@pytest.mark.slow(seconds=60)  # (45-55 s measured at load 2-3 on 2 cores, 95-135 s at load 7-9: the compiling)
def test_a_compiled_run_trains_and_evaluates_as_the_eager_one(runs):
    root, results = runs
    assert any((root / "inductor").rglob("*.so"))  # Inductor built kernels: the model was compiled
    assert "| fp32 compiled (default) on cpu," in header_of(results["compiled"].stdout)
    assert "| fp32 on cpu," in header_of(results["eager"].stdout)
    assert results["compiled"].stderr.strip() == ""  # nothing printed for compiling on a CPU, no warnings
    eager, compiled = (metrics_of(root / name, "train") for name in ("eager", "compiled"))
    assert [m["step"] for m in compiled] == [1, 2, 3]
    for ours, theirs in zip(compiled, eager, strict=True):  # per-step losses (the log's 5 decimals)
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=2e-5), (ours, theirs)
    weights = {name: torch.load(root / name / "checkpoint.pt", weights_only=True)["model"] for name in results}
    assert list(weights["compiled"]) == list(weights["eager"])
    for key, value in weights["eager"].items():
        torch.testing.assert_close(weights["compiled"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    # the evaluation ran the compiled model in eval mode (BN's running statistics): the eager figures
    evals = {name: metrics_of(root / name, "eval")[-1] for name in results}
    assert evals["compiled"]["eval_images"] == 16
    assert (evals["compiled"]["top1"], evals["compiled"]["top5"]) == (evals["eager"]["top1"], evals["eager"]["top5"])


@pytest.mark.slow(seconds=8)
def test_a_compiled_runs_checkpoint_is_an_eager_models(runs):
    root, _ = runs
    saved = torch.load(root / "compiled" / "checkpoint.pt", weights_only=True)
    model = build_model("resnet18", 10)
    model.load_state_dict(saved["model"])  # strict: key for key the plain model's
    assert saved["config"]["compile"] is True
    tested = run_train("--test-only", "--out-dir", "compiled", cwd=root, env=inductor_cache(root))
    assert tested.returncode == 0, tested.stderr[-3000:]
    evaluated = metrics_of(root / "compiled", "eval")[-1]
    assert tested.stdout.strip().splitlines()[-1] == \
        f"top-1 {evaluated['top1']:.4f}  top-5 {evaluated['top5']:.4f}  (16 images)"


@pytest.mark.slow(seconds=5)
def test_compile_is_a_speed_setting_not_part_of_the_run(runs):
    """The eager run's command started again with --compile is the same run (start-up checks that
    before anything else): the run is over, so nothing to do, not "a run with other settings"."""
    root, _ = runs
    again = run_train("--out-dir", "eager", *RUN, "--compile", "--compile-mode", "reduce-overhead", cwd=root,
                      env=inductor_cache(root))
    assert again.returncode == 0 and "eager holds a finished run" in again.stdout, again.stdout + again.stderr


def test_compile_mode_takes_torchs_mode_names():
    assert parse(["--compile"]).compile_mode == "default"
    assert parse(["--compile", "--compile-mode", "max-autotune"]).compile_mode == "max-autotune"
    assert COMPILE_MODES == ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    with pytest.raises(UsageError, match="unknown --compile-mode 'fast'; choose default, reduce-overhead, "
                                         "max-autotune or max-autotune-no-cudagraphs"):
        parse(["--compile-mode", "fast"])


def test_a_run_counts_one_shape_per_crop_size_and_per_rank_batch_and_one_per_evaluation_mode():
    """run_shapes, which sizes the compile limit: the ffcv-rn50-88ep preset's ramp (160 and 192 px) and
    evaluation make 3 shapes; a batch schedule on 4 ranks adds a per-rank batch for the epochs after
    its change; BatchNorm's recomputation one more; no evaluation, one less."""
    from train.cli import parse
    from train.compiled import run_shapes
    from train.schedule import EpochClock, EpochPlan

    def shapes(*flags, ranks=1):
        cfg = parse(["--preset", "ffcv-rn50-88ep", *map(str, flags)])
        return run_shapes(cfg, EpochPlan.of(cfg, EpochClock.of(cfg, 1_281_167)), ranks)
    assert shapes() == 3
    assert shapes("--batch-schedule", "70:2048", ranks=4) == 4  # (160, 256), (192, 256), (192, 512), eval
    assert shapes("--bn-recompute-batches", 4) == 4
    assert shapes("--eval-every", 0) == 2

@pytest.fixture
def fresh_dynamo():
    """Dynamo without what other tests compiled, its limit restored afterwards; a small limit stands in
    for torch's 8 (fewer shapes, the same rule). (Dynamo's own patch: pytest's monkeypatch would delete
    the setting at the end, and a deleted setting stays hidden from every later compile.)"""
    import torch._dynamo
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        yield
    torch._dynamo.reset()


@pytest.mark.slow(seconds=10)  # (16 s at a load of 10 on 2 cores: Dynamo tracing ResNet-18 four times)
def test_a_resolution_ramp_compiles_once_per_crop_size_and_no_shape_past_the_runs(fresh_dynamo):
    """The trainer's model under compile_in_place through a run of a resolution ramp (16, 24, 32 px)
    with an evaluation each epoch: one graph per crop size and one for the evaluation, each compiled
    once, more than the limit (2 here) allows by itself; a shape the run does not make then runs
    eagerly, compiling nothing. (A backend that only records what it is given keeps it cheap.) Fails
    with torch's automatic dynamic shapes (the second size compiles once more with sizes as
    variables, the third not at all) and with the limit left as it was (the third size runs eagerly)."""
    from train.compiled import compile_in_place, run_shapes
    from train.config import Config
    from train.schedule import EpochClock, EpochPlan
    cfg = Config(image_size=16, resolution_schedule="16:32:0:2:8", epochs=3, global_batch_size=4, eval_every=1,
                 lr=1.0, warmup_epochs=0)
    plan = EpochPlan.of(cfg, EpochClock.of(cfg, 8))
    sizes = [plan.image_size(epoch) for epoch in range(cfg.epochs)]
    assert sizes == [16, 24, 32] and run_shapes(cfg, plan, world_size=1) == 4
    compiled = []  # per graph compiled: the shape of its images and whether it trains

    def recording(graph, inputs):
        images = [tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] == 3
                  and t.shape[0] == 4]
        compiled.append((images, torch.is_grad_enabled()))
        return graph.forward

    model = build_model("resnet18", 10)
    compile_in_place(model, "default", run_shapes(cfg, plan, 1), backend=recording)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images = lambda size: torch.randn(4, 3, size, size).contiguous(memory_format=torch.channels_last)  # noqa: E731
    for size in sizes:
        for _ in range(2):
            model(images(size)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            model(images(32))
        model.train()
    assert compiled == [([(4, 3, 16, 16)], True), ([(4, 3, 32, 32)], False), ([(4, 3, 24, 24)], True),
                        ([(4, 3, 32, 32)], True)]
    model(images(40)).sum().backward()  # not a shape of the run: past the limit, eagerly
    assert len(compiled) == 4
