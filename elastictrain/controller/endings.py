"""The end of a run on the members: just-in-time and final checkpoints, the last reports, the final model's
digest and files. Calls on the members and the committer only; the controller decides when (its FINISHED
and CHECKPOINTING states) and what an error here means for the run."""

from __future__ import annotations

from typing import Any

from elastictrain.config import JobConfig
from elastictrain.controller.commits import Committer
from elastictrain.controller.group import Slot, WorkerGroup, describe_remote_error
from elastictrain.controller.ledger import Ledger
from elastictrain.controller.monitor import WorkerMonitor
from elastictrain.events import EventLog


class Endings:
    def __init__(self, config: JobConfig, group: WorkerGroup, ledger: Ledger, committer: Committer,
                 events: EventLog, monitor: WorkerMonitor, store: Any) -> None:
        self.config, self.group, self.rt = config, group, group.rt
        self.ledger, self.committer, self.events, self.monitor, self.store = ledger, committer, events, monitor, store
        self.final_model_uri: str | None = None  # where the final model is once the run finished (None: not saved)
        self.final_digest: dict[str, Any] | None = None

    def save_now(self, members: list[Slot], step: int) -> bool:
        """A checkpoint of ``step`` from ``members``, committed before this returns. True if it was."""
        t = self.config.timeouts
        try:
            self.rt.get([s.actor.save.remote(step) for s in members], timeout=t.poll_s)
            self._collect_reports(members)
            self.committer.drain(timeout=t.poll_s)
        except Exception as e:  # noqa: BLE001
            self.events.emit("checkpoint_failed", step=step, reason=f"just-in-time save failed: {e}")
            return False
        return step in self.committer.committed_steps

    def save_final(self, members: list[Slot]) -> None:
        """With durable checkpoints configured, the final state is always committed (whatever
        ``every_steps``): running the job again answers "already finished", and extending it resumes here."""
        step = self.ledger.last_step
        if self.store is None or not members or not step or step in self.committer.committed_steps:
            return
        self.save_now(members, step)

    def _collect_reports(self, members: list[Slot]) -> None:
        """Wait for the members' in-flight saves and hand every report to the committer."""
        for s in members:
            for report in self.rt.get(s.actor.flush_checkpoints.remote(), timeout=self.config.timeouts.poll_s):
                self.committer.take(s.rank, report)

    def flush_checkpoints(self) -> None:
        """The members' in-flight saves and last polls taken, the queued commits drained."""
        members = self.group.members()
        try:
            self._collect_reports(members)
            for s in members:
                self.monitor.take_poll(s, self.rt.get(s.actor.poll.remote(), timeout=self.config.timeouts.poll_s))
            self.committer.drain(timeout=self.config.timeouts.poll_s)
        except Exception as e:  # noqa: BLE001
            self.events.emit("checkpoint_failed", step=self.ledger.last_step, reason=f"final drain: {e}")

    def gather_final_model(self, members: list[Slot], final_model_root: str | None) -> None:
        """The end of a finished run without gathering the model: every member hashes its own part (the
        digest is combined here from per-parameter sums) and, unless the committed final checkpoint already
        holds the model, writes its part of the final model into ``final_model_root`` (a run root of one
        committed step, checkpoint/final.py). Only hashes, file names and each rank's peak memory come back
        (the end's peaks join the run's per-rank figures). Raises what a member's call raised."""
        if not members:
            return
        from elastictrain.parallel.digest import combine

        t, step = self.config.timeouts.poll_s, self.ledger.last_step
        root = None
        if self.config.train.save_final_model:
            if self.store is not None and step in self.committer.committed_steps:
                self.final_model_uri = self.store.step_uri(step)
            else:
                root = final_model_root
        outs = self.rt.get([s.actor.finish.remote(root) for s in members], timeout=t)
        for s, o in zip(members, outs):  # the end's peaks (the digest, the final write) join the run's
            if o.get("peak") and s.rank is not None:
                self.ledger.note_memory(s.rank, o["peak"])
        self.final_digest = {"step": step, "sha256": combine([o["digest"] for o in outs])}
        if root is not None:
            from elastictrain.checkpoint.store import CheckpointStore

            manifest = CheckpointStore(root).commit(
                outs[0]["step"], [o["report"] for o in outs],
                {"world_size": len(members), "final_model": True, "run_id": self.config.stable_id,
                 "digest": self.final_digest["sha256"]})
            self.final_model_uri = manifest.location

    def failed_at_end(self, e: Exception) -> str:
        """Why a run that trained every step still failed: a worker died while the final model was gathered."""
        step, last = self.ledger.last_step, (self.committer.committed_steps or [None])[-1]
        if last == step:
            where = (f"the final step is committed (checkpoint of step {last}): running the job again answers "
                     "\"already finished\" and `elastictrain ckpt export` writes the model")
        else:
            where = "no checkpoint is committed" if last is None else f"the last committed checkpoint is step {last}"
        return (f"a worker failed while the final model of step {step} was hashed and written: "
                f"{describe_remote_error(e)}; {where}")
