"""Evaluation batches of one shape: a short batch (the last of the set, or one that lost an unreadable
file) is padded to the run's evaluation batch size, so cuDNN's autotuner and torch.compile see one
shape, and its padded rows are never counted: each validation image once over all ranks."""
import pytest
import torch

from data.loaders import SyntheticLoader
from train.config import Config
from train.engines.single import SingleProcess
from train.evaluate import evaluate, padded
from train.precision import Precision

CLASSES = 4


def loader_of(rank: int = 0, world: int = 1, batch: int = 8, val_images: int = 20) -> SyntheticLoader:
    """Synthetic data whose evaluation on one rank is batches of 8, 8 and 4 images."""
    cfg = Config(loader="synthetic", image_size=8, batch_size=batch, synthetic_images=16,
                 synthetic_val_images=val_images, synthetic_classes=CLASSES)
    return SyntheticLoader(cfg, rank, world, torch.device("cpu"))


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.BatchNorm2d(6), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(6, CLASSES))
    return model.to(memory_format=torch.channels_last).eval()


def hits_by_hand(model, loader, flip: bool) -> tuple[int, int]:
    """(top-1 hits, images) over the loader's evaluation batches as they come, unpadded."""
    hits = images = 0
    with torch.no_grad():
        for x, labels in loader.val_batches():
            logits = model(x) if not flip else (model(x) + model(x.flip(3))) / 2
            hits += int((logits.argmax(1) == labels).sum())
            images += len(labels)
    return hits, images


@pytest.mark.parametrize("flip", [False, True])
def test_an_evaluation_whose_last_batch_is_short_compiles_once(flip):
    """torch.compile, with a backend that counts its graphs and runs them eagerly: one graph for the
    whole evaluation (a short last batch would be a second, with a dynamic batch size)."""
    compiled_graphs = []

    def counting_backend(graph, example_inputs):
        compiled_graphs.append([tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)])
        return graph.forward

    torch._dynamo.reset()
    loader, engine, model = loader_of(), SingleProcess(Config()), small_model()
    assert [len(labels) for _, labels in loader.val_batches()] == [8, 8, 4]
    compiled = torch.compile(model, backend=counting_backend)
    top1, _, images = evaluate(compiled, loader, Precision("fp32", engine.device), engine, flip=flip)
    assert len(compiled_graphs) == 1, compiled_graphs
    hits, _ = hits_by_hand(model, loader, flip)
    assert images == 20 and top1 == hits / 20  # (the padded rows not counted)


def test_padded_rows_are_never_counted_and_every_image_once_over_the_ranks():
    """Each rank of 1, 2 and 3 evaluates its share (the last batch of each short; on 3 ranks 7, 7 and 6
    images in batches of 4): the images and hits over the ranks are those of the set, unpadded."""
    model = small_model()
    expected_hits, _ = hits_by_hand(model, loader_of(), flip=False)
    engine = SingleProcess(Config())  # (each rank's own sums: what the engine's all-reduce adds up)
    for world in (1, 2, 3):
        results = [evaluate(model, loader_of(rank, world, batch=4), Precision("fp32", engine.device), engine)
                   for rank in range(world)]
        assert sum(images for _, _, images in results) == 20, world
        assert round(sum(top1 * images for top1, _, images in results)) == expected_hits, world


def test_a_short_batch_is_padded_with_zero_images_in_its_own_layout():
    batch = torch.randn(3, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    whole = padded(batch, 5)
    assert whole.shape == (5, 3, 4, 4) and whole.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(whole[:3], batch) and not whole[3:].any()
    assert padded(batch, 3) is batch and padded(batch, 0) is batch
    plain = padded(torch.randn(2, 3, 4, 4), 4)
    assert plain.is_contiguous() and plain.shape == (4, 3, 4, 4)
