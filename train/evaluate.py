"""Evaluation: top-1 and top-5 over the whole validation set, every rank its share (`evaluate`, the
loop's at each evaluation point); whether the ranks' models are still replicas (`replicas_differing`);
and `--test-only` (`test_only`): a saved checkpoint evaluated, nothing of the run changed."""
import hashlib

import torch

from data.progress import Progress
from data.transfer import to_device
from models import build_model
from train import checkpoint
from train.config import Config
from train.rundir import current_keys
from train.inference import evaluated_logits
from train.errors import UsageError
from train.startup import on_every_rank, prepare_evaluation


def replicas_differing(model, engine) -> int:
    """How many ranks hold a model (weights and buffers) that is not bit for bit rank 0's."""
    digest = hashlib.sha256()
    for tensor in engine.unwrap(model).state_dict().values():
        digest.update(tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    differs = digest.hexdigest() != engine.broadcast_object(digest.hexdigest())
    return int(engine.all_reduce_sum(to_device(torch.tensor(int(differs)), engine.device)).item())


@torch.no_grad()
def evaluate(model, loader, precision, engine, flip: bool = False) -> tuple[float, float, int]:
    """(top-1, top-5, images) over the whole validation set: global correct / global total. With
    `flip` (--eval-flip) each image's logits are the mean of its own and its mirror image's. A short
    batch (the last, or one that lost an unreadable file) is padded to the loader's evaluation batch
    size, so the model sees one shape (cuDNN's autotuner and torch.compile do not start again); the
    padded rows are not counted."""
    model.eval()
    hits_so_far = torch.zeros(2, dtype=torch.int64, device=engine.device)  # top-1, top-5: on the device until the end
    images = 0
    share = -(-loader.val_images // engine.world_size)  # rank 0's images (its share, rounded up)
    bar = Progress("evaluating", unit="batches", enabled=engine.rank == 0)
    for done, (batch, labels) in enumerate(loader.val_batches(), 1):
        batch = padded(batch, loader.eval_batch_size)
        with precision.autocast():
            logits = evaluated_logits(model, batch, flip)
        top = logits[:len(labels)].topk(min(5, logits.shape[1]), dim=1).indices
        hits = top == labels[:, None]
        hits_so_far += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum()])
        images += len(labels)
        bar.total = bar.total or -(-share // len(batch))  # (the batch size, from the first batch)
        bar.tick(done)
    counts = engine.all_reduce_sum(torch.cat([hits_so_far, to_device(torch.tensor([images]), engine.device)]))
    top1, top5, total = counts.tolist()
    return top1 / max(total, 1), top5 / max(total, 1), total


def padded(batch: torch.Tensor, size: int) -> torch.Tensor:
    """`batch` with zero images after its own up to `size` rows, in its memory layout (as it is when
    it has them, or `size` is 0)."""
    if len(batch) >= size:
        return batch
    layout = torch.channels_last if batch.dim() == 4 and batch.is_contiguous(memory_format=torch.channels_last) \
        else torch.contiguous_format
    whole = torch.empty((size, *batch.shape[1:]), dtype=batch.dtype, device=batch.device, memory_format=layout)
    whole[:len(batch)] = batch
    whole[len(batch):] = 0
    return whole


def test_only(cfg: Config, start=None) -> tuple[float, float, int]:
    """`--test-only`: the checkpoint in --out-dir evaluated over the validation set of its run's data
    (or --data-dir), on any engine and rank count; nothing in the run directory changes. The model is
    the checkpoint's run's (a model flag that contradicts it is refused), its weights the ones the run
    evaluated (--raw-weights: the trained ones). `start`: cli.read_command's (its run directory)."""
    engine, precision, loader, state = prepare_evaluation(cfg, start)
    settings = on_every_rank(engine, lambda: model_settings(cfg, state))
    model = build_model(settings["arch"], loader.num_classes, channels_last=cfg.channels_last,
                        blurpool=settings["blurpool"]).to(engine.device)
    model.load_state_dict(checkpoint.evaluated_weights(state, raw=cfg.raw_weights))  # (--ema-decay: the average)
    top1, top5, images = evaluate(model, loader, precision, engine, cfg.eval_flip)
    if engine.rank == 0:
        print(f"top-1 {top1:.4f}  top-5 {top5:.4f}  ({images} images)", flush=True)
    engine.shutdown()
    return top1, top5, images


# The settings that make the evaluated model what it is: another value builds another network (arch,
# blurpool) or evaluates other weights (ema_decay: the average the run kept, or none). zero_init_residual
# only sets the initial weights and channels_last the memory layout: the checkpoint's weights give the
# same logits whatever they say. (The evaluation's own settings, --eval-image-size, --eval-flip, the
# data and the batch, may change.)
MODEL_SETTINGS = ("arch", "blurpool", "ema_decay")


def model_settings(cfg: Config, state: dict) -> dict:
    """The model settings of the checkpoint's run, from its own record (a --resume that changed them
    after this checkpoint rewrote config.yaml). A flag given to --test-only that contradicts them is
    refused."""
    recorded = current_keys(state.get("config") or {})  # (none in a checkpoint of another script: the flags then)
    settings = {}
    for name in MODEL_SETTINGS:
        given = getattr(cfg, name)
        settings[name] = recorded.get(name, given)
        if name in cfg.flags_given and given != settings[name]:
            raise UsageError(contradiction(name, given, settings[name]))
    return settings


def contradiction(name: str, given, recorded) -> str:
    """The one line that refuses a --test-only flag contradicting the checkpoint's run."""
    if name == "ema_decay" and not given:
        return (f"--ema-decay 0 contradicts the checkpoint (its run kept an average of the weights, --ema-decay "
                f"{recorded:g}, which --test-only evaluates); give --raw-weights instead to evaluate the trained weights")
    if name == "ema_decay":
        kept = f"the average of --ema-decay {recorded:g}" if recorded else "no average of the weights"
        return f"--ema-decay {given:g} contradicts the checkpoint (its run kept {kept}); drop it"
    return f"{as_flag(name, given)} contradicts the checkpoint (its run trained with {as_flag(name, recorded)}); drop it"


def as_flag(name: str, value) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {value}"
