"""End to end: convert a small MLP with converter.convert and train it on sklearn's digits.

fp32, bf16 O1/O2 and fp16 O1/O2 (dynamic loss scaling) must reach a test accuracy within 1.0 point
of fp32 with the same seed, data order and epochs.
"""
from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch import nn

import converter
from converter.train.trainer import MixedPrecisionTrainer

EPOCHS, BATCH, LR = 12, 64, 3e-3


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    features, labels = load_digits(return_X_y=True)
    x = torch.tensor(features / 16.0, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    split = int(0.7 * len(x))
    return x[order[:split]], y[order[:split]], x[order[split:]], y[order[split:]]


def _run(variant: str, data) -> tuple[float, float, nn.Module, MixedPrecisionTrainer | None]:
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(0)
    model = _MLP()
    trainer = None
    if variant == "fp32":
        module = model
        optimizer = torch.optim.Adam(module.parameters(), lr=LR)
    else:
        precision, level = variant.split()
        module = converter.convert(model, (x_train[:BATCH],), precision=precision).module
        optimizer = torch.optim.Adam(module.parameters(), lr=LR)
        trainer = MixedPrecisionTrainer(module, optimizer, precision=precision, master_weights=level == "O2")
    order_gen = torch.Generator().manual_seed(1)
    for _epoch in range(EPOCHS):
        order = torch.randperm(len(x_train), generator=order_gen)
        for start in range(0, len(order), BATCH):
            idx = order[start:start + BATCH]
            loss = nn.functional.cross_entropy(module(x_train[idx]).float(), y_train[idx])
            if trainer is None:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            else:
                trainer.zero_grad()
                trainer.backward(loss)
                trainer.step()
    with torch.no_grad():
        logits = module(x_test).float()
    accuracy = (logits.argmax(-1) == y_test).float().mean().item() * 100
    return accuracy, nn.functional.cross_entropy(logits, y_test).item(), module, trainer


def test_digits_accuracy_matches_fp32(one_thread):
    data = _digits()
    results, losses, modules, trainers = {}, {}, {}, {}
    for variant in ("fp32", "bf16 O1", "bf16 O2", "fp16 O1", "fp16 O2"):
        results[variant], losses[variant], modules[variant], trainers[variant] = _run(variant, data)
    print("digits test accuracy: " + ", ".join(f"{k} {v:.2f}% (loss {losses[k]:.4f})" for k, v in results.items()))
    for variant in ("fp16 O1", "fp16 O2"):
        stats = trainers[variant].stats
        print(f"  {variant}: final scale {stats.scale}, steps {stats.steps}, skipped {stats.skipped}")
    assert results["fp32"] > 90.0, results
    for variant, accuracy in results.items():
        assert abs(accuracy - results["fp32"]) <= 1.0, f"{variant}: {accuracy:.2f}% vs fp32 {results['fp32']:.2f}%"
    for variant, half in (("fp16 O2", torch.float16), ("bf16 O2", torch.bfloat16)):
        stored = {name: p.dtype for name, p in modules[variant].named_parameters()}
        assert stored["fc1.weight"] == stored["fc2.weight"] == half, f"{variant} parameter storage: {stored}"
        assert stored["norm.weight"] == torch.float32, f"{variant} parameter storage: {stored}"
    for precision in ("bf16", "fp16"):
        # O1 (fp32 params cast in the graph) and O2 (half params, fp32 masters) do the same arithmetic.
        o1 = dict(modules[f"{precision} O1"].named_parameters())
        masters = trainers[f"{precision} O2"].master_params
        half_names = [n for n, p in modules[f"{precision} O2"].named_parameters() if p.dtype != torch.float32]
        assert len(masters) == len(half_names) == 4, half_names
        for name, master in zip(half_names, masters):
            assert torch.equal(o1[name], master), f"{precision} {name}: O1 and O2 masters differ"
    reference = dict(modules["fp32"].named_parameters())["fc1.weight"]
    for variant in ("bf16 O1", "fp16 O1"):
        trained = dict(modules[variant].named_parameters())["fc1.weight"]
        assert not torch.equal(trained, reference), f"{variant} trained exactly like fp32: did half precision run?"
