"""What a run keeps on disk: its metrics and samples as it goes (MetricsLogger), and a checkpoint to go on from after
an interruption (Checkpoint). Under torchrun every rank calls these; rank 0 writes the files."""

import io
import json
import os
import sys
import time
from collections.abc import Callable

import torch

from plumbing import dist


class MetricsLogger:
    """Appends one JSON object per logged step to OUTPUT_DIR/metrics.jsonl, and the evaluation's sampled answers (the
    "samples" entry of `evaluate`'s metrics), one JSON object each with the step, to OUTPUT_DIR/samples.jsonl.

    With `resume_step` (--resume) both files keep their rows up to that step (those after it were logged by the
    interrupted run after its last checkpoint, and will be logged again), new rows are appended, a step already in the
    file is not written again, and time/elapsed goes on from the last kept row. `last` is the last kept row and
    `last_eval` its latest evaluation ({} on a fresh run).

    Under torchrun every rank calls `log` with its own metrics; they are pooled over ranks by `pool_metrics` (the
    scripts pass common.pool_metrics) and rank 0 writes them. A metric may be a tensor of samples (e.g. lengths), logged
    as their mean.

    After `track` (--track) every row also goes to trackio (see `track`)."""

    def __init__(self, output_dir: str, resume_step: int | None, pool_metrics: Callable[[list[dict]], dict]):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        samples_path = os.path.join(output_dir, "samples.jsonl")
        kept = {path: self._rows_up_to(path, resume_step) for path in (self.path, samples_path)}
        dist.barrier()  # every rank has read the files before rank 0 rewrites them
        self.file, self.samples = io.StringIO(), io.StringIO()  # other ranks than 0 write nothing
        if dist.is_main():  # the kept rows to a side file renamed over the old one: a kill meanwhile loses nothing
            os.makedirs(output_dir, exist_ok=True)
            for path in (self.path, samples_path):
                with open(path + ".partial", "w") as f:
                    f.writelines(json.dumps(row) + "\n" for row in kept[path])
                os.replace(path + ".partial", path)
            self.file, self.samples = open(self.path, "a"), open(samples_path, "a")
        rows = kept[self.path]
        self.last = rows[-1] if rows else {}
        evals = [{k: v for k, v in r.items() if k.startswith("eval/")} for r in rows]
        self.last_eval = next((e for e in evals[::-1] if e), {})
        self.done_step = -1 if resume_step is None else resume_step
        self.start = time.time() - self.last.get("time/elapsed", 0.0)
        self.output_dir, self.tracker, self.pool_metrics = output_dir, None, pool_metrics

    def track(self, flags: dict) -> None:
        """--track: from now on every row also goes to trackio, a local experiment tracker (no account; an SQLite file
        under ~/.cache/huggingface/trackio or $TRACKIO_DIR; `trackio show` opens its dashboard), in the project
        --track-project, as a run named like the output folder with the flags as its config, and the samples as a table.
        After --resume the same run goes on; the steps the interrupted run logged after its last checkpoint are logged
        there a second time (a tracker keeps what it was sent), while metrics.jsonl keeps them once. Rank 0 logs."""
        if not dist.is_main():
            return
        import trackio

        name = os.path.basename(os.path.normpath(self.output_dir))
        config = {k: v for k, v in flags.items() if isinstance(v, (int, float, str, bool))}
        resume = "allow" if self.done_step >= 0 else "never"
        self.tracker = trackio.init(project=flags["track_project"], name=name, config=config, resume=resume)

    @staticmethod
    def _rows_up_to(path: str, step: int | None) -> list[dict]:
        if step is None or not os.path.isfile(path):
            return []
        rows = []
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:  # a line cut short when the interrupted run was killed
                    break
        return [row for row in rows if row["step"] <= step]

    def log(self, step: int, metrics: dict) -> None:
        if step <= self.done_step:  # already in the file (--resume)
            return
        row = {"step": step, "time/elapsed": round(time.time() - self.start, 3)}
        numbers = {k: v for k, v in metrics.items() if k != "samples"}
        if dist.world_size() > 1:
            numbers = self.pool_metrics([numbers])  # over every rank's samples
        row.update(
            {k: (v.item() if v.numel() == 1 else v.mean().item()) if torch.is_tensor(v) else v for k, v in numbers.items()}
        )
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for sample in metrics.get("samples", []):
            self.samples.write(json.dumps({"step": step, **sample}) + "\n")
        self.samples.flush()
        self.last = row
        if self.tracker is not None:
            import trackio

            tracked = {k: v for k, v in row.items() if k != "step"}
            if samples := metrics.get("samples"):
                tracked["samples"] = trackio.Table(columns=list(samples[0]), data=[list(s.values()) for s in samples])
            self.tracker.log(tracked, step=step)

    def close(self) -> None:
        self.file.close()
        self.samples.close()
        if self.tracker is not None:
            self.tracker.finish()


class Checkpoint:
    """--save-every and --resume: what a run needs to go on exactly as if it had never stopped, in
    OUTPUT_DIR/checkpoint.pt. That is the weights the optimizer trains (the policy, and PPO's critic), the optimizer's
    state, the step, the random number generators (`rng`, of the prompt order or the pair order; torch's, of sampling and
    minibatch order; CUDA's) and the `extra` dict a script passes to step_done (its own loop state). Frozen models (the
    reference, a reward model) are reloaded as they were. The checkpoint is written every `--save-every` steps and after an
    interrupt (Ctrl-C or SIGTERM: the step in progress finishes, the checkpoint is saved, the run exits with status 0;
    a second Ctrl-C stops at once), to a side file renamed over the old one, so that a save cut short never replaces a
    good checkpoint. With --resume the constructor restores it; `step` is then its step (0 on a fresh run) and `extra`
    the dict saved with it ({} on a fresh run)."""

    def __init__(self, args, optimizer, rng):
        import signal
        import threading

        self.path = os.path.join(args.output_dir, "checkpoint.pt")
        self.save_every, self.optimizer, self.rng = args.save_every, optimizer, rng
        self.step, self.resumed_step, self.extra, self.interrupted, self.ctrl_c = 0, None, {}, False, 0
        if args.resume:
            self.load()
        elif dist.is_main() and os.path.isfile(self.path):  # --overwrite: the replaced run's checkpoint must not be resumed
            os.remove(self.path)
        self.handlers = {}
        if threading.current_thread() is threading.main_thread():
            self.handlers = {s: signal.signal(s, self.interrupt) for s in (signal.SIGINT, signal.SIGTERM)}

    def interrupt(self, signum, frame) -> None:
        """The first SIGINT or SIGTERM lets the step finish, then saves and exits; a second Ctrl-C (SIGINT) stops at once.
        A repeated SIGTERM does not: a scheduler that signals every process and torchrun forwarding the signal send two."""
        import signal

        self.ctrl_c += signum == signal.SIGINT
        if self.ctrl_c >= 2:  # a second Ctrl-C: stop now, without a checkpoint of this step
            raise KeyboardInterrupt
        if not self.interrupted:
            print("\ninterrupted: the step in progress finishes, then a checkpoint is saved", file=sys.stderr, flush=True)
        self.interrupted = True

    def trained(self) -> list[torch.Tensor]:
        """The weights the optimizer trains (with --lora-rank the adapter's: the frozen ones are not saved)."""
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def rng_state(self):
        return self.rng.get_state() if isinstance(self.rng, torch.Generator) else self.rng.getstate()

    def save(self, step: int, extra: dict | None = None) -> None:
        """Under torchrun every rank calls this (FSDP2 shards are gathered, each rank's torch RNG state is kept) and
        rank 0 writes the file."""
        optimizer = self.optimizer.state_dict()
        cpu = lambda v: dist.full_tensor(v).cpu() if torch.is_tensor(v) else v  # (FSDP2: one gathered tensor at a time)
        optimizer["state"] = {i: {k: cpu(v) for k, v in s.items()} for i, s in optimizer["state"].items()}
        state = {
            "world_size": dist.world_size(),
            "step": step,
            "trained": [dist.full_tensor(p.detach()).cpu() for p in self.trained()],
            "optimizer": optimizer,
            "rng": self.rng_state(),
            "torch_rng": self.per_rank(torch.get_rng_state()),
            "cuda_rng": self.per_rank(torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []),
            "extra": extra or {},
        }
        if dist.is_main():
            torch.save(state, self.path + ".partial")
            os.replace(self.path + ".partial", self.path)
        dist.barrier()

    @staticmethod
    def per_rank(value):
        """value itself in one process; under torchrun the list of every rank's value."""
        return value if dist.world_size() == 1 else dist.gather_objects(value)

    @staticmethod
    def this_ranks(value):
        """This rank's part of a value saved by `per_rank` (the number of processes is checked first, in `load`)."""
        return value if dist.world_size() == 1 else value[dist.rank()]

    @staticmethod
    def shaped_like(saved: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """A saved full tensor laid out like the parameter p: sharded the same way under FSDP2."""
        if not hasattr(p, "device_mesh"):
            return saved
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(saved.to(p.device), p.device_mesh, p.placements)

    def load(self) -> None:
        state = torch.load(
            self.path, map_location="cpu", weights_only=False
        )  # our own file: it holds Python RNG state, not only tensors
        if state.get("world_size", 1) != dist.world_size():
            raise SystemExit(
                f"--resume: {self.path} was saved by {state.get('world_size', 1)} processes, this run has "
                f"{dist.world_size()}: resume with the same --nproc-per-node"
            )
        trained = self.trained()
        if [p.shape for p in trained] != [p.shape for p in state["trained"]]:
            raise SystemExit(f"--resume: {self.path} holds other weights than this run's model (another script or model?)")
        with torch.no_grad():
            for p, saved in zip(trained, state["trained"]):
                p.copy_(self.shaped_like(saved, p))
        optimized = [p for group in self.optimizer.param_groups for p in group["params"]]  # as the state dict numbers them
        for i, p in enumerate(optimized):  # under FSDP2 the optimizer's state is sharded like its parameter, one at a time
            for k, v in state["optimizer"]["state"].get(i, {}).items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    state["optimizer"]["state"][i][k] = self.shaped_like(v, p)
        self.optimizer.load_state_dict(state["optimizer"])
        if isinstance(self.rng, torch.Generator):
            self.rng.set_state(state["rng"])
        else:
            self.rng.setstate(state["rng"])
        torch.set_rng_state(self.this_ranks(state["torch_rng"]))
        if self.this_ranks(state["cuda_rng"]) and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.this_ranks(state["cuda_rng"]))
        self.step = self.resumed_step = state["step"]
        self.extra = state["extra"]
        print(f"resuming after step {self.step} from {self.path}")

    def step_done(self, step: int, extra=None) -> None:
        """Call once a step is logged: saves every --save-every steps, and after an interrupt saves and exits; `extra`, the
        script's own loop state after this step, is saved with it (a dict, or a function that returns it, called only
        when a checkpoint is written: under torchrun on every rank at the same step)."""
        if dist.world_size() > 1:  # one rank interrupted: all of them save and stop at this step
            self.interrupted = bool(dist.all_reduce(torch.tensor(int(self.interrupted)), "max"))
        if self.interrupted or (self.save_every and step % self.save_every == 0):
            self.save(step, extra() if callable(extra) else extra)
        if self.interrupted:
            self.close()
            if dist.is_main():
                print(f"saved the checkpoint of step {step} to {self.path}; continue with --resume", file=sys.stderr)
            raise SystemExit(0)

    def close(self) -> None:
        """Give Ctrl-C and SIGTERM back their previous handlers."""
        import signal

        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        self.handlers = {}
