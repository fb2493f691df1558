"""Running stages in-process, as the CLI does, for the stage and loop tests; servers for the
reward tests: `flowgrpo serve-reward` in a subprocess, a canned HTTP server in a thread."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from flowgrpo_cli.engines import build_engine
from flowgrpo_cli.stages import rollout, score, update
from flowgrpo_cli.store.rundir import ROLLOUT
from flowgrpo_cli.training.policy import checkpoint_for, load_policy, load_weights
from flowgrpo_cli.training.trainer import Trainer


@contextmanager
def small_edit_sources(area: int = 64 * 64) -> Iterator[None]:
    """The edit family resizes source images to about `area` pixels instead of its pipeline's
    1 MP, in this process, for the duration: for tests of what does not depend on the source's
    size (training, resuming, sharding, export's weights). At 1 MP the tiny model's VAE takes
    about 4 s a source image on one core and every forward carries 4,144 source tokens;
    tests/test_qwenimage_edit.py and test_edit_data's loop run the real size."""
    import pytest

    from flowgrpo_cli.models import qwenimage_edit

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qwenimage_edit, "SOURCE_AREA", area)
        yield


def policy_for(config, run, iteration: int = 0):
    policy = load_policy(config, torch.device("cpu"))
    checkpoint = checkpoint_for(run, iteration)
    if checkpoint is not None:
        load_weights(policy, checkpoint)
    return policy


def engine_for(policy, config):
    return build_engine(config, policy)


def do_rollout(config, run, iteration: int = 0, policy=None):
    policy = policy or policy_for(config, run, iteration)
    return rollout.run(config, run, iteration, engine_for(policy, config))


def do_score(config, run, iteration: int = 0):
    return score.run(config, run, iteration)


def do_update(config, run, iteration: int = 0, policy=None):
    policy = policy or policy_for(config, run, iteration)
    trainer = Trainer(config, policy)
    if iteration > 0:
        trainer.load(run.checkpoint_dir(iteration - 1))
    return update.run(config, run, iteration, trainer), trainer


def do_iteration(config, run, iteration: int = 0):
    policy = policy_for(config, run, iteration)
    do_rollout(config, run, iteration, policy)
    do_score(config, run, iteration)
    return do_update(config, run, iteration, policy)


def stored_rows(run, iteration: int = 0):
    """(TrajectoryRows of every rollout part, stored conditioning by group id)."""
    from flowgrpo_cli.store.rundir import read_manifest
    from flowgrpo_cli.store.trajectory import from_record_batch, read_conditioning, read_table

    folder = run.stage_dir(iteration, ROLLOUT)
    manifest = read_manifest(folder)
    table = read_table([folder / p for p in manifest["trajectory_parts"]])
    rows = from_record_batch(table.combine_chunks().to_batches()[0])
    stored = read_conditioning([folder / p for p in manifest["conditioning_parts"]])
    return rows, stored


@torch.no_grad()
def recompute_log_probs(policy, config, run, iteration: int = 0):
    """Log-probs [N, T] of the stored trajectories under `policy`'s current weights."""
    from flowgrpo_cli.algorithm.sde import STEP_FUNCTIONS
    from flowgrpo_cli.models import Conditioning

    rows, stored = stored_rows(run, iteration)
    cond = Conditioning.cat(
        [Conditioning({k: v.unsqueeze(0) for k, v in stored[g].items()}) for g in rows.group_ids]
    )
    adapter = policy.adapter
    sigmas = adapter.sigmas(config.sampler.num_steps, config.model.height, config.model.width)
    out = []
    for t in range(rows.log_probs.shape[1]):
        x = rows.latents[:, t]
        v = adapter.velocity(x, rows.timesteps[:, t], cond,
                             guidance_scale=config.sampler.guidance_scale)  # fmt: skip
        step = STEP_FUNCTIONS[config.sampler.kind](
            x, v, rows.timesteps[:, t], rows.timesteps_next[:, t],
            noise_level=config.sampler.noise_level, sigma_max_substitute=float(sigmas[1]),
            next_latents=rows.latents[:, t + 1],
        )  # fmt: skip
        out.append(step.log_prob)
    return torch.stack(out, dim=1), rows


def rewrite_part(stage_dir, name: str, write) -> None:
    """Replace a finished stage's part as its writer would have: `write(path)` writes the new
    content, and the manifest's size and digest follow it, so that a test reaches the checks
    on the content's meaning rather than the checksum (tests/test_integrity.py covers that)."""
    from flowgrpo_cli.store.rundir import MANIFEST, atomic_write_json, part_entry, read_manifest

    path = stage_dir / name
    write(path)
    manifest = read_manifest(stage_dir)
    for part in manifest["parts"]:
        if part["name"] == name:
            part.update(part_entry(path, name))
    atomic_write_json(stage_dir / MANIFEST, manifest)


def flip_one_byte(path) -> None:
    """Alter a file as a bad disk or a stray write would: one byte, mid-file, inverted."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@contextmanager
def serving_reward(*arguments: str, announces: str = "serving") -> Iterator[str]:
    """`flowgrpo serve-reward --port 0 ARGUMENTS` in a subprocess; yields its URL once its
    first line (which must contain `announces`) says it serves, and stops it with SIGTERM
    afterwards, from which it must exit cleanly."""
    process = subprocess.Popen(
        [sys.executable, "-m", "flowgrpo_cli", "serve-reward", "--port", "0", *arguments],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = process.stdout.readline() if process.stdout else ""
        assert announces in line, line + (process.stderr.read() if process.stderr else "")
        yield line.split(" at ")[-1].strip()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


@contextmanager
def http_server(handler: type[BaseHTTPRequestHandler], state: Any) -> Iterator[str]:
    """`handler` served on a free local port from a thread, `state` at `self.server.state`;
    yields the server's root URL, and shuts it down afterwards."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    httpd.state = state  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
