"""What a run prints: its summary line and, without a progress bar, its progress lines (:class:`ProgressLog`)."""
from __future__ import annotations

import time
from typing import Any

from .precision import DEFAULT as DEFAULT_PRECISION


def scale_label(scale: str, precision: str) -> str:
    """What a run's lines show in brackets: the scale, and the precision when it is not float32
    (``smoke, bfloat16``)."""
    return scale if precision == DEFAULT_PRECISION else f"{scale}, {precision}"


def format_summary(s: dict[str, Any]) -> str:
    def fmt(m: dict | None) -> str:
        return "n/a" if not m else " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in m.items())

    loss = s.get("final_train_loss")
    window = s.get("final_train_loss_updates")
    over = f" (last {window} of {s['steps']} updates)" if window else " (last 100 updates: an older run)"
    div = f" DIVERGED at step {s['diverged']['step']}" if s.get("diverged") else ""
    where = scale_label(s["scale"], s.get("precision", DEFAULT_PRECISION))
    return (f"{s['setup']}/{s['optimizer']}/seed-{s['seed']} [{where}]: final_train_loss="
            f"{'n/a' if loss is None else f'{loss:.4f}{over}'} | "
            f"best validation (step {s['best_validation']['step']}): "
            f"{fmt(s['best_validation']['metrics'])} | test: {fmt(s['test'])}{div} | {s['wall_time_s']:.1f}s")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


class ProgressLog:
    """The lines a run without a progress bar prints (``verbose`` and not ``progress``), flushed at once: one per
    validation and at least one every ``every_s`` seconds; the resume line is printed whenever ``verbose``."""

    def __init__(self, name: str, verbose: bool, progress: bool, every_s: float):
        self.name, self.verbose, self.lines, self.every_s = name, verbose, verbose and not progress, every_s
        self.started = self.last_time = time.time()
        self.start_step = self.last_step = 0
        self.wall_before = 0.0

    def begin(self, state: dict[str, Any], total: int, resumed: bool) -> None:
        """Called once the run state is known: this session's clock starts (the remaining time is estimated from
        this session's updates); a resumed run says where it resumed."""
        self.started = self.last_time = time.time()
        self.start_step = self.last_step = state["done"]
        self.wall_before = state["wall"]
        if resumed and self.verbose:
            what = "the test evaluation" if state["training_done"] else f"update {state['done'] + 1}"
            print(f"{self.name}: resuming from step {state['done']} of {total} ({_duration(state['wall'])} trained "
                  f"before; next: {what})", flush=True)

    def step(self, state: dict[str, Any], total: int, spe: int, validated: bool) -> None:
        done, now = state["done"], time.time()
        if not self.lines or not (validated or now - self.last_time >= self.every_s):
            return
        recent = state["losses"][self.last_step:done]
        loss = f"train loss {sum(recent) / len(recent):.4f} (mean of updates {self.last_step + 1}-{done})" \
            if recent else "no update since the last line"
        evals = state["evals"]
        val = f", validation score {evals[-1]['score']:.4f} at step {evals[-1]['step']}" if evals else ""
        rate = (now - self.started) / max(1, done - self.start_step)
        print(f"{self.name}: step {done}/{total} (epoch {done / spe:.2f}), {loss}{val}, "
              f"{_duration(self.wall_before + now - self.started)} elapsed, ~{_duration(rate * (total - done))} left",
              flush=True)
        self.last_time, self.last_step = now, done

