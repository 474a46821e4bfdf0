import pytest
import torch
import torchvision

from models import ARCHS, build_model, eval_flops_per_image, train_flops_per_image


def test_resnet50_parameter_count():
    assert sum(p.numel() for p in build_model("resnet50").parameters()) == 25_557_032  # docs/mlperf.md


def test_resnet50_is_v1_5_stride_on_the_3x3():
    block = build_model("resnet50").layer2[0]
    assert block.conv1.stride == (1, 1) and block.conv2.stride == (2, 2)


@pytest.mark.parametrize("channels_last", [False, True])
def test_torchvision_checkpoint_round_trip_gives_identical_outputs(channels_last):
    torch.manual_seed(0)
    theirs = torchvision.models.resnet50().eval()
    for m in theirs.modules():  # non-trivial BN statistics, so the buffers matter too
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1); m.running_var.uniform_(0.5, 1.5)
    ours = build_model("resnet50", channels_last=channels_last).eval()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = theirs(x)
        got = ours(x.contiguous(memory_format=torch.channels_last) if channels_last else x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    back = torchvision.models.resnet50().eval()
    back.load_state_dict(ours.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(back(x), expected, rtol=0, atol=0)


def test_zero_init_residual_zeroes_last_bn_of_each_block():
    model = build_model("resnet50", zero_init_residual=True)
    blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
    assert len(blocks) == 16 and all(torch.all(b.bn3.weight == 0) for b in blocks)
    assert not torch.all(build_model("resnet50").layer1[0].bn3.weight == 0)


def test_unknown_arch_is_rejected():
    with pytest.raises(ValueError, match="unknown arch"):
        build_model("vgg16")


def test_every_listed_arch_builds():
    for arch in ARCHS:
        with torch.device("meta"):
            assert isinstance(build_model(arch, num_classes=10), torchvision.models.ResNet)


def test_resnet50_training_flops_match_the_published_count():
    flops = train_flops_per_image("resnet50", 224)
    assert abs(flops - 24.3e9) / 24.3e9 < 0.02
    forward = eval_flops_per_image("resnet50", 224)
    assert 2.5 < flops / forward < 3.5  # backward costs about twice the forward


def test_flops_scale_with_image_area_and_are_cached(private_cache):
    small = train_flops_per_image("resnet18", 112)
    large = train_flops_per_image("resnet18", 224)
    assert 3.6 < large / small < 4.4
    assert (private_cache / "flops.json").read_text().count("resnet18/112/1000") == 1
