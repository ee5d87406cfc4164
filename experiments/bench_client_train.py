"""One client's local training round (``fedrobust.training.train``) on each device and precision.

    python -m experiments.bench_client_train --devices cpu,cuda --amp none,bf16,fp16

What a ClientApp's train handler spends on a round: ``train`` on ``--examples`` inputs of a data set's
shape (CIFAR-10's 3x32x32 by default, about one client's share of its 50,000 training images at 20
clients), ``--epochs`` passes at ``--batch-size``, from the same initial weights every time. The inputs
are random tensors of that shape drawn from a fixed seed: the time of a step does not depend on what the
pixels show, and no data set has to be on the machine.

For each device and precision: one untimed warm-up round (CUDA loads its kernels lazily, cuDNN picks its
algorithms), then ``--repeats`` timed rounds. Printed per entry: the median seconds, examples per second,
the speed-up over the CPU in float32, whether every repeat gave the same model bytes (the determinism of
the same seed on that device), and the largest difference of a weight from the CPU float32 result.
``train`` uses deterministic CUDA kernels by default (``deterministic=True``); the entry
``cuda, deterministic=False`` shows what they cost and what they buy.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset

from fedrobust import models, training
from fedrobust.data import dataset_spec


@dataclass
class Entry:
    device: str
    amp: str
    deterministic: bool = True

    @property
    def label(self) -> str:
        return self.device + ("" if self.deterministic else ", deterministic=False")


@dataclass
class Result:
    entry: Entry
    seconds: list[float]
    digests: list[str]
    weights: dict[str, torch.Tensor]


def synthetic_dataset(shape: tuple[int, ...], num_classes: int, examples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn((examples, *shape), generator=generator)
    labels = torch.randint(0, num_classes, (examples,), generator=generator)
    return TensorDataset(inputs, labels)


def digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:12]


def run_entry(entry: Entry, initial: dict[str, torch.Tensor], build: dict, data: TensorDataset,
              args: argparse.Namespace) -> Result:
    device = training.pick_device(entry.device)
    model = models.build_model(**build)
    seconds, digests = [], []
    for repeat in range(args.repeats + 1):  # the first is the warm-up
        model.load_state_dict(initial)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        training.train(model, data, epochs=args.epochs, batch_size=args.batch_size, lr=0.05, momentum=0.9,
                       device=device, amp=entry.amp, seed=1, deterministic=entry.deterministic)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if repeat:
            seconds.append(time.perf_counter() - start)
            digests.append(digest(model))
    weights = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return Result(entry, seconds, digests, weights)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_client_train",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet", choices=models.names())
    parser.add_argument("--shape-of", default="cifar10", help="the data set whose input shape and classes to use")
    parser.add_argument("--examples", type=int, default=2500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--devices", default="cpu,cuda", help="comma-separated: cpu, cuda, cuda:N")
    parser.add_argument("--amp", default="none,bf16,fp16", help=f"comma-separated, of {', '.join(training.AMP_MODES)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per entry, after one warm-up")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads for torch")
    args = parser.parse_args(argv)
    spec = dataset_spec(args.shape_of)
    amps = [a for a in args.amp.split(",") if a]
    unknown = [a for a in amps if a not in training.AMP_MODES]
    if unknown:
        raise SystemExit(f"--amp: unknown precision {unknown[0]!r}; valid: {', '.join(training.AMP_MODES)}")
    devices = [d for d in args.devices.split(",") if d]
    for device in devices:
        try:
            training.pick_device(device)
        except ValueError as err:
            raise SystemExit(f"--devices: {err}") from None
    torch.set_num_threads(args.threads)

    build = {"name": args.model, "input_shape": spec.input_shape, "num_classes": spec.num_classes}
    torch.manual_seed(0)
    model = models.build_model(**build)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())
    data = synthetic_dataset(tuple(spec.input_shape), spec.num_classes, args.examples, seed=0)
    gpu = {d: torch.cuda.get_device_name(d) for d in devices if d.startswith("cuda")}
    print(f"model {args.model}: {params:,} parameters; {args.examples} inputs of shape {tuple(spec.input_shape)}, "
          f"batch {args.batch_size}, {args.epochs} epoch(s); torch {torch.__version__}, {args.threads} CPU "
          f"thread(s){''.join(f', {d} = {name}' for d, name in gpu.items())}")

    # fp16 is for CUDA only (training refuses it elsewhere); bf16 on the CPU is slow on most CPUs but valid.
    entries = [Entry(d, a) for d in devices for a in amps if not (a == "fp16" and not d.startswith("cuda"))]
    entries += [Entry(d, "none", deterministic=False) for d in devices if d.startswith("cuda")]
    results = []
    for entry in entries:
        results.append(run_entry(entry, initial, build, data, args))
        r = results[-1]
        print(f"  {entry.label} {entry.amp}: {', '.join(f'{s:.3f}' for s in r.seconds)} s", flush=True)

    base = next((r for r in results if r.entry.device == "cpu" and r.entry.amp == "none"), None)
    print("| device | precision | seconds (median) | examples/s | vs CPU float32 | same bytes every repeat "
          "| largest weight difference from CPU float32 |")
    print("|---|---|---:|---:|---:|---|---:|")
    for r in results:
        median = statistics.median(r.seconds)
        speedup = f"{statistics.median(base.seconds) / median:.1f}x" if base else "-"
        diff = max((r.weights[k] - base.weights[k]).abs().max().item() for k in r.weights) if base else float("nan")
        same = "yes" if len(set(r.digests)) == 1 else f"no ({len(set(r.digests))} distinct)"
        print(f"| {r.entry.label} | {r.entry.amp} | {median:.3f} | {args.examples * args.epochs / median:,.0f} "
              f"| {speedup} | {same} | {diff:.2e} |")


if __name__ == "__main__":
    main()
