"""A scripted rollout worker for the streaming pipeline's soak tests: the trajectory-stream calls of a real rollout
worker (`stream_submit` / `stream_poll` / `stream_metrics` / `stream_abort` / `stream_reset`, rsearch_verl/workers/
generation.py) without a model, as a Ray actor, so the real `StreamingPipeline` (rsearch_verl/trainer/
stream_pipeline.py) can be driven for hundreds of steps in a minute and a worker killed for real.

Each submitted group starts when its pool has room, "generates" for a heavy-tailed time drawn from its seq (most a few
milliseconds, one in eight long enough to span several steps), and finishes whole as a batch built by the rollout's
own `rows_to_batch`: `rollout.n` trajectories, some folded into 2-3 rows, prompts and responses of different widths,
policy and observation tokens, per-token versions from its start version to the version at its end (partial
rollouts). One group in `fail_every` fails (as a generation that raised). Nothing here is product code.

    worker = ray.remote(ScriptedStreamWorker).remote(n=2, pool=4, seed=0)
    worker.set_version.remote(step)          # the weights of `step` landed
"""

from __future__ import annotations

import random
import threading
import time

from verl import DataProto

from rsearch_verl.rollout.stream import SEQ
from rsearch_verl.rollout.trajectory import Trajectory, rows_to_batch


class ScriptedStreamWorker:
    def __init__(self, n: int, pool: int, seed: int = 0, fail_every: int = 29, slow_s: float = 0.4):
        self.n, self.pool, self.seed, self.fail_every, self.slow_s = n, pool, seed, fail_every, slow_s
        self.version = 0
        self._lock = threading.Lock()
        self._queued: list[DataProto] = []  # submitted, not started
        self._running: dict[int, tuple[DataProto, int, float]] = {}  # seq -> (prompts, start version, end time)
        self._finished: list[DataProto] = []
        self._failed: list[int] = []
        self.done = 0
        self.calls = 0  # "searches" (for the metrics window)

    # ---- the rollout worker's streaming calls
    def stream_submit(self, groups: list[DataProto]) -> None:
        with self._lock:
            self._queued.extend(groups)
            self._advance()

    def stream_poll(self, wait_s: float = 0.0) -> tuple[list[DataProto], dict]:
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                self._advance()
                if self._finished or self._failed or time.monotonic() >= deadline:
                    finished, self._finished = self._finished, []
                    failed, self._failed = self._failed, []
                    return finished, {**self._state(), "failed": failed}
            time.sleep(0.002)

    def stream_metrics(self) -> dict:
        with self._lock:
            calls, self.calls = self.calls, 0
            return {"metrics": {"search/calls": float(calls)}, **self._state()}

    def stream_abort(self, seqs: list[int]) -> int:
        with self._lock:
            lost = sum(self.n for s in seqs if self._running.pop(s, None) is not None)
            before = len(self._queued)
            self._queued = [g for g in self._queued if int(g.meta_info[SEQ]) not in seqs]
            return lost + (before - len(self._queued)) * self.n

    def stream_reset(self) -> int:
        with self._lock:
            lost = (len(self._running) + len(self._queued) + len(self._finished)) * self.n
            self._running.clear(), self._queued.clear(), self._finished.clear()
            return lost

    def set_version(self, version: int) -> None:
        with self._lock:
            self.version = version

    # ---- the script
    def _state(self) -> dict:
        in_flight = [(s, v) for s, (_, v, _) in sorted(self._running.items())]
        in_flight += [(int(g.meta_info[SEQ]), None) for g in self._queued]
        return {"in_flight": in_flight, "trajectories_in_flight": len(self._running) * self.n,
                "trajectories_done": self.done}  # fmt: skip

    def _advance(self) -> None:
        now = time.monotonic()
        for seq, (prompts, start, end) in list(self._running.items()):
            if now >= end:
                del self._running[seq]
                if seq % self.fail_every == self.fail_every - 1:
                    self._failed.append(seq)
                else:
                    self._finished.append(self._group(prompts, seq, start))
                    self.done += self.n
        while self._queued and (len(self._running) + 1) * self.n <= self.pool:
            prompts = self._queued.pop(0)
            seq = int(prompts.meta_info[SEQ])
            rng = random.Random(f"{self.seed}:{seq}")
            long = rng.random() < 1 / 8
            seconds = rng.uniform(self.slow_s, 3 * self.slow_s) if long else rng.uniform(0.002, 0.02)
            self._running[seq] = (prompts, self.version, now + seconds)

    def _group(self, prompts: DataProto, seq: int, start: int) -> DataProto:
        """The finished group: `n` trajectories of 1-3 rows each, widths and versions drawn from its seq."""
        rng = random.Random(f"{self.seed}:{seq}:rows")
        trajs = []
        for _ in range(self.n):
            traj = Trajectory(list(prompts.non_tensor_batch["prompt_ids"][0]))
            for row in range(rng.randint(1, 3)):
                if row:
                    traj.open_row([7] * rng.randint(4, 40))  # a fold: a wider context than the prompt
                    traj.folds += 1
                for _turn in range(rng.randint(1, 3)):
                    k = rng.randint(1, 12)
                    versions = sorted(rng.randint(start, self.version) for _ in range(k))
                    traj.add([5] * k, 1, [-0.5] * k, "policy", "p" * k, versions)
                    traj.add([6] * rng.randint(0, 20), 0, None, "observation", "o")
                    traj.n_turns += 1
                    self.calls += 1
            traj.n_searches = traj.n_turns
            trajs.append(traj)
        group = prompts.repeat(repeat_times=self.n, interleave=True)
        tensors, non_tensors = rows_to_batch(trajs, dict(group.non_tensor_batch), pad_id=0)
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={SEQ: seq})
