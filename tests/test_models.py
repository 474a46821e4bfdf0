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


# BlurPool (--blurpool) ---------------------------------------------------------------------------
def test_blurpool_keeps_torchvisions_weights_and_blurs_before_each_strided_conv():
    torch.manual_seed(0)
    theirs = torchvision.models.resnet50().eval()
    blurred = build_model("resnet50", blurpool=True).eval()
    assert list(blurred.state_dict()) == list(theirs.state_dict())  # the same names, no saved filter
    blurred.load_state_dict(theirs.state_dict())
    # the strided convolutions past the stem (layer2-4's 3x3 and their 1x1 shortcuts): 6 of them
    strided = [name for name, m in blurred.named_modules() if isinstance(m, torch.nn.Conv2d) and max(m.stride) > 1]
    from models.resnet import BlurConv2d
    blurs = [name for name, m in blurred.named_modules() if isinstance(m, BlurConv2d)]
    assert blurs == [n for n in strided if n != "conv1"] and len(blurs) == 6
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert not torch.allclose(blurred(x), theirs(x), atol=1e-3)  # the blur changes the function...
        # ... and is the strided conv of the [1,2,1]x[1,2,1]/16-filtered input, by hand
        conv = blurred.layer2[0].conv2
        inner = torch.randn(1, conv.in_channels, 16, 16)
        by_hand = torch.zeros_like(inner)
        padded = torch.nn.functional.pad(inner, (1, 1, 1, 1))
        weights = {(-1, -1): 1, (-1, 0): 2, (-1, 1): 1, (0, -1): 2, (0, 0): 4, (0, 1): 2, (1, -1): 1, (1, 0): 2, (1, 1): 1}
        for (dy, dx), w in weights.items():
            by_hand += w / 16 * padded[:, :, 1 + dy:17 + dy, 1 + dx:17 + dx]
        expected = torch.nn.functional.conv2d(by_hand, conv.weight, None, conv.stride, conv.padding)
        assert torch.allclose(conv(inner), expected, atol=1e-5)


def test_a_blurpool_model_trains_with_channels_last_and_its_weights_load_into_a_plain_one():
    model = build_model("resnet18", num_classes=10, channels_last=True, blurpool=True)
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    build_model("resnet18", num_classes=10).load_state_dict(model.state_dict())  # strict: every key, every shape
