"""The diffusers and vllm-omni rollout engines side by side: seconds per batch, and agreement.

Run from .venv-vllm (`just setup-vllm`). On a GPU, point it at a real Qwen-Image:

    .venv-vllm/bin/python scripts/vllm/bench_engines.py --model Qwen/Qwen-Image \\
        --dtype bfloat16 --device cuda --size 512 --images 8 --steps 10

Without --model it builds flowgrpo's tiny random Qwen-Image; with --cpu it runs vllm-omni
through the test-only CPU platform of tests/vllm (`just test-vllm` installs it). Both engines
sample the same requests (same prompts, seeds, SDE schedule, LoRA weights) in one process;
the first vllm-omni batch includes its start-up and is reported apart. A LoRA update between
rounds checks that the engine follows the policy's weights.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="Qwen-Image folder or hub id (default: a tiny one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=64, help="image height and width")
    parser.add_argument("--images", type=int, default=8, help="images per batch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="use the test CPU platform")
    args = parser.parse_args()
    if args.cpu:
        os.environ["FLOWGRPO_VLLM_CPU_PLATFORM"] = "1"
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import torch

    from flowgrpo_cli.algorithm.schedule import build_step_schedule
    from flowgrpo_cli.engines.base import SampleRequest
    from flowgrpo_cli.engines.diffusers_engine import DiffusersEngine
    from flowgrpo_cli.engines.vllm_omni import VllmOmniEngine
    from flowgrpo_cli.models import load_adapter
    from flowgrpo_cli.store.contract import SamplerSettings
    from flowgrpo_cli.training.policy import DTYPES, Policy, attach_lora

    model = args.model
    if model is None:
        from flowgrpo_cli.models.tiny import build_tiny_pipeline

        model = str(build_tiny_pipeline("qwenimage", Path(tempfile.mkdtemp()) / "tiny"))
    adapter = load_adapter(model, dtype=DTYPES[args.dtype], device=args.device)
    adapter.transformer.requires_grad_(False)
    targets = adapter.default_lora_targets
    attach_lora(adapter.transformer, rank=32, alpha=64, targets=targets, seed=0)
    for parameter in adapter.transformer.parameters():  # as load_policy keeps them
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    policy = Policy(adapter=adapter, mode="lora", device=torch.device(args.device), version="base")

    prompts = [
        'A neon sign that says "OPEN LATE" above a diner door.',
        'A chalkboard menu reading "SOUP 4" in white chalk.',
    ]
    requests = [
        SampleRequest(f"s{i}", i % 2, i % 2, 1000 + i, prompts[i % 2], "", "", "")
        for i in range(args.images)
    ]
    settings = SamplerSettings(
        kind="sde",
        noise_level=0.7,
        guidance_scale=4.0,
        height=args.size,
        width=args.size,
        schedule=build_step_schedule(args.steps),
    )
    engines = {
        name: cls(policy, max_sequence_length=0)
        for name, cls in (("diffusers", DiffusersEngine), ("vllm-omni", VllmOmniEngine))
    }
    conditioning = engines["diffusers"].encode(requests, settings.guidance_scale)

    def timed(name: str):
        started = time.perf_counter()
        out = engines[name].sample(requests, conditioning, settings)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return out, time.perf_counter() - started

    _, first = timed("vllm-omni")
    print(f"vllm-omni first batch (start-up included): {first:.1f} s")
    for round_ in ("base weights", "after a LoRA update"):
        seconds = {name: [] for name in engines}
        for _ in range(args.repeats):
            out = {}
            for name in engines:
                out[name], took = timed(name)
                seconds[name].append(took)
        best = {name: min(values) for name, values in seconds.items()}
        gap = (out["diffusers"].latents - out["vllm-omni"].latents).abs().max()
        logp = (out["diffusers"].log_probs - out["vllm-omni"].log_probs).abs().max()
        print(
            f"{round_}: {args.images} images x {args.steps} steps at {args.size} px: "
            f"diffusers {best['diffusers']:.3f} s, vllm-omni {best['vllm-omni']:.3f} s "
            f"(ratio {best['diffusers'] / best['vllm-omni']:.2f}); max |d latents| "
            f"{float(gap):.2e}, max |d log-prob| {float(logp):.2e}"
        )
        with torch.no_grad():  # a stand-in for an optimizer step on the LoRA weights
            for name, parameter in adapter.transformer.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, 0.02)
        policy.version = "bench-update"
    engines["vllm-omni"].close()


if __name__ == "__main__":
    main()
