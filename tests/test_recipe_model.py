"""torchvision's recipe on the model side: label smoothing, MixUp/CutMix, weight decay groups, optimizers, clipping."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms import v2

from lit_imagenet.cli import main
from lit_imagenet.training import optim
from lit_imagenet.training.module import ImageClassifier
from lit_imagenet.training.schedule import scaled_lr
from tests.cli_args import SMALL_ARCH, fit_args

CLASSES = 3


def _batch(dtype: torch.dtype = torch.uint8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 32, 32), generator=generator, dtype=torch.uint8)
    return images if dtype == torch.uint8 else images.float() / 255, torch.tensor([0, 1, 2, 0, 1, 2])


def _network_inputs(model: ImageClassifier) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    model.model.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    return seen


def test_the_training_loss_is_cross_entropy_with_label_smoothing() -> None:
    torch.manual_seed(0)
    model = ImageClassifier(SMALL_ARCH, num_classes=CLASSES, label_smoothing=0.1)
    images, targets = _batch()
    seen = _network_inputs(model)
    loss = model.training_step((images, targets), 0)
    expected = F.cross_entropy(model.model(seen[0]), targets, label_smoothing=0.1)
    assert torch.equal(loss, expected)
    assert not torch.isclose(loss, F.cross_entropy(model.model(seen[0]), targets))  # the smoothing counts


def _torchvision_mix(mixup: float, cutmix: float, images: torch.Tensor, targets: torch.Tensor, seed: int):
    mixers = [v2.MixUp(alpha=a, num_classes=CLASSES) if kind == "mixup" else v2.CutMix(alpha=a, num_classes=CLASSES)
              for kind, a in (("mixup", mixup), ("cutmix", cutmix)) if a > 0]  # fmt: skip
    mixer = mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        return mixer(images, targets)
    finally:
        torch.set_rng_state(state)


@pytest.mark.parametrize(("mixup", "cutmix"), [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_mixup_and_cutmix_give_torchvisions_batch_and_soft_targets_and_their_cross_entropy(
    mixup: float, cutmix: float
) -> None:
    torch.manual_seed(0)
    mixing = {"mixup_alpha": mixup, "cutmix_alpha": cutmix}
    model = ImageClassifier(SMALL_ARCH, num_classes=CLASSES, label_smoothing=0.1, **mixing)
    images, targets = _batch()
    seen = _network_inputs(model)
    state = torch.get_rng_state()
    loss = model.training_step((images, targets), 5)
    assert torch.equal(torch.get_rng_state(), state)  # the draws leave the process's generator as it was

    normalised = model.normalize(images, dtype=torch.float32)  # mixed after normalisation
    mixed, soft = _torchvision_mix(mixup, cutmix, normalised, targets, model._mix_seed(5))
    assert torch.equal(seen[0], mixed)
    assert not torch.equal(mixed, normalised) and soft.shape == (6, CLASSES)
    logits = model.model(mixed)
    smoothed = soft * 0.9 + 0.1 / CLASSES
    assert torch.allclose(loss, -(smoothed * logits.log_softmax(dim=1)).sum(dim=1).mean(), rtol=1e-5)
    # Training accuracy counts against each image's dominant label.
    hits = (logits.argmax(dim=1) == soft.argmax(dim=1)).float().mean()
    assert torch.isclose(model.train_metrics["top1"].compute(), hits)

    again = ImageClassifier(SMALL_ARCH, num_classes=CLASSES, **mixing)
    seen_again = _network_inputs(again)
    again.training_step((images, targets), 5)  # the same batch number: the same draws
    assert torch.equal(seen_again[0], mixed)
    again.training_step((images, targets), 6)
    assert not torch.equal(seen_again[1], mixed)


def test_norm_and_bias_parameters_get_their_own_weight_decay_and_each_group_its_rate(tmp_path: Path) -> None:
    model = ImageClassifier("resnet18", num_classes=CLASSES, norm_weight_decay=0.0, bias_weight_decay=0.0,
                            backbone_lr_scale=0.1)  # fmt: skip
    groups = optim.parameter_groups(model.model, model.head_name, 0.1, 1e-4, 0.0, 0.0)
    norms = {id(p) for m in model.model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}
    biases = {id(p) for name, p in model.model.named_parameters() if name.endswith("bias")}
    for group in groups:
        ids = {id(p) for p in group["params"]}
        no_decay = ids <= norms | biases
        assert no_decay or not ids & (norms | biases)
        assert group["weight_decay"] == (0.0 if no_decay else 1e-4)
    assert sum(len(g["params"]) for g in groups) == len(list(model.model.parameters()))
    assert [g["lr_scale"] for g in groups] == [1.0, 1.0, 0.1, 0.1, 0.1]  # head: weights, bias; backbone: 3 kinds

    default = optim.parameter_groups(model.model, model.head_name, 0.1, 1e-4)
    assert [len(g["params"]) for g in default] == [2, len(list(model.model.parameters())) - 2]  # today's 2 groups

    root = _shapes(tmp_path)
    cli = main(fit_args(root, tmp_path / "run", "--trainer.max_steps", "1", "--model.norm_weight_decay", "0",
                        "--model.bias_weight_decay", "0", "--model.backbone_lr_scale", "0.1", "--model.lr", "0.2",
                        "--model.warmup_epochs", "0", batch_size=4, arch=SMALL_ARCH))  # fmt: skip
    trained = cli.trainer.optimizers[0].param_groups
    base = scaled_lr(0.2, 4)
    assert [g["lr"] for g in trained] == pytest.approx([base * g["lr_scale"] for g in trained], rel=1e-12)
    assert {g["lr_scale"] for g in trained} == {1.0, 0.1}
    assert {g["weight_decay"] for g in trained} == {0.0, 1e-4}


def _shapes(tmp_path: Path) -> Path:
    from lit_imagenet.data.synthetic import make_shapes

    return Path(make_shapes(str(tmp_path / "shapes"), train_per_class=4, val_per_class=2, width=36, height=36,
                            num_classes=CLASSES))  # fmt: skip


@pytest.mark.parametrize("name", ["adamw", "rmsprop"])
def test_adamw_and_rmsprop_have_torchvisions_settings(name: str) -> None:
    groups = optim.parameter_groups(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2)), "2", 1.0, 2e-5)
    optimizer = optim.build_optimizer(name, groups, lr=0.5, momentum=0.9, weight_decay=2e-5, fused=False)
    defaults = optimizer.defaults
    assert defaults["lr"] == 0.5 and defaults["weight_decay"] == 2e-5
    if name == "adamw":
        assert isinstance(optimizer, torch.optim.AdamW)
    else:
        assert isinstance(optimizer, torch.optim.RMSprop)
        assert (defaults["eps"], defaults["alpha"], defaults["momentum"]) == (0.0316, 0.9, 0.9)


def test_fused_is_the_default_on_cuda_but_not_with_gradient_clipping_apex_or_rmsprop() -> None:
    assert optim.fused_by_default("sgd", "cuda", apex=False, gradient_clip_val=None)
    assert optim.fused_by_default("adamw", "cuda", apex=False, gradient_clip_val=0)
    assert not optim.fused_by_default("sgd", "cuda", apex=False, gradient_clip_val=1.0)
    assert not optim.fused_by_default("sgd", "cuda", apex=True, gradient_clip_val=None)
    assert not optim.fused_by_default("rmsprop", "cuda", apex=False, gradient_clip_val=None)
    assert not optim.fused_by_default("sgd", "cpu", apex=False, gradient_clip_val=None)


def test_lightnings_gradient_clipping_clips_the_default_optimizers_gradients(tmp_path: Path) -> None:
    import pytorch_lightning as pl

    before, after = [], []

    def grad_norm(module: nn.Module) -> float:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    class Record(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            # Called once optimizer.step has run the closure (forward, backward, clipping) and stepped.
            trainer.optimizers[0].register_step_post_hook(lambda *_: after.append(grad_norm(pl_module.model)))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # before the clipping
            before.append(grad_norm(pl_module.model))

    root = _shapes(tmp_path)
    args = ["--trainer.max_steps", "3", "--trainer.gradient_clip_val", "0.01"]
    cli = main(fit_args(root, tmp_path / "run", *args, batch_size=4, arch=SMALL_ARCH)[1:], run=False)
    cli.trainer.callbacks.append(Record())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert isinstance(cli.trainer.optimizers[0], torch.optim.SGD) and cli.trainer.global_step == 3
    assert len(after) == 3 and all(n > 0.02 for n in before), before
    assert after == pytest.approx([0.01] * 3, rel=1e-3)


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--model.eval_weights", "ema"], "error: --model.eval_weights ema needs a model trained with an EMA"),
        (["--model.warmup_method", "constant"], "error: --model.warmup_method constant needs --model.warmup_decay"),
        (["--model.mixup_alpha", "-1"], "error: --model.mixup_alpha and cutmix_alpha must be at least 0"),
    ],
)
def test_bad_recipe_options_are_one_line_errors(
    flags: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = _shapes(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(root, tmp_path / "run", *flags, arch=SMALL_ARCH))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(line)
