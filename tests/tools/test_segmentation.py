"""DeepLabV3 on a dilated WideResNet-A2 trunk, laid out like the original Vistas snapshot."""


import torch
import torch.nn.functional as F

from iabn.layers.batch_norm import ABN
from iabn.models import DeepLabV3Head, deeplabv3_wider_resnet38, load_original

from helpers import ORIGINAL_KEYS, reference_layout

REFERENCE = ORIGINAL_KEYS / "vistas_wrn38_deeplabv3_keys.txt"


def test_head_and_classifier_keys_match_the_vistas_snapshot():
    with torch.device("meta"):
        model = deeplabv3_wider_resnet38(num_classes=65)
    for section in ("body", "head", "cls"):
        ours = {k: tuple(v.shape) for k, v in getattr(model, section).state_dict().items()}
        assert ours == reference_layout(REFERENCE, section), section


def test_logits_have_the_input_size_and_a_training_step_runs():
    torch.manual_seed(0)
    model = deeplabv3_wider_resnet38(num_classes=5, depth=16)
    x = torch.randn(2, 3, 40, 48)
    logits = model(x)
    assert logits.shape == (2, 5, 40, 48)
    F.cross_entropy(logits, torch.randint(0, 5, (2, 40, 48))).backward()
    assert model.head.map_bn.weight.grad is not None and model.cls.weight.grad is not None


def test_eval_pooling_is_global_when_the_window_covers_the_map_and_local_otherwise():
    torch.manual_seed(0)
    head = DeepLabV3Head(8, 4, 4, dilations=(1, 2, 3), pooling_size=(84, 84)).eval()
    x = torch.randn(1, 8, 6, 7)
    global_mean = x.mean((2, 3), keepdim=True).expand_as(x)
    torch.testing.assert_close(head._image_pool(x), global_mean)
    head.pooling_size = (3, 3)
    local = head._image_pool(x)
    assert local.shape == x.shape
    # an interior position averages its own 3x3 neighbourhood
    torch.testing.assert_close(local[0, :, 2, 3], x[0, :, 1:4, 2:5].mean((1, 2)))


def test_vistas_snapshot_loads_section_by_section():
    torch.manual_seed(0)
    source = deeplabv3_wider_resnet38(num_classes=7, depth=16).eval()
    snapshot = {"state_dict": {
        section: {k: v for k, v in getattr(source, section).state_dict().items()
                  if not k.endswith("num_batches_tracked")}
        for section in ("body", "head", "cls")
    }}
    torch.manual_seed(1)
    target = deeplabv3_wider_resnet38(num_classes=7, depth=16).eval()
    for section in ("body", "head", "cls"):
        assert load_original(getattr(target, section), snapshot, section=section).ok
        loaded = getattr(target, section).state_dict()
        for key, value in snapshot["state_dict"][section].items():
            assert torch.equal(loaded[key], value), (section, key)
    norms = [m for m in target.modules() if isinstance(m, ABN)]
    # WRN-16 trunk: 4 two-conv blocks (bn1, bn2), 2 three-conv blocks (bn1-3), bn_out; head: 3
    assert len(norms) == 4 * 2 + 2 * 3 + 1 + 3 and all(m.gamma_mode == "abs" for m in norms)
